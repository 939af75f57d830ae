"""SentencePiece offsets computed from the ids alone == sentencepiece's own offsets.

For a model whose normaliser is the identity (the sample tokenizer, Mistral/LLaMA) the tokenizer
reads character offsets off a per-id table of spelled characters instead of asking sentencepiece
for its serialized offsets (twice the cost of the ids). These properties pin that shortcut to
sentencepiece's protobuf answer, for ``encode`` and ``encode_literal``, on text built to hit its
edges: leading/double spaces (the dummy "▁"), newlines and tabs and NULs (byte pieces), characters
outside the vocabulary (byte fallback, several bytes per character), a literal "▁", and strings
that are, or look like, control and user-defined pieces. Models outside the shortcut's reach
(whitespace collapsed, no byte fallback) must give the protobuf answer as well.

The ids themselves come from a per-word cache (``WordCache``) for BPE models none of whose pieces
span the start of a space-led word; models with such a piece (user-defined, unused, or a "y z"
where spaces are not written "▁"), and a unigram model, are in the fixture to show the cache stays
out of their way. The tokenizers are shared across examples, so
the cache is warm with words seen in other texts, as in a worker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2

from nemo_tokenizer import build_nemo_specials_tokenizer
from neva_pack.text import SentencePieceTokenizer, WordCache

FRAGMENTS = [
    " ", "  ", "\n", "\t", "xy z", " y z", "\x00", "▁", "▁▁", "é", "日本語", "🙂", "a\u0301", "\u200b", "\r\n",
    "<s>", "</s>", "<unk>", "<extra_id_4>", "<extra_id_5>", "<extra_id_7>", "<0x0A>", "<extra_id_", "USER:", " ASSISTANT:",
]  # fmt: skip
"""Pieces of text at the shortcut's edges (dummy prefix, byte pieces, specials typed as text)."""
TEXTS = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)),
    max_size=12,
).map("".join)


def _modified(source: Path, destination: Path, change) -> Path:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(source.read_bytes())
    change(proto)
    destination.write_bytes(proto.SerializeToString())
    return destination


def _collapse_whitespace(proto) -> None:
    proto.normalizer_spec.remove_extra_whitespaces = True


def _no_byte_fallback(proto) -> None:
    """Unknown characters become <unk> (runs of them one piece): widths the ids cannot tell."""
    proto.trainer_spec.byte_fallback = False
    for piece in proto.pieces:
        if piece.type == piece.BYTE:
            piece.type = piece.UNUSED


def _piece_across_a_space(proto) -> None:
    """A user-defined "y▁z": sentencepiece matches it in "xy z", across the words "xy" and " z"."""
    piece = proto.pieces.add()
    piece.piece, piece.score, piece.type = "y▁z", 0.0, piece.USER_DEFINED


def _unused_piece_across_a_space(proto) -> None:
    """Unused "y▁" and "y▁z": BPE merges into them, then splits them back, having changed the
    merges around them ("y z" is then ▁y ▁ z, not ▁ y ▁ z)."""
    for text in ("y▁", "y▁z"):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = text, 0.0, piece.UNUSED


def _spaces_not_escaped(proto) -> None:
    """Spaces kept as " ", and a normal piece "y z" across a word's start without any "▁"."""
    proto.normalizer_spec.escape_whitespaces = False
    for text in (" ", "y ", "y z"):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = text, 0.0, piece.NORMAL


def _as_unigram(proto) -> None:
    proto.trainer_spec.model_type = proto.trainer_spec.UNIGRAM


@pytest.fixture(scope="module")
def models(tmp_path_factory, sample_tokenizer_path, mistral_tokenizer_path) -> dict[str, Path]:
    """Identity-normalised models (the shortcut) and two it must leave to sentencepiece."""
    tmp = tmp_path_factory.mktemp("models")
    return {
        "sample": sample_tokenizer_path,
        "mistral": mistral_tokenizer_path,
        "mistral_nemo": build_nemo_specials_tokenizer(tmp),  # Mistral + <extra_id_0..7> user-defined
        "sample_collapsing_whitespace": _modified(sample_tokenizer_path, tmp / "collapse.model", _collapse_whitespace),
        "sample_without_byte_fallback": _modified(sample_tokenizer_path, tmp / "nobytes.model", _no_byte_fallback),
        "sample_with_piece_across_a_space": _modified(sample_tokenizer_path, tmp / "across.model", _piece_across_a_space),
        "sample_as_unigram": _modified(sample_tokenizer_path, tmp / "unigram.model", _as_unigram),
        "sample_with_unused_piece_across_a_space": _modified(sample_tokenizer_path, tmp / "unused.model", _unused_piece_across_a_space),
        "sample_not_escaping_spaces": _modified(sample_tokenizer_path, tmp / "spaces.model", _spaces_not_escaped),
    }


@pytest.fixture(scope="module")
def tokenizers(models) -> dict[str, SentencePieceTokenizer]:
    return {name: SentencePieceTokenizer(path) for name, path in models.items()}


