"""Tokenizers behind one small protocol: text -> ids with character offsets.

Offsets are what make label masks exact: a token is trained when the characters it
covers overlap an assistant span of the rendered text, so the mask is computed from
the ids actually emitted, never by re-tokenizing pieces and hoping lengths add up.

Conversation text must never become a control token: each backend names its
``control_ids`` (special and user-defined pieces, added tokens) and can spell any text
without them (``encode_literal``), which the sample builder uses for text a user typed.

Two backends, both loaded from files only (no hub):
- a SentencePiece ``.model`` file, used through ``sentencepiece`` directly (HF's
  LLaMA-style wrappers drop or add ``▁`` around spaces in some versions);
- a Hugging Face tokenizer directory with ``tokenizer.json``, used through ``tokenizers``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from itertools import chain
from typing import Protocol

import numpy as np

from neva_pack.core import ConfigError
from neva_pack.files import read_bytes, read_json, read_text

__all__ = [
    "MAX_TOKENIZER_BYTES", "Encoding", "HuggingFaceTokenizer", "SentencePieceTokenizer", "Tokenizer", "WordCache",
    "load_tokenizer", "piece_table", "spelled_offsets",
]  # fmt: skip

MAX_TOKENIZER_BYTES = 256 << 20
"""Budget of a tokenizer file: SentencePiece models are under 5 MB, the largest tokenizer.json
files (256k-vocabulary models) under 40 MB."""


@dataclass(frozen=True, slots=True)
class Encoding:
    ids: np.ndarray
    """int64 token ids."""
    starts: np.ndarray
    """int64 character offset where each token's text begins."""
    ends: np.ndarray
    """int64 character offset where each token's text ends (exclusive)."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    control_ids: frozenset[int]
    """Ids ordinary text must not produce: control, user-defined and added tokens."""

    def encode(self, text: str) -> Encoding:
        """Ids of ``text`` without BOS/EOS, with character offsets."""

    def encode_literal(self, text: str) -> Encoding:
        """``text`` as it continues a sequence (no leading-space marker), never as a control id."""

    def token_to_id(self, token: str) -> int | None:
        """Id of a single token (special or not) by its string, or None if the vocabulary lacks it."""


class SentencePieceTokenizer:
    def __init__(self, model_file: Path):
        import sentencepiece

        self.name = str(model_file)
        self._sp = sentencepiece.SentencePieceProcessor()
        serialized = read_bytes(model_file, what="--tokenizer_path", max_bytes=MAX_TOKENIZER_BYTES)
        try:
            self._sp.LoadFromSerializedProto(serialized)
        except (OSError, RuntimeError, ValueError) as exc:  # ValueError: its text is not UTF-8
            raise ConfigError(f"--tokenizer_path {model_file}: not a SentencePiece model ({exc})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = _none_if_negative(self._sp.bos_id())
        self.eos_id = _none_if_negative(self._sp.eos_id())
        proto = self._model_proto()
        if not all(isinstance(piece.piece, str) for piece in proto.pieces):  # protobuf leaves bytes that are not UTF-8 as bytes
            raise ConfigError(f"--tokenizer_path {model_file}: not a SentencePiece model (a piece is not UTF-8 text)")
        kinds = proto.pieces
        self.control_ids = frozenset(i for i, p in enumerate(kinds) if p.type in (p.CONTROL, p.USER_DEFINED))
        self._literal = None
        # ids -> offsets without sentencepiece's offsets, where the model spells its input unchanged
        self._widths = _spelled_widths(proto) if _spells_input_unchanged(proto) else None
        self._literal_widths = None
        self._dummy_prefix = int(proto.normalizer_spec.add_dummy_prefix)
        self._by_words = self._widths is not None and _no_piece_spans_a_space(proto)
        self._ids = _plain_ids(self._sp)
        if self._by_words:
            proto.normalizer_spec.add_dummy_prefix = False  # the cache adds the leading space itself
            self._ids = WordCache(_processor(proto), dummy_prefix=bool(self._dummy_prefix))
        self._literal_ids = None
        piece_table(np.frombuffer(b"", dtype=np.uint8))  # load the kernels (for read-only buffers) once, before workers are forked
        spelled_offsets(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), 0, 0)

    def encode(self, text: str) -> Encoding:
        if self._widths is not None:
            encoding = _encode_spelled(self._ids, self._widths, self._dummy_prefix if text else 0, text)
            if encoding is not None:
                return encoding
        return self.encode_with_offsets(text)

    @property
    def word_cache(self) -> WordCache | None:
        """Where ``encode`` takes its ids from word by word, or None (the model has a piece across
        a word's start, or changes its input: sentencepiece's whole-text call)."""
        return self._ids if isinstance(self._ids, WordCache) else None

    def encode_with_offsets(self, text: str) -> Encoding:
        """sentencepiece's own offsets, for any model: the serialized SentencePieceText, read by a
        compiled loop (protobuf objects read in Python cost more than the tokenization itself)."""
        table = piece_table(np.frombuffer(self._sp.encode(text, out_type="serialized_proto"), dtype=np.uint8))
        if text.isascii():  # one byte per character: the byte offsets are the character offsets
            return Encoding(ids=table[:, 0], starts=table[:, 1], ends=table[:, 2])
        char_of_byte = _char_index_of_bytes(text)  # sentencepiece's offsets are UTF-8 byte offsets
        return Encoding(ids=table[:, 0], starts=char_of_byte[table[:, 1]], ends=char_of_byte[table[:, 2]])

    def encode_literal(self, text: str) -> Encoding:
        """The same model without its dummy prefix and with user-defined pieces unused (the BPE
        then spells them from ordinary pieces); any control id left is spelled as bytes."""
        if self._literal is None:
            from neva_pack.text import text_kernels

            self._literal = self._literal_processor()
            self._literal_ids = WordCache(self._literal, dummy_prefix=False) if self._by_words else _plain_ids(self._literal)
            if self._widths is not None:  # the same spelling; a control id left takes the path below
                self._literal_widths = self._widths.copy()
                self._literal_widths[list(self.control_ids)] = text_kernels.NOT_TEXT
        if self._literal_widths is not None:
            encoding = _encode_spelled(self._literal_ids, self._literal_widths, 0, text)
            if encoding is not None:
                return encoding
        pieces = self._literal.encode(text, out_type="proto").pieces
        char_of_byte = _char_index_of_bytes(text)
        rows = []
        for p in pieces:
            if p.id not in self.control_ids:
                rows.append((p.id, p.begin, p.end))
                continue
            for byte in text.encode("utf-8")[p.begin : p.end] or p.piece.encode("utf-8"):
                byte_id = self._sp.PieceToId(f"<0x{byte:02X}>")
                rows.append((byte_id if self._sp.IsByte(byte_id) else self._sp.unk_id(), p.begin, p.end))
        table = np.array(rows, dtype=np.int64).reshape(-1, 3)
        return Encoding(ids=table[:, 0], starts=char_of_byte[table[:, 1]], ends=char_of_byte[table[:, 2]])

    def _model_proto(self):
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._sp.serialized_model_proto())
        return proto

    def _literal_processor(self):
        proto = self._model_proto()
        for piece in proto.pieces:
            if piece.type == piece.USER_DEFINED:
                piece.type = piece.UNUSED
        proto.normalizer_spec.add_dummy_prefix = False
        return _processor(proto)

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.PieceToId(token)
        if token_id == self._sp.unk_id() and token != self._sp.IdToPiece(token_id):
            return None
        return token_id

    def __getstate__(self):
        return {"name": self.name}

    def __setstate__(self, state):
        self.__init__(Path(state["name"]))


class HuggingFaceTokenizer:
    """A directory with ``tokenizer.json`` (+ ``tokenizer_config.json`` for BOS/EOS names)."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as RustTokenizer

        self.name = str(directory)
        text = read_text(directory / "tokenizer.json", what="--tokenizer_path", max_bytes=MAX_TOKENIZER_BYTES)
        try:
            self._tok = RustTokenizer.from_str(text)
        except Exception as exc:  # the Rust binding raises a bare Exception for malformed files
            raise ConfigError(f"--tokenizer_path {directory}: unreadable tokenizer.json ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        _check_vocabulary_ids(directory, self._tok.get_vocab(with_added_tokens=True), self.vocab_size)
        config = _read_json(directory / "tokenizer_config.json")
        self.bos_id = self._special_id(config, "bos_token", directory)
        self.eos_id = self._special_id(config, "eos_token", directory)
        unk = getattr(self._tok.model, "unk_token", None)
        self._unk_id = self._tok.token_to_id(unk) if isinstance(unk, str) else None
        # every added token (special or not) is matched anywhere in a string; the unknown token
        # is what unknown text legitimately becomes, as in sentencepiece
        self.control_ids = frozenset(self._tok.get_added_tokens_decoder()) - {self._unk_id}
        self._literal = None

    def _special_id(self, config: dict, key: str, directory: Path) -> int | None:
        """The id of the token ``tokenizer_config.json`` names under ``key`` (a string, or an object
        with its ``content``, as transformers saves it), None where it names none. A value of another
        type, or a token the vocabulary lacks, is refused: read as no BOS/EOS, every sample would lose
        its end-of-turn token without a word."""
        entry = config.get(key)
        content = entry.get("content") if isinstance(entry, dict) else entry
        if content is None:
            return None
        where = f"--tokenizer_path {directory / 'tokenizer_config.json'}: {key}"
        if not isinstance(content, str):
            raise ConfigError(f"{where} {entry!r}: expected a token (a string, or an object with its 'content'), got {type(content).__name__}")
        token_id = self.token_to_id(content)
        if token_id is None:
            raise ConfigError(f"{where} {content!r}: not a token of tokenizer.json")
        return token_id

    def encode(self, text: str) -> Encoding:
        enc = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return Encoding(ids=np.asarray(enc.ids, dtype=np.int64), starts=offsets[:, 0], ends=offsets[:, 1])

    def encode_literal(self, text: str) -> Encoding:
        """The same pipeline without its added tokens, so none of them can match, and without a
        leading-space marker (a SentencePiece-style tokenizer.json's Metaspace prefix, or its
        ``Prepend("▁")`` normaliser): the text continues a sequence, as it does in one call after an
        added token. A control id the model itself still yields (a vocabulary whose merges reach it)
        becomes the unknown id."""
        if self._literal is None:
            from tokenizers import Tokenizer as RustTokenizer

            spec = json.loads(self._tok.to_str())
            spec["added_tokens"] = []
            spec["normalizer"] = _without_prepend(spec.get("normalizer"))
            _never_prepend(spec.get("pre_tokenizer"))
            self._literal = RustTokenizer.from_str(json.dumps(spec))
        enc = self._literal.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        control = np.isin(ids, np.fromiter(self.control_ids, dtype=np.int64, count=len(self.control_ids)))
        if control.any():
            if self._unk_id is None:
                raise ConfigError(f"--tokenizer_path {self.name}: its model spells text as added tokens and has no unknown token")
            ids[control] = self._unk_id
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return Encoding(ids=ids, starts=offsets[:, 0], ends=offsets[:, 1])

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __getstate__(self):
        return {"name": self.name}

    def __setstate__(self, state):
        self.__init__(Path(state["name"]))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A ``.model`` file -> SentencePiece; a directory -> tokenizer.json, else its tokenizer.model.
    Whatever else the path names (a device, a FIFO, a socket) is refused, saying what it is.

    A ``tokenizer.json`` named itself stands for its directory: a Hugging Face tokenizer is the
    directory (``tokenizer_config.json`` beside it names BOS/EOS), and the file is how users often
    point at it; read as a SentencePiece model it failed with a protobuf parse error. Another JSON
    file (``tokenizer_config.json``, ``vocab.json``) cannot be a tokenizer on its own: one line says
    to give the directory."""
    path = Path(path)
    if path.suffix == ".json" and path.is_file():
        if path.name == "tokenizer.json":
            return HuggingFaceTokenizer(path.parent)
        raise ConfigError(
            f"--tokenizer_path {path}: a JSON file, not a tokenizer; give the Hugging Face tokenizer's directory "
            "(the one holding tokenizer.json) or a SentencePiece .model file"
        )
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return HuggingFaceTokenizer(path)
        if (path / "tokenizer.model").exists():
            return SentencePieceTokenizer(path / "tokenizer.model")
        raise ConfigError(f"--tokenizer_path {path}: directory has neither tokenizer.json nor tokenizer.model")
    if path.exists():  # read_bytes refuses what is not a regular file
        return SentencePieceTokenizer(path)
    raise ConfigError(f"--tokenizer_path {path}: no such file or directory")


def _without_prepend(normalizer: dict | None) -> dict | None:
    """A tokenizer.json normaliser without its ``Prepend`` steps (the leading "▁" of legacy LLaMA files)."""
    if not normalizer or normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        steps = [step for step in (_without_prepend(step) for step in normalizer.get("normalizers", [])) if step]
        return {**normalizer, "normalizers": steps} if steps else None
    return normalizer


def _never_prepend(pre_tokenizer: dict | None) -> None:
    """A tokenizer.json pre-tokenizer's Metaspace steps set to add no leading "▁" (in place)."""
    if not pre_tokenizer:
        return
    for step in pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]:
        if step.get("type") == "Metaspace":
            if "prepend_scheme" in step:
                step["prepend_scheme"] = "never"
            if "add_prefix_space" in step:  # files of tokenizers < 0.14
                step["add_prefix_space"] = False


