"""Golden renderings of every template, and label masks through real tokenizers."""

import numpy as np
import pytest
import sentencepiece

from neva_pack.encoders import resolve_encoder
from neva_pack.errors import ConfigError
from neva_pack.images import ImagePreprocessor, ImageSource
from neva_pack.records import RawRecord, Turn
from neva_pack.samples import SampleBuilder, image_token_layout
from neva_pack.templates import available_templates, load_template, render
from neva_pack.tokenizer import load_tokenizer

TURNS = (
    Turn("user", "<image>\nWhat is this?"),
    Turn("assistant", "A cat."),
    Turn("user", "Sure?"),
    Turn("assistant", "Yes."),
)
LLAVA_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual content that the "
    "user provides, and assist the user with a variety of tasks using natural language."
)
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions."
)
# ⟦...⟧ marks trained text; <bos>/<eos> are the tokenizer's ids, <image> one image run.
GOLDEN = {
    "plain": "<bos><image>⟦A cat.\nYes.\n⟧",  # the second human turn has no image: nothing of it remains
    "v1": f"<bos>{VICUNA_SYSTEM} USER: <image>\nWhat is this? ASSISTANT: ⟦A cat.<eos>⟧USER: Sure? ASSISTANT: ⟦Yes.<eos>⟧",
    "llama_2": f"<bos>[INST] <<SYS>>\n{LLAVA_SYSTEM}\n<</SYS>>\n\n<image>\nWhat is this? [/INST] ⟦A cat. <eos>⟧"
    "<bos>[INST] Sure? [/INST] ⟦Yes. <eos>⟧",
    "llama_3": f"<bos><|start_header_id|>system<|end_header_id|>\n\n{LLAVA_SYSTEM}<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n<image>\nWhat is this?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n⟦A cat.<|eot_id|>⟧"
    "<|start_header_id|>user<|end_header_id|>\n\nSure?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n⟦Yes.<|eot_id|>⟧",
    "mistral": "<bos>[INST] <image>\nWhat is this? [/INST]⟦A cat.<eos>⟧[INST] Sure? [/INST]⟦Yes.<eos>⟧",
    "chatml": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\nWhat is this?"
    "<|im_end|>\n<|im_start|>assistant\n⟦A cat.<|im_end|>\n⟧<|im_start|>user\nSure?<|im_end|>\n"
    "<|im_start|>assistant\n⟦Yes.<|im_end|>\n⟧",
}


def marked(pieces) -> str:
    out, in_trained = [], False
    for piece in pieces:
        if piece.trained != in_trained:
            out.append("⟦" if piece.trained else "⟧")
            in_trained = piece.trained
        out.append({"text": piece.value, "special": f"<{piece.value}>", "image": "<image>"}[piece.kind])
    return "".join(out) + ("⟧" if in_trained else "")


def test_every_shipped_template_has_a_golden_rendering():
    assert sorted(GOLDEN) == available_templates()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_rendering(name):
    assert marked(render(load_template(name), TURNS)) == GOLDEN[name]


def test_system_prompt_override_and_empty_system():
    template = load_template("v1")
    assert marked(render(template, TURNS[:2], system="Be brief.")).startswith("<bos>Be brief. USER: ")
    assert marked(render(template, TURNS[:2], system="")).startswith("<bos>USER: ")
    mistral = load_template("mistral")
    assert marked(render(mistral, TURNS[:2], system="Be brief.")).startswith("<bos>[INST] Be brief.\n\n<image>")


def test_unknown_template_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown template; choose one of chatml, llama_2"):
        load_template("vicuna_v0")


def test_template_from_a_yaml_file_and_schema_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text('name: mine\nbos: true\nuser: {prefix: "Q: ", suffix: "\\n"}\nassistant: {prefix: "A: ", suffix: "{eos}"}\n')
    assert marked(render(load_template(str(good)), TURNS[:2])) == "<bos>Q: <image>\nWhat is this?\nA: ⟦A cat.<eos>⟧"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nuser: {prefix: 'Q: '}\nassistant: {prefix: 'A: '}\nsep2: '</s>'\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['sep2'\]"):
        load_template(str(bad))


# ---------------------------------------------------------------------------------------------
# Labels through real tokenizers


