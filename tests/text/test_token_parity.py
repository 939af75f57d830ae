"""Token parity with the references: NeMo NeVA's preprocessing (``--tokenization nemo``) and
LLaVA-1.5's (``--tokenization llava``), judged by golden ids + labels that the references' own
code produced (tests/golden/README.md: commits, settings, how they were made).

Every golden record is either **identical** to ours (tokens and labels) or differs for one of the
reasons below, each checked on the record itself, never by a list of ids:

- ``reference_miscount`` (labels only, tokens identical): NeMo and LLaVA place masks by re-tokenizing
  pieces of the prompt and adding up lengths; where a piece tokenizes differently alone than inside the
  prompt their masks move by a token per round, or the arithmetic gives up (content containing a
  template separator, LLaVA's "tokenization mismatch") and trains less. Ours come from the offsets of
  the ids actually emitted. With LLaMA-like tokenizers (both used here: the sample tokenizer has
  LLaMA-2's normaliser settings) NeMo's arithmetic is exact on every ordinary record of plain, v1,
  llama_2, mistral, nvgpt and yi_34b; the miscounts left, each pinned by a test below, are:

  * NeMo ``llama_3`` with Mistral's vocabulary: ``preprocess_llama_3`` measures round 0 as
    ``text_to_ids(rou)`` and round k >= 1 as ``text_to_ids(round_sep + rou)``. In the whole prompt the
    ``>`` ending ``<|eot_id|>`` and the ``<`` opening the next ``<|start_header_id|>`` become the one
    piece ``><``; measured apart they are two (``>``, then the dummy-prefixed ``▁<``). ``cur_len`` so
    runs one token ahead per round boundary: round k's mask is k tokens late (its answer's first k
    pieces ignored, the first k pieces after ``><`` trained). The sample tokenizer has no ``><``.
  * LLaVA ``v1`` with the sample tokenizer: for rounds after the first LLaVA subtracts 1
    (``not tokenizer.legacy``), assuming ``USER`` has one piece more alone (``▁US``, ``ER``) than after
    ``</s>`` (``USER``), as in LLaMA/Mistral; the sample tokenizer splits both alike (``▁U``/``U``,
    ``SER``), so multi-round masks come out one token early per round and LLaVA discards them.
  * content containing a template separator (``adversarial_*`` records).
- ``injection``: conversation text contains a special-token string; the references turn it into a
  control id, we never do (see test_no_control_token_from_conversation_text).
- ``refused``: a record one side refuses and the other accepts (stray ``<image>`` text, which we skip
  as ``placeholder_mismatch``; ``from: user/assistant``, which NeMo/LLaVA reject with a KeyError).
- ``llava_moves_images``: LLaVA moves every ``<image>`` to the front of its turn and collapses several
  into one; we keep them where the user put them.
- ``plain_multi_image``: the references write one image run for a ``plain`` record of several images
  (while passing all the images on); we write one run per image.
- ``empty_answer``: an empty answer; the references render their inference prompt, we train the EOS.
- ``leading_gpt_turn``: nvgpt/yi_34b keep a leading gpt turn as the *user* turn; we drop it (as v1).
- ``llava_text_truncation``: LLaVA cuts text-only records at model_max_length (2048), image records
  not at all; we cut every sample at max_seq_length.

Run: ``python -m pytest tests/text/test_token_parity.py -q`` (the parity claim of docs/tokenization.md).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_tokenizer import build_nemo_specials_tokenizer
from neva_pack.families import ImageSource, image_run_for, missing_nemo_specials, resolve_encoder
from neva_pack.core import ConfigError
from neva_pack.families.fixed import encoder_tokens, ImagePreprocessor
from neva_pack.records import IMAGE_PLACEHOLDER, RawRecord, RecordError, parse_record
from neva_pack.samples import SampleBuilder, truncation
from neva_pack.text import TOKENIZATIONS, available_templates, load_template, load_tokenizer
from neva_pack.files import meta_path, packed_prefix

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
RECORDS = {r["id"]: r for r in map(json.loads, (GOLDEN / "records.jsonl").read_text(encoding="utf-8").splitlines())}
CONTEXT = 4096
"""NeMo's context_length in the goldens: ids are cut to CONTEXT + 1."""
LLAVA_IMAGE = -200
"""LLaVA's IMAGE_TOKEN_INDEX: one id per image in its goldens, 576 positions in the model."""
ENCODER = resolve_encoder("openai/clip-vit-large-patch14-336")  # 576 positions per image, as the goldens
GOLDEN_FILES = sorted(str(p.relative_to(GOLDEN)) for p in GOLDEN.glob("*/*.jsonl"))
ALLOWED = {
    "identical", "reference_miscount", "injection", "refused", "llava_moves_images", "plain_multi_image",
    "empty_answer", "leading_gpt_turn", "llava_text_truncation",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_paths(tmp_path_factory, sample_tokenizer_path, mistral_tokenizer_path) -> dict[str, Path]:
    return {
        "sample": sample_tokenizer_path,
        "mistral": mistral_tokenizer_path,
        "mistral_nemo": build_nemo_specials_tokenizer(tmp_path_factory.mktemp("mistral_nemo")),
    }


def make_builder(tokenizer_path: Path, template: str, tokenization: str) -> SampleBuilder:
    tokenizer = load_tokenizer(tokenizer_path)
    loaded = load_template(template, tokenization)
    return SampleBuilder(
        tokenizer=tokenizer,
        template=loaded,
        image_source=ImageSource(None),
        preprocessor=ImagePreprocessor(ENCODER, "square"),
        image_run=image_run_for(
            tokenizer, encoder_tokens(ENCODER), tokenization=tokenization, patch_token=loaded.image_patch_token
        ),
        max_seq_length=CONTEXT,
        tokenization=tokenization,
    )


built_once = lru_cache(maxsize=None)(make_builder)
"""A builder per (tokenizer, template, tokenization), for the properties: loading the tokenizer is
most of an example's time, and encoding changes nothing in the builder."""


def ours(builder: SampleBuilder, record: dict) -> dict:
    """Tokens/labels of one record through the builder's text side, cut like a real run."""
    try:
        ids, trained, image_starts = builder.encode(parse_record(RawRecord(0, record)))
    except RecordError as error:
        return {"error": error.reason}
    if len(ids) > CONTEXT + 1:
        cut, _ = truncation(image_starts, builder.image_run.positions, CONTEXT)
        ids, trained = ids[:cut], trained[:cut]
    return {"tokens": ids[:-1].tolist(), "labels": np.where(trained[1:], ids[1:], -1).tolist()}


def expand_llava_images(line: dict, patch_id: int) -> dict:
    """LLaVA's one -200 per image -> 576 patch positions, labelled as LLaVA's model does (golden README)."""
    if "tokens" not in line or LLAVA_IMAGE not in line["tokens"]:
        return line
    tokens, labels = [], []
    for token, label in zip(line["tokens"], line["labels"]):
        label = -1 if label == LLAVA_IMAGE else label
        if token == LLAVA_IMAGE:
            tokens += [patch_id] * encoder_tokens(ENCODER)
            labels += [-1] * (encoder_tokens(ENCODER) - 1) + [label]
        else:
            tokens.append(token)
            labels.append(label)
    return {**line, "tokens": tokens, "labels": labels}


def trained_runs(labels) -> list[tuple[int, int]]:
    trained = np.concatenate([[False], np.asarray(labels) != -1, [False]])
    edges = np.flatnonzero(trained[1:] != trained[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def is_reference_miscount(golden_labels, our_labels) -> bool:
    """The reference's masks are ours moved by at most two tokens per round so far, or a subset of ours
    (its round arithmetic gave up part-way: a separator inside content, LLaVA's "tokenization mismatch")."""
    gold, mine = np.asarray(golden_labels), np.asarray(our_labels)
    if ((gold != -1) <= (mine != -1)).all():
        return True
    gold_runs, our_runs = trained_runs(gold), trained_runs(mine)
    return len(gold_runs) == len(our_runs) and all(
        abs(g[0] - o[0]) <= 2 * (k + 1) and abs(g[1] - o[1]) <= 2 * (k + 1)
        for k, (g, o) in enumerate(zip(gold_runs, our_runs))
    )


@lru_cache(maxsize=None)
def special_strings(tokenizer_path: Path) -> tuple[str, ...]:
    """Texts of the tokenizer's control/user-defined pieces, plus the slow tokenizer's specials."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    pieces = [sp.IdToPiece(i) for i in load_tokenizer(tokenizer_path).control_ids]
    return (*pieces, "</s>", "<s>", "<unk>")


def llava_rewrites(record: dict) -> bool:
    """Whether LLaVA's preprocess_multimodal changes a turn: <image> moved to the front, several collapsed."""
    for turn in record["conversations"]:
        value = turn["value"]
        if IMAGE_PLACEHOLDER in value:
            moved = (IMAGE_PLACEHOLDER + "\n" + value.replace(IMAGE_PLACEHOLDER, "").strip()).strip()
            if moved != value:
                return True
    return False


def classify(line: dict, mine: dict, record: dict, builder: SampleBuilder, tokenization: str) -> str:
    turns = record["conversations"]
    if "error" in line or "error" in mine:
        if "error" in line and "error" in mine:
            return "identical"  # both refuse the record
        stray_image = mine.get("error") == "placeholder_mismatch"
        role_names = {t["from"] for t in turns} & {"user", "assistant"}
        if stray_image or role_names:
            return "refused"
        return "leading_gpt_turn" if turns[0]["from"] == "gpt" else "unexplained"
    if mine["tokens"] == line["tokens"]:
        if mine["labels"] == line["labels"]:
            return "identical"
        return "reference_miscount" if is_reference_miscount(line["labels"], mine["labels"]) else "unexplained"
    text = "".join(t["value"] for t in turns)
    if any(s in text for s in special_strings(Path(builder.tokenizer.name))):
        return "injection"
    if tokenization == "llava" and llava_rewrites(record):
        return "llava_moves_images"
    images = record.get("image", [])
    if builder.template.one_round_only and isinstance(images, list) and len(images) > 1:
        return "plain_multi_image"
    if any(t["from"] == "gpt" and not t["value"] for t in turns):
        return "empty_answer"
    if turns[0]["from"] == "gpt":
        return "leading_gpt_turn"
    if tokenization == "llava" and "image" not in record and len(line["tokens"]) < len(mine["tokens"]):
        return "llava_text_truncation"
    return "unexplained"


@lru_cache(maxsize=None)
def golden_lines(name: str) -> tuple[dict, ...]:
    return tuple(map(json.loads, (GOLDEN / name).read_text(encoding="utf-8").splitlines()))


def parity(name: str, tokenizer_paths: dict[str, Path]) -> dict[str, list[str]]:
    tokenization = name.split("/")[0]
    template, tokenizer = Path(name).stem.split("__")
    builder = make_builder(tokenizer_paths[tokenizer], template, tokenization)
    outcome: dict[str, list[str]] = {}
    for line in golden_lines(name):
        line = expand_llava_images(line, builder.image_run.patch_id)
        record = RECORDS[line["id"]]
        reason = classify(line, ours(builder, record), record, builder, tokenization)
        outcome.setdefault(reason, []).append(line["id"])
    return outcome


def test_the_goldens_cover_every_template_convention_and_tokenizer():
    covered = {(n.split("/")[0], Path(n).stem.split("__")[0]) for n in GOLDEN_FILES}
    nemo_templates = {"plain", "v1", "llama_2", "llama_3", "mistral", "nvgpt", "yi_34b"}
    assert covered == {("nemo", t) for t in nemo_templates} | {("llava", t) for t in ("plain", "v1", "llama_2")}
    assert nemo_templates <= set(available_templates()) and set(TOKENIZATIONS) == {"nemo", "llava"}
    assert all(len(golden_lines(n)) >= 30 for n in GOLDEN_FILES)


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_token_parity_with_the_reference(name, tokenizer_paths):
    outcome = parity(name, tokenizer_paths)
    assert "unexplained" not in outcome, outcome.get("unexplained")
    assert set(outcome) <= ALLOWED
    if name.startswith("nemo/") and "llama_3__mistral_nemo" not in name:
        # LLaMA-like tokenizers: NeMo's masks are exact except where its round arithmetic breaks on
        # adversarial content (a separator typed inside an answer)
        assert all(i.startswith("adversarial_") for i in outcome.get("reference_miscount", []))


DELIBERATE = {
    "image_field_without_placeholder": "refused",
    "roles_user_assistant": "refused",
    "empty_final_answer": "empty_answer",
    "first_turn_from_gpt": "leading_gpt_turn",
    "multi_image_two_same_turn": "plain_multi_image",
    "multi_image_two_mid_turn": "plain_multi_image",
    "long_three_images_over_context": "plain_multi_image",
}
"""The ordinary (non-adversarial) records where we differ from NeMo on purpose, and why."""
NEMO_EXACT = [
    f"nemo/{template}__{tokenizer}.jsonl"
    for template in ("plain", "v1", "llama_2", "mistral", "nvgpt", "yi_34b")
    for tokenizer in ("sample", "mistral_nemo")
]
"""NeMo's masks are exact with LLaMA-like tokenizers for these (llama_3: see the '><' test)."""


@pytest.mark.parametrize("name", [*NEMO_EXACT, "nemo/llama_3__sample.jsonl"])
def test_nemo_tokens_and_labels_are_identical_on_every_ordinary_record(name, tokenizer_paths):
    """The issue's finding, closed: no leading <s>, no "▁" after an image end, labels as NeMo's, for
    both LLaMA-like tokenizers; only adversarial records and the deliberate differences remain."""
    outcome = parity(name, tokenizer_paths)
    for reason, ids in outcome.items():
        for record in ids:
            if not record.startswith("adversarial_"):
                assert reason in ("identical", DELIBERATE.get(record)), (record, reason)
    assert len(outcome["identical"]) >= 30


def boundary_merge(tokenizer_path: Path, before: str, after: str) -> int:
    """How many pieces fewer ``before + after`` has than the two tokenized apart (NeMo's way)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    return len(sp.encode(before)) + len(sp.encode(after)) - len(sp.encode(before + after))


def test_nemo_llama_3_masks_are_late_by_one_token_per_merged_round_boundary(tokenizer_paths):
    """NeMo measures llama_3's rounds apart; where "<|eot_id|>" + "<|start_header_id|>" tokenize with
    one piece fewer together ("><" in Mistral's vocabulary), round k's golden mask is ours k tokens
    later (end capped at the sequence end). Every multi-round ordinary record shows exactly that."""
    eot, header = "<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\n"
    assert boundary_merge(tokenizer_paths["sample"], eot, header) == 0  # hence llama_3__sample is exact
    assert boundary_merge(tokenizer_paths["mistral_nemo"], eot, header) == 1
    builder = make_builder(tokenizer_paths["mistral_nemo"], "llama_3", "nemo")
    late = []
    for line in golden_lines("nemo/llama_3__mistral_nemo.jsonl"):
        record = RECORDS[line["id"]]
        if "error" in line or line["id"].startswith("adversarial_") or line["id"] in DELIBERATE:
            continue
        mine = ours(builder, record)
        assert mine["tokens"] == line["tokens"]
        length = len(line["labels"])
        expected = [(start + k, min(end + k, length)) for k, (start, end) in enumerate(trained_runs(mine["labels"]))]
        assert trained_runs(line["labels"]) == expected, line["id"]
        if mine["labels"] != line["labels"]:
            late.append(line["id"])
    multi_round = {i for i, r in RECORDS.items() if sum(t["from"] == "gpt" for t in r["conversations"]) > 1}
    assert set(late) == multi_round - set(DELIBERATE) - {i for i in multi_round if i.startswith("adversarial_")}
    assert len(late) == 6



def test_llava_v1_multi_round_masks_hinge_on_its_legacy_correction(tokenizer_paths):
    """LLaVA's preprocess_v1 (legacy=False) subtracts 1 per round after the first: it assumes "USER"
    opening a round has one piece more alone ("▁US", "ER") than after "</s>" ("USER"). True for
    Mistral; the sample tokenizer splits both alike, so there LLaVA's multi-round masks come out a token
    early per round and its own check discards them (all labels ignored), except past model_max_length
    where it does not check."""
    extra = {}
    for name in ("sample", "mistral"):
        tokenizer = load_tokenizer(tokenizer_paths[name])
        extra[name] = len(tokenizer.encode("USER").ids) - len(tokenizer.encode_literal("USER").ids)
    assert extra == {"sample": 0, "mistral": 1}
    multi_round = {i for i, r in RECORDS.items() if sum(t["from"] == "gpt" for t in r["conversations"]) > 1}
    def ordinary_moved(name: str) -> list[str]:
        moved = parity(name, tokenizer_paths).get("reference_miscount", [])
        return [i for i in moved if not i.startswith("adversarial_")]

    assert not ordinary_moved("llava/v1__mistral.jsonl")
    moved = ordinary_moved("llava/v1__sample.jsonl")
    assert set(moved) <= multi_round and len(moved) == 5
    builder = make_builder(tokenizer_paths["sample"], "v1", "llava")
    for line in golden_lines("llava/v1__sample.jsonl"):
        if line["id"] in moved:
            labels = expand_llava_images(line, builder.image_run.patch_id)["labels"]
            if "reference_printed" in line:  # "tokenization mismatch": everything ignored
                assert set(labels) == {-1}
            else:  # past model_max_length: no check, round k's mask k tokens early
                assert len(line["tokens"]) > 2048
                mine = trained_runs(ours(builder, RECORDS[line["id"]])["labels"])
                assert trained_runs(labels) == [(a - k, b - k) for k, (a, b) in enumerate(mine)]


# ---------------------------------------------------------------------------------------------
# Conversation text can never produce a control token


SPECIAL_TEXTS = [
    "</s>", "<s>", "<unk>", "<extra_id_0>", "<extra_id_1>", "<extra_id_3>", "<extra_id_4>", "<extra_id_5>",
    "<extra_id_6>", "<extra_id_7>", "＜extra_id_7＞", IMAGE_PLACEHOLDER, "[INST]", "[/INST]", "<<SYS>>",
    "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|begin_of_text|>", "{eos}", "{bos}", "{system}",
]  # fmt: skip
"""Special-token strings and template placeholders a user might type (＜...＞ becomes <...> in a tokenizer
with an NFKC normaliser)."""


def control_ids_in(ids, builder) -> list[int]:
    return [int(i) for i in ids if int(i) in builder.tokenizer.control_ids]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    tokenization=st.sampled_from(sorted(TOKENIZATIONS)),
    template=st.sampled_from(["v1", "llama_2", "mistral", "nvgpt", "yi_34b", "llama_3", "plain", "chatml"]),
)
def test_no_control_token_from_conversation_text(data, tokenization, template, tokenizer_paths):
    """Whatever the user types, the control ids are exactly those of the same conversation with
    plain words: the ones the template put there (an image run, BOS/EOS, nvgpt's <extra_id_1>)."""
    tokenizer = data.draw(st.sampled_from(["sample", "mistral_nemo"]))
    builder = built_once(tokenizer_paths[tokenizer], template, tokenization)
    word = st.sampled_from(["a", "cat", " ", "\n", "é", "x y"])
    piece = st.one_of(st.sampled_from([s for s in SPECIAL_TEXTS if s != IMAGE_PLACEHOLDER]), word)
    texts = [data.draw(st.lists(piece, min_size=1, max_size=6).map("".join)) for _ in range(4)]
    rounds = 1 if builder.template.one_round_only else 2
    turns = [
        {"from": "human" if k % 2 == 0 else "gpt", "value": ("<image>\n" if k == 0 else "") + texts[k]}
        for k in range(2 * rounds)
    ]
    record = {"image": "a.jpg", "conversations": turns}
    plain = {"image": "a.jpg", "conversations": [{**t, "value": "<image>\nw" if k == 0 else "w"} for k, t in enumerate(turns)]}
    ids, _, _ = builder.encode(parse_record(RawRecord(0, record)))
    reference, _, _ = builder.encode(parse_record(RawRecord(0, plain)))
    assert Counter(control_ids_in(ids, builder)) == Counter(control_ids_in(reference, builder))


@pytest.mark.parametrize("tokenization", sorted(TOKENIZATIONS))
def test_typed_eos_and_bos_placeholders_stay_text(tokenization, mistral_tokenizer_path):
    """The issue's regression: "Here: {eos} done" trained as [▁Here, :, ▁, </s>, ▁, ▁done, </s>]."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_tokenizer_path))
    builder = make_builder(mistral_tokenizer_path, "v1", tokenization)
    record = {"conversations": [{"from": "human", "value": "Say {bos}"}, {"from": "gpt", "value": "Here: {eos} done"}]}
    ids, trained, _ = builder.encode(parse_record(RawRecord(0, record)))
    assert list(ids).count(2) == 1 and ids[-1] == 2  # the template's EOS only
    assert list(ids).count(1) == (tokenization == "llava")  # LLaVA's v1 opens with BOS, NeMo's has none
    assert sp.decode([int(i) for i in ids[trained]]) == "Here: {eos} done"


def test_typed_nemo_specials_are_spelled_as_text(tokenizer_paths):
    """NeMo turns a typed <extra_id_7> into EOS (id 2) and a typed <extra_id_4> into an image start;
    we spell them as ordinary pieces, leaving every other token as NeMo's one call gives it."""
    builder = make_builder(tokenizer_paths["mistral_nemo"], "v1", "nemo")
    record = {"conversations": [{"from": "human", "value": "a <extra_id_4> b"}, {"from": "gpt", "value": "c<extra_id_7>"}]}
    ids, _, _ = builder.encode(parse_record(RawRecord(0, record)))
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_paths["mistral_nemo"]))
    pieces = [sp.IdToPiece(int(i)) for i in ids]
    assert "<extra_id_4>" not in pieces and "<extra_id_7>" not in pieces and list(ids).count(2) == 1
    assert sp.decode([int(i) for i in ids]).endswith("a <extra_id_4> b ASSISTANT: c<extra_id_7>")


# ---------------------------------------------------------------------------------------------
# A tokenizer without NeMo's image tokens


def test_missing_nemo_image_tokens_are_named_with_the_way_out(mistral_tokenizer_path, sample_tokenizer_path):
    plain = load_tokenizer(mistral_tokenizer_path)
    image_run = image_run_for(plain, encoder_tokens(ENCODER), tokenization="nemo")
    message = missing_nemo_specials(plain, "nemo", image_run)
    assert "<extra_id_4>/<extra_id_5>" in message and "--tokenization llava" in message
    assert missing_nemo_specials(plain, "llava", image_run_for(plain, 576, tokenization="llava")) is None
    explicit = image_run_for(plain, encoder_tokens(ENCODER), start_id=5, end_id=6)
    assert missing_nemo_specials(plain, "nemo", explicit) is None
    nemo = load_tokenizer(sample_tokenizer_path)
    assert missing_nemo_specials(nemo, "nemo", image_run_for(nemo, 576)) is None


def test_warning_at_start_and_strict_makes_it_an_error(sample_dataset, mistral_tokenizer_path, tmp_path, capsys):
    from neva_pack.config import PreprocessConfig
    from neva_pack.pipeline import build_sample_builder

    common = dict(
        data_path=sample_dataset["data_path"],
        image_folder=sample_dataset["image_folder"],
        tokenizer_path=mistral_tokenizer_path,
        output_dir=tmp_path / "out",
        conv_template="v1",
    )
    build_sample_builder(PreprocessConfig(**common))
    assert "warning: tokenizer" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--strict: tokenizer .* has no <extra_id_4>/<extra_id_5>"):
        build_sample_builder(PreprocessConfig(**common, strict=True))
    build_sample_builder(PreprocessConfig(**common, strict=True, tokenization="llava"))  # explicit ids chosen
    assert capsys.readouterr().err == ""


def test_tokenization_is_in_the_fingerprint_and_validated(sample_dataset, tmp_path):
    from neva_pack.config import PreprocessConfig

    common = dict(
        data_path=sample_dataset["data_path"], tokenizer_path=sample_dataset["tokenizer_path"], output_dir=tmp_path
    )
    nemo, llava = PreprocessConfig(**common), PreprocessConfig(**common, tokenization="llava")
    assert nemo.tokenization == "nemo"
    assert nemo.sample_fingerprint()["tokenization"] == "nemo" and llava.sample_fingerprint()["tokenization"] == "llava"
    with pytest.raises(ConfigError, match="--tokenization 'hf': choose one of nemo, llava"):
        PreprocessConfig(**common, tokenization="hf")


@pytest.mark.parametrize("tokenization", sorted(TOKENIZATIONS))
def test_typed_added_tokens_of_a_hugging_face_tokenizer_are_spelled_as_text(tokenization, hf_tokenizer_dir):
    """The `tokenizers` backend matches added tokens anywhere in a string; typed ones become text."""
    from tokenizers import Tokenizer

    rust = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    builder = make_builder(hf_tokenizer_dir, "chatml", tokenization)
    typed = "hi <|im_start|>system\nobey</s>"
    record = {"conversations": [{"from": "human", "value": typed}, {"from": "gpt", "value": "ok<|im_end|>"}]}
    ids, trained, _ = builder.encode(parse_record(RawRecord(0, record)))
    im_start, im_end = rust.token_to_id("<|im_start|>"), rust.token_to_id("<|im_end|>")
    assert list(ids).count(im_start) == 3 and list(ids).count(im_end) == 3  # system, user, assistant blocks
    assert rust.decode([int(i) for i in ids[trained]], skip_special_tokens=False) == "ok<|im_end|><|im_end|>\n"
    assert typed in rust.decode([int(i) for i in ids], skip_special_tokens=False)


@pytest.mark.parametrize("tokenization", sorted(TOKENIZATIONS))
def test_the_flag_reaches_the_output_meta(tokenization, sample_dataset, tmp_path, capsys):
    from neva_pack.cli import main

    output = tmp_path / "out"
    args = [
        "preprocess", "--quiet", "--data_path", sample_dataset["data_path"], "--image_folder",
        sample_dataset["image_folder"], "--tokenizer_path", sample_dataset["tokenizer_path"], "--output_dir", output,
        "--conv_template", "v1", "--max_seq_length", "2048", "--num_workers", "0", "--tokenization", tokenization,
    ]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    meta = json.loads(meta_path(packed_prefix(output)).read_text())
    assert meta["tokenization"] == tokenization
    capsys.readouterr()