def _char_index_of_bytes(text: str) -> np.ndarray:
    """Map every UTF-8 byte offset of ``text`` (0..len(bytes)) to its character offset."""
    if text.isascii():
        return np.arange(len(text) + 1, dtype=np.int64)
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    starts_char = (data & 0xC0) != 0x80  # every byte but a continuation byte (10xxxxxx) starts a character
    return np.append(np.cumsum(starts_char, dtype=np.int64) - 1, len(text))


def _spells_input_unchanged(proto) -> bool:
    """Whether the model's pieces spell its input character for character: an identity normaliser
    (no NFKC map, no rules), whitespace neither collapsed nor moved to the end of pieces. Only
    spaces become "▁" (one character for one), plus a leading "▁" (the dummy prefix). LLaMA,
    Mistral and the sample tokenizer are such models."""
    spec = proto.normalizer_spec
    return (
        spec.name == "identity"
        and not spec.precompiled_charsmap
        and not spec.normalization_rule_tsv
        and not spec.remove_extra_whitespaces
        and not proto.trainer_spec.treat_whitespace_as_suffix
    )


def _spelled_widths(proto) -> np.ndarray:
    """Characters of input each id spells (int64 per id), or one of ``text_kernels``' negative kinds."""
    from neva_pack.text import text_kernels

    kind = proto.SentencePiece
    widths = np.empty(len(proto.pieces), dtype=np.int64)
    for index, piece in enumerate(proto.pieces):
        if piece.type in (kind.NORMAL, kind.USER_DEFINED):
            widths[index] = len(piece.piece)
        elif piece.type == kind.BYTE:
            widths[index] = text_kernels.CONTINUATION_BYTE if 0x80 <= int(piece.piece[3:5], 16) <= 0xBF else text_kernels.BYTE
        else:
            widths[index] = text_kernels.NOT_TEXT
    return widths