def make_builder(tokenizer_path, template, max_seq_length=4096, **kwargs):
    tokenizer = load_tokenizer(tokenizer_path)
    encoder = resolve_encoder("openai/clip-vit-large-patch14-336")
    return SampleBuilder(
        tokenizer=tokenizer,
        template=load_template(template),
        image_source=ImageSource(None),
        preprocessor=ImagePreprocessor(encoder, "square"),
        layout=image_token_layout(tokenizer, encoder.image_tokens),
        max_seq_length=max_seq_length,
        **kwargs,
    )


TEXT_RECORD = {
    "id": "t",
    "conversations": [
        {"from": "human", "value": "Name a colour."},
        {"from": "gpt", "value": "Blue, like the sky."},
        {"from": "human", "value": "Another?"},
        {"from": "gpt", "value": "Green."},
    ],
}


def trained_text(sp, sample) -> list[str]:
    """Trained label runs, decoded piece by piece (▁ shown as a space)."""
    runs, current = [], []
    for label in sample.labels:
        if label >= 0:
            current.append(sp.id_to_piece(int(label)))
        elif current:
            runs.append("".join(current).replace("▁", " "))
            current = []
    if current:
        runs.append("".join(current).replace("▁", " "))
    return runs


@pytest.mark.parametrize(
    "template, expected",
    [
        ("v1", [" Blue, like the sky.</s>", " Green.</s>"]),
        ("mistral", ["Blue, like the sky.</s>", "Green.</s>"]),  # "[/INST]Blue": no space, no ▁
        ("llama_2", [" Blue, like the sky. </s>", " Green. </s>"]),  # the " " before </s> is trained
        ("plain", [" Blue, like the sky.<0x0A>Green.<0x0A>"]),  # human text is dropped: one run
    ],
)
def test_labels_cover_exactly_the_answers_and_their_end_of_turn_mistral(mistral_tokenizer_path, template, expected):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    sample = make_builder(mistral_tokenizer_path, template).build(RawRecord(0, TEXT_RECORD))
    assert trained_text(sp, sample) == expected


def test_tokens_labels_are_the_next_token_shift_of_one_id_sequence(mistral_tokenizer_path):
    sample = make_builder(mistral_tokenizer_path, "v1").build(RawRecord(0, TEXT_RECORD))
    trained = sample.labels != -1
    assert np.array_equal(sample.labels[trained], np.append(sample.tokens[1:], 2)[trained])
    assert sample.tokens[0] == 1  # BOS
    assert sample.labels[-1] == 2  # the last answer's EOS is the last target


def test_v1_ids_equal_tokenizing_the_rendered_text_in_one_piece(mistral_tokenizer_path):
    """Masks come from the offsets of the ids emitted for the whole text, not from pieces."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    record = {"conversations": TEXT_RECORD["conversations"][:2]}
    sample = make_builder(mistral_tokenizer_path, "v1", system_prompt="Hi.").build(RawRecord(0, record))
    ids = list(sample.tokens) + [sample.labels[-1]]
    text = "Hi. USER: Name a colour. ASSISTANT: Blue, like the sky."
    assert ids == [1] + sp.encode(text) + [2]


def test_hf_tokenizer_directory_with_chatml_specials(hf_tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    sample = make_builder(hf_tokenizer_dir, "chatml").build(RawRecord(0, TEXT_RECORD))
    im_end = tok.token_to_id("<|im_end|>")
    trained = [int(x) for x in sample.labels if x >= 0]
    runs = tok.decode(trained, skip_special_tokens=False)
    assert runs == "Blue, like the sky.<|im_end|>\nGreen.<|im_end|>\n"
    assert list(sample.tokens).count(tok.token_to_id("<|im_start|>")) == 5
    assert im_end in trained


def test_unicode_offsets_keep_masks_exact(mistral_tokenizer_path):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    record = {"conversations": [{"from": "human", "value": "Dis «bonjour» 👋"}, {"from": "gpt", "value": "Bonjour, ça va ? 🙂"}]}
    sample = make_builder(mistral_tokenizer_path, "v1").build(RawRecord(0, record))
    decoded = sp.decode([int(x) for x in sample.labels if x >= 0])
    assert decoded == "Bonjour, ça va ? 🙂"


def test_template_needing_eos_with_a_tokenizer_without_one(tmp_path, hf_tokenizer_dir):
    import json
    import shutil

    directory = tmp_path / "noeos"
    shutil.copytree(hf_tokenizer_dir, directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ConfigError, match="needs the tokenizer's EOS token"):
        make_builder(directory, "v1")
