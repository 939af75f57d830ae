"""Golden renderings of every template, and label masks through real tokenizers."""

import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from neva_pack.families import ImageSource, image_run_for, resolve_encoder
from neva_pack.core import ConfigError
from neva_pack.families.fixed import encoder_tokens, ImagePreprocessor
from neva_pack.records import RawRecord, RecordError, Turn
from neva_pack.samples import SampleBuilder
from neva_pack.text import Piece, TOKENIZATIONS, available_templates, load_template, load_tokenizer, render

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
NVGPT_SYSTEM = VICUNA_SYSTEM + "\n\n"
NVGPT_ATTRIBUTES = (
    "<extra_id_2>quality:4,toxicity:0,humor:0,creativity:0,helpfulness:4,correctness:4,coherence:4,complexity:4,verbosity:4\n"
)
LLAMA_3 = (
    f"<|start_header_id|>system<|end_header_id|>\n\n{LLAVA_SYSTEM}<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n<image>\nWhat is this?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n⟦A cat.<|eot_id|>⟧"
    "<|start_header_id|>user<|end_header_id|>\n\nSure?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n⟦Yes.<|eot_id|>⟧"
)
CHATML = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\nWhat is this?"
    "<|im_end|>\n<|im_start|>assistant\n⟦A cat.<|im_end|>\n⟧<|im_start|>user\nSure?<|im_end|>\n"
    "<|im_start|>assistant\n⟦Yes.<|im_end|>\n⟧"
)
CHATML_NO_SYSTEM = CHATML.removeprefix("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
YI_34B = (
    "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n⟦A cat.<|im_end|>\n⟧"
    "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n⟦Yes.<|im_end|>⟧"  # NeMo strips the final newline
)
GEMMA4 = (  # Gemma 4's chat template (tests/golden/gemma4/README.md): <bos>, "<|turn>role\n" ... "<turn|>\n", the assistant as model
    "<bos><|turn>user\n<image>\nWhat is this?<turn|>\n<|turn>model\n⟦A cat.<turn|>\n⟧"
    "<|turn>user\nSure?<turn|>\n<|turn>model\n⟦Yes.<turn|>\n⟧"
)
NVGPT = (
    f"<extra_id_0>System\n{NVGPT_SYSTEM}<extra_id_1>User\n<image>\nWhat is this?\n<extra_id_1>Assistant\n"
    f"{NVGPT_ATTRIBUTES}⟦A cat.\n<extra_id_1>⟧User\nSure?\n<extra_id_1>Assistant\n{NVGPT_ATTRIBUTES}⟦Yes.\n<extra_id_1>⟧"
)
# (template, tokenization) -> rendering. ⟦...⟧ marks trained text; <bos>/<eos> are the tokenizer's
# ids, <image> one image run. The nemo renderings are NeMo's conversation.py prompts (EOS written
# <extra_id_7> there, BOS <extra_id_6>); the llava ones are LLaVA's conversation.py prompts.
GOLDEN = {
    ("plain", "nemo"): "<image>⟦A cat.\n⟧",  # one round only; NeMo has no BOS
    ("plain", "llava"): "<bos><image>⟦A cat.\n⟧",
    ("v1", "nemo"): f"{VICUNA_SYSTEM} USER: <image>\nWhat is this? ASSISTANT:⟦ A cat.<eos>⟧ USER: Sure? ASSISTANT:⟦ Yes.<eos>⟧",
    ("v1", "llava"): f"<bos>{VICUNA_SYSTEM} USER: <image>\nWhat is this? ASSISTANT:⟦ A cat.<eos>⟧USER: Sure? ASSISTANT:⟦ Yes.<eos>⟧",
    ("llama_2", "nemo"): f" [INST] <<SYS>>\n{LLAVA_SYSTEM}\n<</SYS>>\n\n<image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧"
    "<bos> [INST] Sure? [/INST]⟦ Yes. <eos>⟧",
    ("llama_2", "llava"): f"<bos>[INST] <<SYS>>\n{LLAVA_SYSTEM}\n<</SYS>>\n\n<image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧"
    "<bos>[INST] Sure? [/INST]⟦ Yes. <eos>⟧",
    ("llama_3", "nemo"): "<|begin_of_text|>" + LLAMA_3,  # written as text: a special token only for Llama-3 tokenizers
    ("llama_3", "llava"): "<bos>" + LLAMA_3,
    ("mistral", "nemo"): "<bos> [INST] <image>\nWhat is this? [/INST]⟦A cat.<eos>⟧ [INST] Sure? [/INST]⟦Yes.<eos>⟧",
    ("mistral", "llava"): "<bos>[INST] <image>\nWhat is this? [/INST]⟦A cat.<eos>⟧[INST] Sure? [/INST]⟦Yes.<eos>⟧",
    ("vicuna_v1", "nemo"): f"{VICUNA_SYSTEM} USER: <image>\nWhat is this? ASSISTANT:⟦ A cat.<eos>⟧ USER: Sure? ASSISTANT:⟦ Yes.<eos>⟧",
    ("vicuna_v1", "llava"): f"<bos>{VICUNA_SYSTEM} USER: <image>\nWhat is this? ASSISTANT:⟦ A cat.<eos>⟧USER: Sure? ASSISTANT:⟦ Yes.<eos>⟧",
    # LLaVA-NeXT's conv_mistral_instruct (llava-v1.6-mistral): Llama-2 style, one BOS, no system
    ("mistral_instruct", "nemo"): "<bos>[INST] <image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧[INST] Sure? [/INST]⟦ Yes. <eos>⟧",
    ("mistral_instruct", "llava"): "<bos>[INST] <image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧[INST] Sure? [/INST]⟦ Yes. <eos>⟧",
    ("llava_mistral_instruct", "nemo"): "<bos>[INST] <image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧[INST] Sure? [/INST]⟦ Yes. <eos>⟧",
    ("llava_mistral_instruct", "llava"): "<bos>[INST] <image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧[INST] Sure? [/INST]⟦ Yes. <eos>⟧",
    ("qwen2_vl", "nemo"): CHATML,  # Qwen2-VL's chat template; <image> is the image run of <|vision_start|>...
    ("qwen2_vl", "llava"): CHATML,
    ("qwen3_vl", "nemo"): CHATML_NO_SYSTEM,  # Qwen3-VL's chat template writes no default system block
    ("qwen3_vl", "llava"): CHATML_NO_SYSTEM,
    ("gemma4", "nemo"): GEMMA4,
    ("gemma4", "llava"): GEMMA4,
    ("internvl", "nemo"): CHATML_NO_SYSTEM,  # InternVL 3.5 (HF)'s chat template: no default system block either
    ("internvl", "llava"): CHATML_NO_SYSTEM,
    ("qwen_1_5", "nemo"): CHATML,  # LLaVA-NeXT / OneVision's conv_qwen
    ("qwen_1_5", "llava"): CHATML,
    ("chatml", "nemo"): CHATML,
    ("chatml", "llava"): CHATML,
    ("yi_34b", "nemo"): YI_34B,
    ("yi_34b", "llava"): YI_34B,
    ("nvgpt", "nemo"): NVGPT,
    ("nvgpt", "llava"): NVGPT,
}


def marked(pieces) -> str:
    out, in_trained = [], False
    for piece in pieces:
        if piece.trained != in_trained:
            out.append("⟦" if piece.trained else "⟧")
            in_trained = piece.trained
        out.append({"text": piece.value, "content": piece.value, "special": f"<{piece.value}>", "image": "<image>"}[piece.kind])
    return "".join(out) + ("⟧" if in_trained else "")


def test_every_shipped_template_has_a_golden_rendering_per_tokenization():
    assert sorted(GOLDEN) == sorted((name, t) for name in available_templates() for t in TOKENIZATIONS)


@pytest.mark.parametrize("name, tokenization", sorted(GOLDEN))
def test_golden_rendering(name, tokenization):
    template = load_template(name, tokenization)
    turns = TURNS[:2] if template.one_round_only else TURNS
    assert marked(render(template, turns)) == GOLDEN[name, tokenization]
    assert template.name == name


def test_a_system_prompt_opens_the_first_inst_of_llava_mistral_instruct():
    """conv_mistral_instruct wraps a non-empty system prompt in <<SYS>> inside the first [INST]."""
    pieces = render(load_template("mistral_instruct"), TURNS[:2], system="Be brief.")
    assert marked(pieces) == "<bos>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n<image>\nWhat is this? [/INST]⟦ A cat. <eos>⟧"


def test_system_prompt_override_and_empty_system():
    template = load_template("v1", "llava")
    assert marked(render(template, TURNS[:2], system="Be brief.")).startswith("<bos>Be brief. USER: ")
    assert marked(render(template, TURNS[:2], system="")).startswith("<bos> USER: ")  # LLaVA and NeMo keep the space
    mistral = load_template("mistral", "llava")
    assert marked(render(mistral, TURNS[:2], system="Be brief.")).startswith("<bos>[INST] Be brief.\n\n<image>")
    assert marked(render(load_template("mistral"), TURNS[:2], system="Be brief.")).startswith(
        "<bos> [INST] Be brief.\n<image>"
    )


@pytest.mark.parametrize("tokenization", sorted(TOKENIZATIONS))
def test_plain_refuses_records_of_more_than_one_round(tokenization):
    with pytest.raises(RecordError) as error:
        render(load_template("plain", tokenization), TURNS)
    assert error.value.reason == "plain_record_shape"


def test_plain_text_only_record_keeps_its_question_under_nemo_and_is_refused_under_llava():
    """NeMo captions a text-only record's answer after its (untrained) question; LLaVA asserts."""
    text_only = (Turn("user", "Name a colour."), Turn("assistant", "Blue."))
    assert marked(render(load_template("plain", "nemo"), text_only)) == "Name a colour.⟦Blue.\n⟧"
    with pytest.raises(RecordError, match="captions an image"):
        render(load_template("plain", "llava"), text_only)


def test_conversation_text_is_never_substituted():
    turns = (Turn("user", "Here: {eos} done {bos}"), Turn("assistant", "Literal {eos}."))
    pieces = render(load_template("v1"), turns)
    assert [p.value for p in pieces if p.kind == "special"] == ["eos"]  # the template's own EOS only
    assert [p.value for p in pieces if p.kind == "content"] == ["Here: {eos} done {bos}", "Literal {eos}."]


def test_unknown_template_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown template; choose one of chatml, gemma4, internvl, llama_2"):
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


def make_builder(tokenizer_path, template, max_seq_length=4096, tokenization="nemo", **kwargs):
    tokenizer = load_tokenizer(tokenizer_path)
    encoder = resolve_encoder("openai/clip-vit-large-patch14-336")
    return SampleBuilder(
        tokenizer=tokenizer,
        template=load_template(template, tokenization),
        image_source=ImageSource(None),
        preprocessor=ImagePreprocessor(encoder, "square"),
        image_run=image_run_for(tokenizer, encoder_tokens(encoder), tokenization=tokenization),
        max_seq_length=max_seq_length,
        tokenization=tokenization,
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
    "template, tokenization, expected",
    [
        ("v1", "nemo", [" Blue, like the sky.</s>", " Green.</s>"]),
        ("v1", "llava", [" Blue, like the sky.</s>", " Green.</s>"]),
        ("mistral", "nemo", ["Blue, like the sky.</s>", "Green.</s>"]),  # "[/INST]Blue": no space, no ▁
        ("llama_2", "nemo", [" Blue, like the sky. </s>", " Green. </s>"]),  # the " " before </s> is trained
        ("llama_2", "llava", [" Blue, like the sky. </s>", " Green. </s>"]),
    ],
)
def test_labels_cover_exactly_the_answers_and_their_end_of_turn_mistral(
    mistral_tokenizer_path, template, tokenization, expected
):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    sample = make_builder(mistral_tokenizer_path, template, tokenization=tokenization).build(RawRecord(0, TEXT_RECORD))
    assert trained_text(sp, sample) == expected


def test_plain_text_only_record_trains_the_answer_after_its_question(mistral_tokenizer_path):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    record = {"conversations": TEXT_RECORD["conversations"][:2]}
    sample = make_builder(mistral_tokenizer_path, "plain").build(RawRecord(0, record))
    assert sp.decode([int(t) for t in sample.tokens]) == "Name a colour.Blue, like the sky."
    assert trained_text(sp, sample) == ["Blue, like the sky.<0x0A>"]  # "." + "Bl" do not merge in Mistral


def test_tokens_labels_are_the_next_token_shift_of_one_id_sequence(mistral_tokenizer_path):
    for tokenization, first in (("nemo", None), ("llava", 1)):
        sample = make_builder(mistral_tokenizer_path, "v1", tokenization=tokenization).build(RawRecord(0, TEXT_RECORD))
        trained = sample.labels != -1
        assert np.array_equal(sample.labels[trained], np.append(sample.tokens[1:], 2)[trained])
        assert sample.labels[-1] == 2  # the last answer's EOS is the last target
        assert (sample.tokens[0] == 1) == (first == 1)  # LLaVA's v1 opens with BOS, NeMo's does not


def test_v1_ids_equal_tokenizing_the_rendered_text_in_one_piece(mistral_tokenizer_path):
    """NeMo tokenizes its v1 prompt in one call (no BOS); masks come from that call's offsets."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    record = {"conversations": TEXT_RECORD["conversations"][:2]}
    sample = make_builder(mistral_tokenizer_path, "v1", system_prompt="Hi.").build(RawRecord(0, record))
    ids = list(sample.tokens) + [sample.labels[-1]]
    text = "Hi. USER: Name a colour. ASSISTANT: Blue, like the sky."
    assert ids == sp.encode(text) + [2]
    llava = make_builder(mistral_tokenizer_path, "v1", system_prompt="Hi.", tokenization="llava").build(RawRecord(0, record))
    assert list(llava.tokens) + [llava.labels[-1]] == [1] + sp.encode(text) + [2]


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


def test_a_records_own_system_prompt_is_conversation_text_not_template_text():
    """nvgpt reads a record's "system" field: a special token or ``{eos}`` typed there is spelled as
    text, as in any turn (it must not become an image marker or an end of turn)."""
    from tests.conftest import SAMPLE_DATA

    template = load_template("nvgpt")
    pieces = render(template, TURNS[:2], record_system="Be nice {eos}")
    assert Piece("content", "Be nice {eos}", False) in pieces
    assert sum(p.kind == "special" for p in pieces) == sum(p.kind == "special" for p in render(template, TURNS[:2]))
    builder = make_builder(SAMPLE_DATA / "tokenizer.model", "nvgpt")
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]
    typed = builder.build(RawRecord(0, {"system": "Be nice <extra_id_4> {eos} </s> {bos}.", "conversations": turns}))
    plain = builder.build(RawRecord(0, {"system": "Be nice.", "conversations": turns}))
    tokenizer = load_tokenizer(SAMPLE_DATA / "tokenizer.model")
    for control in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.token_to_id("<extra_id_4>")):
        assert np.count_nonzero(typed.tokens == control) == np.count_nonzero(plain.tokens == control), control
    assert len(typed.tokens) > len(plain.tokens)  # the typed strings are there, as text


GEMMA4_GOLDEN = Path(__file__).parents[1] / "golden" / "gemma4" / "renderings.json"
"""Gemma 4's released chat template rendering whole conversations (how and from which copy:
tests/golden/gemma4/README.md); each message's content a string, its images ``<|image|>`` markers."""