def _no_piece_spans_a_space(proto) -> bool:
    """Whether a BPE model's pieces never span the start of a space-led word: spaces are written
    "▁" (``escape_whitespaces``), no piece of any kind has a "▁" after a character that is not
    one (a leading run of them is fine: "▁▁the"; unused pieces count too, since BPE merges into
    them before splitting them back), and "▁" is itself a piece (so no run of unknown characters
    can reach across).

    Then sentencepiece's BPE never merges across such a boundary (every merge makes a piece),
    its user-defined symbols never straddle one, and the ids of a text are the ids of its words
    tokenized one at a time, which is what ``WordCache`` relies on. LLaMA, Mistral and the
    sample tokenizer are such models; a unigram model is left to sentencepiece (its best path
    could break ties differently)."""
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE or not proto.normalizer_spec.escape_whitespaces:
        return False
    kind = proto.SentencePiece
    if not any(p.piece == "▁" and p.type in (kind.NORMAL, kind.USER_DEFINED) for p in proto.pieces):
        return False
    return not any("▁" in p.piece.lstrip("▁") for p in proto.pieces)


_WORDS = re.compile("[ \u2581]*[^ \u2581]+|[ \u2581]+")
"""A text's space-led words: a run of spaces (or literal "▁", the same piece once normalised)
with the characters after it up to the next run; a trailing run is a word of its own."""
_LEAD_SPACE = " ".__add__