@pytest.fixture(scope="module")
def references(models) -> dict[str, tuple]:
    """Per model: sentencepiece itself, and the literal model (no dummy prefix, user-defined unused)."""
    out = {}
    for name, path in models.items():
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(path.read_bytes())
        for piece in proto.pieces:
            if piece.type == piece.USER_DEFINED:
                piece.type = piece.UNUSED
        proto.normalizer_spec.add_dummy_prefix = False
        literal = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
        out[name] = (sentencepiece.SentencePieceProcessor(model_file=str(path)), literal)
    return out


def _protobuf_offsets(processor, text: str) -> tuple[list[int], list[int], list[int]]:
    """ids and character offsets from sentencepiece's protobuf pieces (UTF-8 byte offsets mapped)."""
    pieces = processor.encode(text, out_type="proto").pieces
    char_of_byte = [index for index, char in enumerate(text) for _ in char.encode("utf-8")] + [len(text)]
    return [p.id for p in pieces], [char_of_byte[p.begin] for p in pieces], [char_of_byte[p.end] for p in pieces]


def _check(encoding, expected, text):
    for ours, theirs in zip((encoding.ids, encoding.starts, encoding.ends), expected):
        assert ours.dtype == np.int64 and ours.tolist() == theirs, repr(text)


@settings(max_examples=150)
@given(text=TEXTS)
def test_encode_offsets_equal_sentencepieces(tokenizers, references, text):
    for name, tokenizer in tokenizers.items():
        _check(tokenizer.encode(text), _protobuf_offsets(references[name][0], text), text)


@settings(max_examples=150)
@given(text=TEXTS)
def test_encode_literal_offsets_equal_sentencepieces(tokenizers, references, text):
    for name, tokenizer in tokenizers.items():
        expected = _protobuf_offsets(references[name][1], text)
        if set(expected[0]) & tokenizer.control_ids:
            continue  # spelled as bytes by encode_literal: tests/text/test_token_parity.py
        _check(tokenizer.encode_literal(text), expected, text)


@pytest.mark.parametrize("text", ["", " ", "  x", "\n", "é", " 日本語 ", "▁", "<extra_id_4>", "a" * 3000 + "🙂"])
def test_edge_texts(tokenizers, references, text):
    for name, tokenizer in tokenizers.items():
        _check(tokenizer.encode(text), _protobuf_offsets(references[name][0], text), text)
        _check(tokenizer.encode_literal(text), _protobuf_offsets(references[name][1], text), text)


def test_identity_models_never_ask_sentencepiece_for_offsets(tokenizers, monkeypatch):
    """The shortcut is taken (not only correct) where it applies; unknown text (no byte fallback)
    and collapsed whitespace go to sentencepiece's offsets."""
    asked = []

    def counting(tokenizer):
        original = tokenizer.encode_with_offsets
        monkeypatch.setattr(tokenizer, "encode_with_offsets", lambda text: asked.append(text) or original(text))

    for tokenizer in tokenizers.values():
        counting(tokenizer)
    text = " Hello  wörld\n\t日本語 🙂 <extra_id_4>▁"
    for name in ("sample", "mistral", "mistral_nemo"):
        tokenizers[name].encode(text)
    assert asked == []
    tokenizers["sample_collapsing_whitespace"].encode("a  b")
    tokenizers["sample_without_byte_fallback"].encode("日本語")
    assert asked == ["a  b", "日本語"]


def test_word_cache_serves_only_models_no_piece_spans(tokenizers, references):
    """BPE models without a piece across a word's start get their ids from the cache; the others
    from sentencepiece's whole-text call, which is what makes "xy z" one piece where it is one."""
    cached = {name for name, tokenizer in tokenizers.items() if tokenizer.word_cache is not None}
    assert cached == {"sample", "mistral", "mistral_nemo", "sample_without_byte_fallback"}
    across = tokenizers["sample_with_piece_across_a_space"]
    spanning = across.token_to_id("y▁z")
    assert spanning in across.encode("xy z").ids.tolist()
    for name in ("sample_with_piece_across_a_space", "sample_with_unused_piece_across_a_space", "sample_not_escaping_spaces"):
        for text in ("xy z", "y z", "ay zb"):
            _check(tokenizers[name].encode(text), _protobuf_offsets(references[name][0], text), (name, text))


def test_word_cache_is_bounded_and_exact_when_emptied(sample_tokenizer_path, references, monkeypatch):
    """Emptied when full and long words never kept: memory is bounded, and the ids do not change."""
    monkeypatch.setattr(WordCache, "LIMIT", 3)
    monkeypatch.setattr(WordCache, "LONGEST", 6)
    tokenizer = SentencePieceTokenizer(sample_tokenizer_path)
    texts = ["the cat sat on the mat", "a  sesquipedalian ▁word", " leading and trailing ", "the cat"]
    for text in texts * 2:
        _check(tokenizer.encode(text), _protobuf_offsets(references["sample"][0], text), text)
        assert len(tokenizer.word_cache) <= 3 and all(len(word) <= 6 for word in tokenizer.word_cache)