@pytest.mark.parametrize("case", sorted(json.loads(GEMMA4_GOLDEN.read_text())["cases"]))
def test_gemma4_renders_what_the_released_chat_template_renders(case):
    """The gemma4 template (its file: an install maps the name to its own checkout) on the same
    conversations: the same text, each <image> where the template wrote ``<|image|>`` (the processor
    then expands it to the image run), each message trimmed, the system block only for a system message."""
    golden = json.loads(GEMMA4_GOLDEN.read_text())["cases"][case]
    messages = golden["messages"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    turns = tuple(Turn(m["role"], m["content"].replace("<|image|>", "<image>")) for m in messages if m["role"] != "system")
    template = load_template(str(Path(__file__).parents[2] / "templates" / "gemma4.yaml"))
    spelled = {"text": lambda p: p.value, "content": lambda p: p.value, "special": lambda p: f"<{p.value}>", "image": lambda p: "<|image|>"}
    assert "".join(spelled[p.kind](p) for p in render(template, turns, record_system=system)) == golden["rendering"]
    trained = "".join(p.value for p in render(template, turns, record_system=system) if p.trained)
    assert trained == "".join(m["content"].strip() + "<turn|>\n" for m in messages if m["role"] == "assistant")


def test_gemma4_trims_what_a_template_without_trim_messages_keeps():
    padded = (Turn("user", "  <image>\nHi \n"), Turn("assistant", "\n Yo. "))
    gemma4 = load_template(str(Path(__file__).parents[2] / "templates" / "gemma4.yaml"))
    assert gemma4.trim_messages and not load_template("chatml").trim_messages
    assert marked(render(gemma4, padded, record_system=" Be brief.\n")) == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\n<image>\nHi<turn|>\n<|turn>model\n⟦Yo.<turn|>\n⟧"
    )
    assert marked(render(load_template("chatml"), padded)).endswith("<|im_start|>user\n  <image>\nHi \n<|im_end|>\n<|im_start|>assistant\n⟦\n Yo. <|im_end|>\n⟧")
