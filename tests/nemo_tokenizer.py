"""A SentencePiece model that carries NeMo's special tokens, built offline from Mistral-7B v0.1.

NeVA expects its tokenizer to know `<extra_id_0>`..`<extra_id_7>` (system, separator, labels, image
patch, image start/end, bos, eos). NeMo's recipe for getting them into an existing SentencePiece
model is to append them to the model's piece list as USER_DEFINED pieces with score 0, so they get
the next free ids (32000..32007 for Mistral) and the encoder always emits each one as a single
piece wherever its text appears. The golden data in `tests/golden/nemo/*__mistral_nemo.jsonl` was
produced with exactly the file this builds; `MISTRAL_NEMO_SHA256` pins it.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2

NEMO_SPECIAL_TOKENS = tuple(f"<extra_id_{index}>" for index in range(8))
"""The pieces NeMo's NeVA recipe adds, in the order it adds them."""

MISTRAL_NEMO_SHA256 = "43215aaf6ea58908e63d7e3c1867aa24aaa3cf675e5e161a673c1269ae521513"
"""sha256 of the model `build_nemo_specials_tokenizer` writes (changes only if mistral-common's file does)."""


def mistral_v01_model_path() -> Path:
    """Mistral-7B v0.1's SentencePiece model as shipped in the `mistral-common` wheel (Apache-2.0)."""
    return Path(str(importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"))


def build_nemo_specials_tokenizer(destination: Path) -> Path:
    """Write Mistral v0.1 plus NeMo's `<extra_id_0..7>` (USER_DEFINED, score 0) to `destination`.

    `destination` may be a directory (the file is named `mistral_v01_nemo_specials.model`) or a
    file path. Deterministic: the same input model gives byte-identical output.
    """
    destination = Path(destination)
    if destination.is_dir():
        destination = destination / "mistral_v01_nemo_specials.model"
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(mistral_v01_model_path().read_bytes())
    existing = {piece.piece for piece in model.pieces}
    clashes = [token for token in NEMO_SPECIAL_TOKENS if token in existing]
    if clashes:
        raise ValueError(f"the base model already has {clashes}; refusing to add them twice")
    for token in NEMO_SPECIAL_TOKENS:
        model.pieces.add(piece=token, score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
    destination.write_bytes(model.SerializeToString(deterministic=True))
    return destination


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, to check a built model against `MISTRAL_NEMO_SHA256`."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