def test_a_tokenizer_json_file_stands_for_its_directory(hf_tokenizer_dir):
    """``--tokenizer_path dir/tokenizer.json`` was read as a SentencePiece model (a protobuf parse
    error): it is the Hugging Face tokenizer of its directory."""
    from neva_pack.text import load_tokenizer

    by_file, by_directory = load_tokenizer(hf_tokenizer_dir / "tokenizer.json"), load_tokenizer(hf_tokenizer_dir)
    text = "USER: What is in the picture?\nASSISTANT: A cat on a mat."
    assert by_file.encode(text).ids.tolist() == by_directory.encode(text).ids.tolist()
    assert (by_file.bos_id, by_file.eos_id, by_file.control_ids) == (by_directory.bos_id, by_directory.eos_id, by_directory.control_ids)


def test_another_json_file_as_tokenizer_path_says_to_give_the_directory(hf_tokenizer_dir):
    from neva_pack.core import ConfigError
    from neva_pack.text import load_tokenizer

    path = hf_tokenizer_dir / "tokenizer_config.json"
    with pytest.raises(ConfigError, match=rf"^--tokenizer_path {path}: a JSON file, not a tokenizer; give the Hugging Face tokenizer's directory"):
        load_tokenizer(path)


@pytest.mark.parametrize("flavour", ["metaspace", "legacy"])
def test_literal_text_of_a_sentencepiece_style_tokenizer_json_has_no_leading_marker(flavour, tmp_path):
    """A tokenizer.json converted from a SentencePiece model (LLaMA, Mistral, LLaVA-1.5) marks the first word
    of a call with "▁": a Metaspace pre-tokenizer (transformers' conversion, ``legacy=False``) or a legacy
    file's ``Prepend("▁")`` normaliser. ``encode_literal`` is text continuing a sequence (after an image
    or an EOS): no marker, exactly the ids the tokenizer gives such text after an added token in one call
    (its Metaspace prefixes the call's first word only); a sentence's start (``encode``) keeps it."""
    import json

    from tokenizers import Tokenizer as RustTokenizer

    from neva_pack.text import load_tokenizer

    source = Path(__file__).resolve().parents[1] / "golden" / "llamafactory" / "llava_tokenizer"
    spec = json.loads((source / "tokenizer.json").read_text())
    one_call = RustTokenizer.from_str(json.dumps(spec))
    assert spec["pre_tokenizer"]["type"] == "Metaspace" and spec["pre_tokenizer"]["prepend_scheme"] == "first"
    if flavour == "legacy":
        spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                                  {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}  # fmt: skip
        spec["pre_tokenizer"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    tokenizer = load_tokenizer(tmp_path)
    marker = tokenizer.token_to_id("▁")
    for text in ("\nDescribe the image.", "Hello there", " USER: What is it?"):
        continued = one_call.encode("<image>" + text, add_special_tokens=False).ids[1:]
        assert tokenizer.encode_literal(text).ids.tolist() == continued, text
        if flavour == "metaspace":  # (a legacy file marks " USER" twice at a call's start: "▁▁USER")
            assert tokenizer.encode(text).ids.tolist() == one_call.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode("\nHi").ids[0] == marker and tokenizer.encode_literal("\nHi").ids[0] != marker
    assert tokenizer.encode_literal("Hello").ids.tolist() != tokenizer.encode("Hello").ids.tolist()


def test_literal_text_is_the_same_from_the_model_file_and_from_its_tokenizer_json(sample_tokenizer_path, tmp_path):
    """The sample SentencePiece model and the tokenizer.json transformers converts it to (``legacy=False``): text
    continuing a sequence gets the same ids from either backend, so a run reads the same ids from a model's
    ``tokenizer.model`` and from its ``tokenizer.json`` after every image, BOS and EOS."""
    import shutil

    from transformers import LlamaTokenizer

    from neva_pack.text import load_tokenizer

    shutil.copy(sample_tokenizer_path, tmp_path / "tokenizer.model")
    LlamaTokenizer.from_pretrained(tmp_path, legacy=False).save_pretrained(tmp_path / "converted")
    from_json, from_model = load_tokenizer(tmp_path / "converted"), SentencePieceTokenizer(sample_tokenizer_path)
    assert (tmp_path / "converted" / "tokenizer.json").is_file() and not (tmp_path / "converted" / "tokenizer.model").exists()
    for text in ("\nDescribe the image.", "Hello there", " USER: What is it?", "  two spaces", "[INST] hi [/INST]", "a\tb\nc",
                 "café ünïcode 日本", "▁literal", "</s>", " "):  # fmt: skip
        assert from_json.encode_literal(text).ids.tolist() == from_model.encode_literal(text).ids.tolist(), text
