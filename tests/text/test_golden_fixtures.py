"""The golden data under tests/golden/ is self-consistent and was made with the tokenizers we ship.

These tests guard the fixtures, not the library: if the Mistral builder or a tokenizer file changes,
the golden ids no longer mean anything and this fails before any comparison test gets confusing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from nemo_tokenizer import (
    MISTRAL_NEMO_SHA256,
    NEMO_SPECIAL_TOKENS,
    build_nemo_specials_tokenizer,
    mistral_v01_model_path,
    sha256_of,
)

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
RECORDS = [json.loads(line) for line in (GOLDEN / "records.jsonl").read_text().splitlines()]
MANIFEST = {
    **json.loads((GOLDEN / "manifest_nemo.json").read_text()),
    **json.loads((GOLDEN / "manifest_llava.json").read_text()),
}
LLAVA_IMAGE_TOKEN_INDEX = -200


@pytest.fixture(scope="module")
def mistral_nemo_path(tmp_path_factory) -> Path:
    return build_nemo_specials_tokenizer(tmp_path_factory.mktemp("mistral_nemo"))


@pytest.fixture(scope="module")
def tokenizer_files(mistral_nemo_path, sample_tokenizer_path) -> dict[str, Path]:
    return {"sample": sample_tokenizer_path, "mistral": mistral_v01_model_path(), "mistral_nemo": mistral_nemo_path}


def test_builder_appends_nemo_specials_as_user_defined_pieces(mistral_nemo_path):
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(mistral_nemo_path.read_bytes())
    appended = list(model.pieces)[-len(NEMO_SPECIAL_TOKENS):]
    assert [piece.piece for piece in appended] == list(NEMO_SPECIAL_TOKENS)
    assert {piece.type for piece in appended} == {sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED}
    processor = spm.SentencePieceProcessor(model_file=str(mistral_nemo_path))
    assert [processor.piece_to_id(token) for token in NEMO_SPECIAL_TOKENS] == list(range(32000, 32008))
    # a user-defined piece is cut out of running text, even glued to other characters
    assert processor.encode("a<extra_id_4><extra_id_3>b", out_type=str) == ["▁a", "<extra_id_4>", "<extra_id_3>", "b"]


def test_builder_is_deterministic_and_matches_the_golden_data(mistral_nemo_path, tmp_path):
    again = build_nemo_specials_tokenizer(tmp_path / "again.model")
    assert again.read_bytes() == mistral_nemo_path.read_bytes()
    assert sha256_of(mistral_nemo_path) == MISTRAL_NEMO_SHA256


def test_builder_refuses_a_model_that_already_has_the_specials(mistral_nemo_path, tmp_path, monkeypatch):
    import nemo_tokenizer

    monkeypatch.setattr(nemo_tokenizer, "mistral_v01_model_path", lambda: mistral_nemo_path)
    with pytest.raises(ValueError, match="already has"):
        build_nemo_specials_tokenizer(tmp_path)


def test_records_are_varied_and_uniquely_named():
    ids = [record["id"] for record in RECORDS]
    assert len(ids) == len(set(ids)) >= 30
    assert any(isinstance(record.get("image"), list) for record in RECORDS)
    assert any("image" not in record for record in RECORDS)
    assert any(len(record["conversations"]) >= 6 for record in RECORDS)


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_matches_its_manifest_and_the_records(name, tokenizer_files):
    entry = MANIFEST[name]
    assert sha256_of(tokenizer_files[entry["tokenizer"]]) == entry["tokenizer_sha256"]
    rows = [json.loads(line) for line in (GOLDEN / name).read_text().splitlines()]
    assert [row["id"] for row in rows] == [record["id"] for record in RECORDS]
    assert sum("error" in row for row in rows) == entry["errors"]
    vocab = spm.SentencePieceProcessor(model_file=str(tokenizer_files[entry["tokenizer"]])).get_piece_size()
    for row in rows:
        if "error" in row:
            assert "tokens" not in row
            continue
        tokens, labels = row["tokens"], row["labels"]
        assert len(tokens) == len(labels) > 0
        # labels are next-token targets: wherever one is kept, it is the following token
        assert all(label in (-1, tokens[k + 1]) for k, label in enumerate(labels[:-1]))
        allowed_extra = {LLAVA_IMAGE_TOKEN_INDEX} if entry["convention"] == "llava" else set()
        assert all(0 <= t < vocab or t in allowed_extra for t in tokens)
        if entry["convention"] == "nemo":
            assert len(tokens) <= entry["context_length"]