class WordCache(dict):
    """Ids of a text as the concatenation of its space-led words' ids, each word tokenized by
    sentencepiece once per process (as the BPE caches of Hugging Face tokenizers do): a prompt
    repeats most of its words, and a dict lookup costs a fraction of sentencepiece's call.

    Only for models where ``_no_piece_spans_a_space``: the ids are then exactly sentencepiece's
    for the whole text (tests/text/test_tokenizer.py holds them equal). ``processor`` adds no dummy
    prefix; ``dummy_prefix`` says whether the model does (it is then written as a leading space).
    A word's ids are kept as int32 bytes (joined in one C call; ~200 bytes an entry). The cache is
    emptied when it holds ``LIMIT`` words (~30 MB), and words longer than ``LONGEST`` characters
    are not kept: memory stays bounded whatever the data."""

    LIMIT = 1 << 17
    LONGEST = 64

    def __init__(self, processor, dummy_prefix: bool):
        super().__init__()
        self._encode = processor.EncodeAsIds
        self._dummy_prefix = dummy_prefix

    def __missing__(self, word: str) -> bytes:
        ids = np.array(self._encode(word), dtype=np.int32).tobytes()
        if len(word) <= self.LONGEST:
            if len(self) >= self.LIMIT:
                self.clear()
            self[word] = ids
        return ids

    def __call__(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros(0, dtype=np.int64)
        if "  " in text or "\u2581" in text or text[0] == " ":
            words = _WORDS.findall(" " + text if self._dummy_prefix else text)
        else:  # the usual text: single spaces only, so str.split finds the words (twice as fast)
            split = text.split(" ")
            words = map(_LEAD_SPACE, split) if self._dummy_prefix else chain(split[:1], map(_LEAD_SPACE, split[1:]))
        return np.frombuffer(b"".join(map(self.__getitem__, words)), dtype=np.int32).astype(np.int64)


def _plain_ids(processor):
    """Ids of a whole text in one sentencepiece call (models ``WordCache`` cannot serve)."""
    return lambda text: np.array(processor.EncodeAsIds(text), dtype=np.int64)


def _processor(proto):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _encode_spelled(ids_of, widths: np.ndarray, skip: int, text: str) -> Encoding | None:
    """The ids-only encode, with offsets from the pieces' spelled widths; None where the pieces do
    not spell the text (the caller asks sentencepiece for its offsets)."""
    ids = ids_of(text)
    starts, ends, spelled = spelled_offsets(ids, widths, skip, len(text))
    return Encoding(ids=ids, starts=starts, ends=ends) if spelled else None


def spelled_offsets(ids: np.ndarray, widths: np.ndarray, skip: int, length: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Character offsets of ids whose pieces spell a text of ``length`` characters, preceded by
    ``skip`` characters that are not in it (the dummy prefix "▁"): (starts, ends, spelled), where
    spelled is False when the pieces do not add up to the text (the caller asks sentencepiece).

    Offsets as sentencepiece gives them: the dummy "▁" alone is (0, 0); a character spelled as
    byte pieces is covered by its last one, the others are zero-width at its start::

        text "ü a" (sample tokenizer)   pieces  ▁  <0xC3> <0xBC>  ▁a
                                        starts  0    0      0     1
                                        ends    0    0      1     3
    """
    return _spelled_offsets_kernel()(ids, widths, skip, length)


@functools.cache
def _spelled_offsets_kernel():
    from neva_pack.text.text_kernels import spelled_offsets_kernel

    return spelled_offsets_kernel


def piece_table(serialized: np.ndarray) -> np.ndarray:
    """(id, begin byte, end byte) of every piece of a serialized ``SentencePieceText``, int64 (n, 3)."""
    return _piece_table_kernel()(serialized)


@functools.cache
def _piece_table_kernel():
    """Imported on first use (compiled once, then loaded from numba's disk cache): a process
    that never tokenizes never pays for it."""
    from neva_pack.text.text_kernels import piece_table_kernel

    return piece_table_kernel


def _none_if_negative(value: int) -> int | None:
    return None if value < 0 else value


def _check_vocabulary_ids(directory: Path, vocab: dict[str, int], vocab_size: int) -> None:
    """Every token of a ``tokenizer.json`` (its model's vocabulary and its added tokens) has an id of its
    own below the vocabulary size. The Rust library takes ids as written: one past the size (an id of
    4,000,000,000) indexed past every table, and two tokens of one id (an added ``<|image_pad|>`` given
    a word's id) made ordinary text read as image positions, where neither can be told apart later."""
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    where = f"--tokenizer_path {directory}: tokenizer.json"
    if len(ids) and int(ids.max()) >= vocab_size:
        token = max(vocab, key=vocab.__getitem__)
        raise ConfigError(f"{where} gives {token!r} the id {vocab[token]}, outside its vocabulary of {vocab_size} ids (0 .. {vocab_size - 1})")
    unique, counts = np.unique(ids, return_counts=True)
    if len(unique) < len(ids):
        shared = int(unique[counts > 1][0])
        tokens = sorted(token for token, token_id in vocab.items() if token_id == shared)
        raise ConfigError(f"{where} gives {' and '.join(map(repr, tokens[:3]))} the same id {shared}: each token needs an id of its own")


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    value = read_json(path, what="--tokenizer_path")
    if not isinstance(value, dict):
        raise ConfigError(f"--tokenizer_path {path}: expected a JSON object, got {type(value).__name__}")
    return value
