"""Record -> Sample: render the template, tokenize, expand image placeholders, label, load images.

One sample's token ids (NeMo's v1, one tokenizer call), with NeMo's shift into tokens/labels::

    ids     = ▁USER : ▁ <im_start> 0 0 ... 0 <im_end> \\n What ? ▁ASSISTANT : ▁It ▁is . </s>
    trained =    .  . .     .      . . ... .    .      .   .   .     .       .  x   x   x  x
    tokens  = ids[:-1]
    labels  = ids[1:] where trained, else ignore_index (-1)

The sample's length (what is packed) is len(tokens): text plus image positions. Conversation
text never yields a control id (see SampleBuilder._encode_chunk).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from neva_pack.defaults import IGNORE_INDEX, PAD_ID
from neva_pack.errors import ConfigError
from neva_pack.image_run import ImageRun
from neva_pack.sample_store import StoredBatch, stored_batch
from neva_pack.images import (
    DEFAULT_MAX_IMAGE_DECODE_SECONDS,
    DEFAULT_MAX_IMAGE_PIXELS,
    ImagePreprocessor,
    ImageSource,
    decode_image,
)
from neva_pack.records import (
    DEFAULT_MAX_CONVERSATION_CHARS,
    DEFAULT_MAX_IMAGES_PER_RECORD,
    IMAGES_NOT_HELD,
    Conversation,
    RawRecord,
    RecordError,
    RecordIndex,
    RecordLimits,
    Turn,
    iter_raw_records,
    parse_record,
)
from neva_pack.templates import DEFAULT_TOKENIZATION, TOKENIZATIONS, Piece, Template, Tokenization, render
from neva_pack.tokenizer import Tokenizer

__all__ = [
    "Sample",
    "SampleBuilder",
    "SampleStream",
    "Skipped",
    "check_token_ids",
    "chunk_labels",
    "image_run_for",
    "in_shared_memory",
    "missing_nemo_specials",
    "received",
    "truncation",
]

NEMO_IM_START = "<extra_id_4>"
NEMO_IM_END = "<extra_id_5>"
NEMO_SPECIAL_TEXT = {"bos": "<extra_id_6>", "eos": "<extra_id_7>"}
"""How NeMo's templates write BOS/EOS in the prompt text before mapping their ids to 1/2."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    index: int
    """Source record index."""
    record_id: str | None
    """The record's "id"."""
    tokens: np.ndarray
    """int32, ids[:-1]."""
    labels: np.ndarray
    """int32, ids[1:] on trained positions, ignore_index elsewhere."""
    images: np.ndarray
    """uint8 (num_images, 3, H, W), in placeholder order."""
    image_starts: np.ndarray
    """int32 position in tokens where each image run starts (to truncate again later)."""
    truncated: bool
    """Whether the ids were cut to max_seq_length + 1."""

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped:
    index: int
    """Source record index."""
    record_id: str | None
    """The record's "id", if it could be read."""
    reason: str
    """One of records.SKIP_REASONS."""
    detail: str
    """What exactly was wrong, for the report."""


def image_run_for(
    tokenizer: Tokenizer,
    encoder_tokens: int,
    use_im_start_end: bool = False,
    patch_id: int | None = None,
    start_id: int | None = None,
    end_id: int | None = None,
    tokenization: str = DEFAULT_TOKENIZATION,
    patch_token: str | None = None,
) -> ImageRun:
    """NeMo's image run when the convention is ``nemo`` and the tokenizer has <extra_id_4>/<extra_id_5>,
    else the given ids (LLaVA: N patch ids).

    NeMo: start + patch x (N - 2) + end (N positions), or start + patch x N + end with
    use_im_start_end. Without those tokens: N patch ids, with optional explicit start/end.
    The patch id is the given one, else ``patch_token``'s id under NeMo's image run (NeMo
    leaves <extra_id_3> in some templates), else 0.
    """
    nemo_run = False
    if start_id is None and end_id is None and TOKENIZATIONS[tokenization].auto_image_delimiters:
        start_id = tokenizer.token_to_id(NEMO_IM_START)
        end_id = tokenizer.token_to_id(NEMO_IM_END)
        if start_id is None or end_id is None:
            start_id = end_id = None
        nemo_run = start_id is not None
    if patch_id is None:
        token = tokenizer.token_to_id(patch_token) if patch_token is not None and nemo_run else None
        patch_id = 0 if token is None else token
    delimiters = (start_id is not None) + (end_id is not None)
    positions = encoder_tokens + delimiters if use_im_start_end or delimiters == 0 else encoder_tokens
    if positions - delimiters < 1:
        raise ConfigError(f"an image of {encoder_tokens} positions cannot hold its start/end tokens")
    return ImageRun(positions=positions, patch_id=patch_id, start_id=start_id, end_id=end_id)


def missing_nemo_specials(tokenizer: Tokenizer, tokenization: str, image_run: ImageRun) -> str | None:
    """Why an output cannot be NeMo's, or None: under the NeMo convention with a tokenizer that
    has no <extra_id_4>/<extra_id_5>, NeMo's model cannot find the images in the tokens."""
    if not TOKENIZATIONS[tokenization].auto_image_delimiters or image_run.start_id is not None or image_run.end_id is not None:
        return None
    return (
        f"tokenizer {tokenizer.name} has no {NEMO_IM_START}/{NEMO_IM_END}: NeMo's NeVA model locates images "
        f"by those ids and cannot place the images of this output; images are written as "
        f"{image_run.positions} explicit patch ids ({image_run.patch_id}). Use a tokenizer with NeMo's special "
        f"pieces, or select explicit ids on purpose with --tokenization llava "
        f"(or --image_start_id/--image_end_id)"
    )


def truncation(image_starts, run_length: int, max_seq_length: int) -> tuple[int, int]:
    """Where to cut a sample's ids to fit ``max_seq_length`` positions: (ids to keep, images to keep).

    ids are cut to max_seq_length + 1 (tokens = ids[:-1]), or so that the tokens end right before
    the first image run that would not fit whole: an image run is never split. Both limits are
    about the *tokens*, which hold one id less than the ids::

        ids     t t t [A A A][B B B] t      max_seq_length 7: run A fits in the tokens, B does not:
        tokens  t t t [A A A]               ids[:7] (up to B's first id, which only labels the
        labels  . . . [. . .]               last token, and untrained), tokens = ids[:6], 1 image

    (Cutting the ids at B's start would make tokens = ids[:5]: A's last position lost.)
    """
    cut = max_seq_length + 1
    kept = 0
    while kept < len(image_starts) and image_starts[kept] + run_length <= max_seq_length:
        kept += 1
    if kept < len(image_starts):
        cut = min(cut, int(image_starts[kept]) + 1)
    return cut, kept


class SampleBuilder:
    """Everything needed to turn one record into a Sample; pickled into each DataLoader worker."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        template: Template,
        image_source: ImageSource,
        preprocessor: ImagePreprocessor,
        image_run: ImageRun,
        max_seq_length: int,
        truncate: bool = True,
        ignore_index: int = IGNORE_INDEX,
        system_prompt: str | None = None,
        tokenization: str = DEFAULT_TOKENIZATION,
        record_limits: RecordLimits = RecordLimits(),
        max_conversation_chars: int = DEFAULT_MAX_CONVERSATION_CHARS,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_image_decode_seconds: float = DEFAULT_MAX_IMAGE_DECODE_SECONDS,
        max_images_per_record: int = DEFAULT_MAX_IMAGES_PER_RECORD,
        text_only: bool = False,
    ):
        """``text_only``: the output holds no image, so a record with images is skipped (``images_not_held``)."""
        self.tokenizer = tokenizer
        self.text_only = text_only
        self.template = template
        self.image_source = image_source
        self.preprocessor = preprocessor
        self.image_run = image_run
        self.max_seq_length = max_seq_length
        self.truncate = truncate
        self.ignore_index = ignore_index
        self.system_prompt = system_prompt
        self.tokenization: Tokenization = TOKENIZATIONS[tokenization]
        self.record_limits = record_limits
        self.max_conversation_chars = max_conversation_chars
        self.max_image_pixels = max_image_pixels
        self.max_image_decode_seconds = max_image_decode_seconds
        self.max_images_per_record = max_images_per_record
        self._run_ids = image_run.ids()
        self._special_ids = self._resolve_specials()
        self._special_runs = {name: np.asarray([i], dtype=np.int64) for name, i in self._special_ids.items() if i is not None}
        self._run_masks: dict[tuple[str, bool], np.ndarray] = {}
        self._is_control = np.zeros(tokenizer.vocab_size, dtype=bool)
        self._is_control[list(tokenizer.control_ids)] = True
        empty = np.zeros(0, dtype=np.int64)
        chunk_labels(empty, empty, empty, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=bool), self._is_control)  # compile before a fork
        self._markers = self._resolve_markers() if self.tokenization.one_call else {}
        check_token_ids(image_run, tokenizer.vocab_size, ignore_index=ignore_index)

    def _resolve_specials(self) -> dict[str, int]:
        probe = render(self.template, _PROBE_TURNS[:2] if self.template.one_round_only else _PROBE_TURNS)
        ids = {"bos": self.tokenizer.bos_id, "eos": self.tokenizer.eos_id}
        for piece in probe:
            if piece.kind == "special" and ids[piece.value] is None:
                raise ConfigError(
                    f"template {self.template.name!r} needs the tokenizer's {piece.value.upper()} token, "
                    f"but {self.tokenizer.name} defines none"
                )
        return ids

    def _resolve_markers(self) -> dict[str, _Marker]:
        """How images and BOS/EOS are written inside a one-call prompt (NeMo): as the tokenizer's
        special pieces, which the tokenizer never merges with the text around them. A special
        the tokenizer has no piece for splits the prompt there instead (as LLaVA)."""
        markers = {}
        candidates = {"eos": [NEMO_SPECIAL_TEXT["eos"]], "bos": [NEMO_SPECIAL_TEXT["bos"]]}
        if self.image_run.start_id is not None and self.image_run.end_id is not None:
            candidates["image"] = [NEMO_IM_START, NEMO_IM_END]
        for name, texts in candidates.items():
            ids = [self.tokenizer.token_to_id(text) for text in texts]
            if all(i is not None and i in self.tokenizer.control_ids for i in ids):
                markers[name] = _Marker(name=name, text="".join(texts), ids=np.asarray(ids, dtype=np.int64), id_list=ids)
        if "image" in markers and not np.array_equal(markers["image"].ids, [self.image_run.start_id, self.image_run.end_id]):
            del markers["image"]  # explicit image ids other than NeMo's pieces
        return markers

    def build(self, raw: RawRecord) -> Sample | Skipped:
        try:
            return self._build(raw)
        except RecordError as error:
            return Skipped(index=raw.index, record_id=raw.record_id, reason=error.reason, detail=error.detail)

    def _build(self, raw: RawRecord) -> Sample:
        conversation = parse_record(raw, self.max_conversation_chars, self.max_images_per_record)
        if self.text_only and conversation.images:
            raise RecordError(IMAGES_NOT_HELD, f"{len(conversation.images)} image(s), and the output format holds text only")
        ids, trained, image_starts = self.encode(conversation)
        truncated = False
        if len(ids) > self.max_seq_length + 1:
            if not self.truncate:
                raise RecordError("too_long", f"{len(ids) - 1} positions > max_seq_length {self.max_seq_length}")
            cut, kept = truncation(image_starts, len(self._run_ids), self.max_seq_length)
            ids, trained, image_starts = ids[:cut], trained[:cut], image_starts[:kept]
            truncated = True
        if len(ids) < 2 and not truncated:
            raise RecordError("empty_conversation", "the conversation renders to fewer than 2 tokens")
        if not trained[1:].any():  # e.g. cut before its answer (or its image) by a short max_seq_length
            where = f" after truncation to max_seq_length {self.max_seq_length}" if truncated else ""
            raise RecordError("no_supervised_tokens", f"no trained label{where}")
        names = conversation.images[: len(image_starts)]
        images = np.stack([self._load(name) for name in names]) if names else self._no_images()
        labels = np.where(trained[1:], ids[1:], self.ignore_index)
        return Sample(
            index=conversation.index,
            record_id=conversation.record_id,
            tokens=ids[:-1].astype(np.int32),
            labels=labels.astype(np.int32),
            images=images,
            image_starts=np.asarray(image_starts, dtype=np.int32),
            truncated=truncated,
        )

    def encode(self, conversation: Conversation) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The text side of a sample, before truncation: (ids, trained mask, start of each image
        run). No pixels are read; the parity tests against NeMo's and LLaVA's goldens call this."""
        record_system = conversation.system if self.template.system_from_record else None
        return self._encode(render(self.template, conversation.turns, self.system_prompt, record_system))

    def _encode(self, pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Pieces -> (ids, trained mask, start position of each image run).

        Text is tokenized in chunks: under ``nemo`` the whole prompt is one chunk, images and
        BOS/EOS written inside it as special pieces (NeMo tokenizes its prompt in one call);
        under ``llava`` a chunk ends at every image (LLaVA's tokenizer_image_token), so the text
        after an image starts a new sentencepiece sentence (a leading "▁"), while text after
        BOS/EOS goes on without one (LLaVA-1.5's slow tokenizer, legacy=False). The mask comes
        from the character offsets of the tokens actually emitted.

        The pieces are first laid out as chunks and id runs, counting the template's text, so a
        conversation too long once templated is refused before anything is tokenized.
        """
        segments: list[_Chunk | tuple[np.ndarray, np.ndarray, bool]] = []
        chunk = None
        rendered = 0
        for piece in pieces:
            kind = piece.kind
            if kind == "text" or kind == "content":
                value = piece.value
                if value:
                    if chunk is None:
                        chunk = _Chunk()
                        segments.append(chunk)
                        texts, trained, content, bounds = chunk.texts, chunk.trained, chunk.content, chunk.bounds
                    texts.append(value)  # chunk.add, inlined: the loop runs for every piece of every record
                    trained.append(piece.trained)
                    content.append(kind == "content")
                    bounds.append(bounds[-1] + len(value))
                    if kind == "text":
                        rendered += len(value)
                continue
            name = "image" if kind == "image" else piece.value
            ids = self._run_ids if kind == "image" else self._special_runs[name]
            marker = self._markers.get(name)
            if marker is not None:
                if chunk is None:
                    chunk = _Chunk()
                    segments.append(chunk)
                    texts, trained, content, bounds = chunk.texts, chunk.trained, chunk.content, chunk.bounds
                chunk.add_marker(marker, piece.trained, ids)
                continue
            chunk = None
            segments.append((ids, self._run_mask(name, piece.trained), kind == "image"))
        if rendered > self.max_conversation_chars:  # many short turns: the template's text counts too
            raise RecordError(
                "conversation_too_long",
                f"{rendered:,} characters once templated > --max_conversation_chars {self.max_conversation_chars:,}",
            )
        id_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        image_starts: list[int] = []
        position = 0
        continues = False  # the chunk goes on after a BOS/EOS: no new leading "▁"
        for segment in segments:
            if type(segment) is _Chunk:
                ids, mask, starts = self._encode_chunk(segment, continues)
                image_starts.extend(position + k for k in starts)
            else:
                ids, mask, image = segment
                # an image starts a new sentencepiece sentence under llava (tokenizer_image_token);
                # NeMo's one call and LLaVA's slow tokenizer (legacy=False) go on after BOS/EOS;
                # a BOS that opens the sequence is the tokenizer's own: the text after it starts fresh
                continues = (self.tokenization.one_call or not image) and position > 0
                if image:
                    image_starts.append(position)
            id_parts.append(ids)
            mask_parts.append(mask)
            position += len(ids)
        if not id_parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), []
        if len(segments) == 1 and type(segments[0]) is _Chunk:  # the ids are this sample's own
            return id_parts[0], mask_parts[0], image_starts
        return np.concatenate(id_parts), np.concatenate(mask_parts), image_starts

    def _run_mask(self, name: str, trained: bool) -> np.ndarray:
        """The mask of an image run or a BOS/EOS id (shared: only ever copied into a sample)."""
        key = (name, trained)
        if key not in self._run_masks:
            length = len(self._run_ids) if name == "image" else 1
            self._run_masks[key] = np.full(length, trained)
        return self._run_masks[key]

    def _encode_chunk(self, chunk: _Chunk, continues: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """One tokenizer call over the chunk's text, then two repairs, both by character span:
        a marker's pieces become its ids (an image run, BOS, EOS); a control id whose text a
        user typed (``</s>``, ``<extra_id_4>``, ``<|im_start|>``...) is spelled as ordinary
        text instead; everything else is exactly what the tokenizer gave.

        ``continues``: the text follows a BOS/EOS id (or, under ``nemo``, a special the tokenizer
        has no piece for); it goes on without a new leading "▁", as in one call, and is spelled
        without any control id."""
        text = "".join(chunk.texts)
        encoding = self.tokenizer.encode_literal(text) if continues else self.tokenizer.encode(text)
        ids = encoding.ids
        mask, flagged, ordered = chunk_labels(
            ids, encoding.starts, encoding.ends, np.array(chunk.bounds), np.array(chunk.trained), self._is_control
        )
        if not len(flagged):
            return ids, mask, []
        replaced = self._replace_markers(chunk, encoding, mask, flagged) if ordered else None
        if replaced is not None:
            return replaced
        return self._repair(chunk, text, encoding, mask, flagged)

    def _replace_markers(self, chunk: _Chunk, encoding, mask, flagged) -> tuple | None:
        """The usual case of ``_repair``, cheaply, for tokens that are ordered, non-overlapping
        spans (sentencepiece's): every control id of the chunk is a marker's own piece, exactly
        where the marker's text is, or template text's (nvgpt's <extra_id_1>); None for anything
        else (``_repair`` then decides, or raises)."""
        ids, starts, ends = encoding.ids, encoding.starts, encoding.ends
        firsts = np.searchsorted(ends, [slot[0] for slot in chunk.slots], side="right").tolist()  # first token past it
        in_place = True
        at_markers = 0
        for (start, end, marker, new, _), first in zip(chunk.slots, firsts):
            count = len(marker.id_list)
            last = first + count - 1
            if last >= len(ids) or starts[first] != start or ends[last] != end:
                return None
            if ids[first : last + 1].tolist() != marker.id_list:
                return None
            if count > 1 and not (ends[first : last + 1] > starts[first : last + 1]).all():
                return None  # a zero-width token among its pieces
            in_place = in_place and count == len(new) and marker.name != "image"
            at_markers += count
        if len(flagged) > at_markers:  # control ids besides the markers' own (all flagged)
            markers = {first + j for (_, _, marker, _, _), first in zip(chunk.slots, firsts) for j in range(len(marker.id_list))}
            for k in flagged.tolist():
                if k not in markers and chunk.has_content(int(starts[k]), max(int(ends[k]), int(starts[k]) + 1)):
                    return None  # a control id a user typed: spelled as text by _repair
        if in_place:  # BOS/EOS: one id for one piece
            for (_, _, marker, new, trained), first in zip(chunk.slots, firsts):
                ids[first : first + len(new)] = new
                mask[first : first + len(new)] = trained
            return ids, mask, []
        out_ids, out_mask, image_starts = [], [], []
        previous = position = 0
        for (_, _, marker, new, trained), first in zip(chunk.slots, firsts):
            out_ids.append(ids[previous:first])
            out_mask.append(mask[previous:first])
            position += first - previous
            if marker.name == "image":
                image_starts.append(position)
            out_ids.append(new)
            out_mask.append(np.full(len(new), trained))
            position += len(new)
            previous = first + len(marker.id_list)
        out_ids.append(ids[previous:])
        out_mask.append(mask[previous:])
        return np.concatenate(out_ids), np.concatenate(out_mask), image_starts

    def _repair(self, chunk: _Chunk, text: str, encoding, mask, flagged) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Every control id of the chunk, one by one: a marker's pieces must be exactly its ids
        (they become its image run or BOS/EOS); one in text a user typed is spelled literally."""
        ids = encoding.ids
        lengths = np.diff(chunk.bounds)
        trained_chars = np.repeat(np.array(chunk.trained, dtype=bool), lengths)
        content_chars = np.repeat(np.array(chunk.content, dtype=bool), lengths)
        replace: dict[int, tuple[np.ndarray, np.ndarray, bool] | None] = {}
        for start, end, marker, new_ids, trained in chunk.slots:
            inside = (encoding.starts >= start) & (encoding.ends <= end) & (encoding.ends > encoding.starts)
            straddle = (encoding.starts < end) & (encoding.ends > start) & ~inside
            found = np.flatnonzero(inside)
            if straddle.any() or not np.array_equal(ids[found], marker.ids):
                raise RuntimeError(f"{self.tokenizer.name} did not keep {marker.text!r} as its own pieces")
            replace[int(found[0])] = (new_ids, np.full(len(new_ids), trained), marker.name == "image")
            replace.update({int(k): None for k in found[1:]})
        for k in flagged:
            k = int(k)
            start, end = int(encoding.starts[k]), int(encoding.ends[k])
            if k in replace or not content_chars[start:max(end, start + 1)].any():
                continue  # a marker, or the template's own text (nvgpt's <extra_id_1>, a Llama-3 header)
            literal = self.tokenizer.encode_literal(text[start:end])
            replace[k] = (literal.ids, _trained_tokens(literal.starts, literal.ends, trained_chars[start:end]), False)
        out_ids, out_mask, image_starts = [], [], []
        position, previous = 0, 0
        for k in sorted(replace):
            out_ids.append(ids[previous:k])
            out_mask.append(mask[previous:k])
            position += k - previous
            previous = k + 1
            if replace[k] is None:
                continue
            new_ids, new_mask, is_image = replace[k]
            if is_image:
                image_starts.append(position)
            out_ids.append(new_ids)
            out_mask.append(new_mask)
            position += len(new_ids)
        out_ids.append(ids[previous:])
        out_mask.append(mask[previous:])
        return np.concatenate(out_ids), np.concatenate(out_mask), image_starts

    def _load(self, name: str) -> np.ndarray:
        image = decode_image(self.image_source.read(name), name, self.max_image_pixels, self.max_image_decode_seconds)
        self.preprocessor.check_size(image.size, name)
        return self.preprocessor.to_uint8(image)

    def _no_images(self) -> np.ndarray:
        return np.zeros((0, *self.preprocessor.shape), dtype=np.uint8)


def check_token_ids(image_run: ImageRun, vocab_size: int, pad_id: int = PAD_ID, ignore_index: int = IGNORE_INDEX) -> None:
    """Image and pad ids must be ids of the vocabulary (0 .. vocab_size - 1), hence exact in the float32
    packed format: an id like 16777217 would be stored as 16777216. The ignore value must not be one:
    the labels of that token would read as ignored and never be trained."""
    for name, value in (("image_patch_id", image_run.patch_id), ("image_start_id", image_run.start_id),
                        ("image_end_id", image_run.end_id), ("pad_id", pad_id)):  # fmt: skip
        if value is not None and not 0 <= value < vocab_size:
            raise ConfigError(f"--{name} {value}: not an id of the tokenizer's vocabulary (0 .. {vocab_size - 1})")
    if 0 <= ignore_index < vocab_size:
        raise ConfigError(
            f"--ignore_index {ignore_index}: an id of the tokenizer's vocabulary (0 .. {vocab_size - 1}); "
            "its labels would read as ignored: use a negative value (NeMo: -1)"
        )


_PROBE_TURNS = (Turn("user", "<image>q"), Turn("assistant", "a"), Turn("user", "q"), Turn("assistant", "a"))
"""A small conversation, rendered once to find which special tokens a template uses."""


@dataclass(frozen=True, slots=True)
class _Marker:
    name: str
    """"image", "bos" or "eos"."""
    text: str
    """The special pieces' text, written into a one-call prompt."""
    ids: np.ndarray
    """The ids the tokenizer gives that text."""
    id_list: list[int]
    """The same, as Python ints (compared with a slice of ids, per record)."""


class _Chunk:
    """The text of one tokenizer call, part by part (parallel lists: one entry per part)."""

    __slots__ = ("texts", "trained", "content", "bounds", "slots")

    def __init__(self):
        self.texts: list[str] = []
        """Text of each part (a marker's special pieces for a marker)."""
        self.trained: list[bool] = []
        """Whether each part's tokens are label targets."""
        self.content: list[bool] = []
        """Conversation text: a control id inside it is spelled as text."""
        self.bounds: list[int] = [0]
        """Character offset where each part starts, and the text's length last."""
        self.slots: list[tuple[int, int, _Marker, np.ndarray, bool]] = []
        """(start, end, marker, what it becomes: an image run or a BOS/EOS id, trained) per marker."""

    def add(self, text: str, trained: bool, content: bool) -> None:
        self.texts.append(text)
        self.trained.append(trained)
        self.content.append(content)
        self.bounds.append(self.bounds[-1] + len(text))

    def add_marker(self, marker: _Marker, trained: bool, ids: np.ndarray) -> None:
        self.slots.append((self.bounds[-1], self.bounds[-1] + len(marker.text), marker, ids, trained))
        self.add(marker.text, trained, False)

    def has_content(self, start: int, end: int) -> bool:
        """Whether characters start..end (exclusive) hold conversation text."""
        part = bisect.bisect_right(self.bounds, start) - 1
        while part < len(self.texts) and self.bounds[part] < end:
            if self.content[part]:
                return True
            part += 1
        return False


def chunk_labels(ids, starts, ends, bounds, trained, is_control) -> tuple[np.ndarray, np.ndarray, bool]:
    """Labels of a chunk's tokens in one compiled pass: (trained mask, positions of control ids,
    whether the tokens are ordered non-overlapping spans).

    The chunk's text is parts starting at ``bounds`` (its length last), ``trained`` or not. A token is trained
    when its characters overlap a trained part; a zero-width token (a sentencepiece "▁" or byte
    piece) takes the flag of the character where it sits (the last one at the end)::

        parts    "USER: hi "  "ASSISTANT:"  " "  "ok"      trained: .  .  x  x
        tokens   ▁USER : ▁hi ▁ASS IST ANT :  ▁ok                 ▁ok overlaps " " and "ok": x
    """
    return _chunk_labels_kernel()(ids, starts, ends, bounds, trained, is_control)


@functools.cache
def _chunk_labels_kernel():
    """Loaded on first use: a process that never tokenizes never imports numba."""
    from neva_pack.text_kernels import chunk_labels_kernel

    return chunk_labels_kernel


def _trained_tokens(starts: np.ndarray, ends: np.ndarray, trained_chars: np.ndarray) -> np.ndarray:
    """A token is trained when its characters overlap trained text; a zero-width token (a
    sentencepiece "▁" or byte piece) takes the flag of the character where it sits."""
    if len(starts) == 0:
        return np.zeros(0, dtype=bool)
    cumulative = np.concatenate([[0], np.cumsum(trained_chars)])
    overlaps = cumulative[ends] - cumulative[starts] > 0
    zero_width = ends <= starts
    if zero_width.any() and len(trained_chars):
        at = np.minimum(starts[zero_width], len(trained_chars) - 1)
        overlaps[zero_width] = trained_chars[at]
    return overlaps


class SampleStream(IterableDataset):
    """Records of ``data_path`` -> sample_store.StoredBatch messages, for a multi-worker DataLoader.

    Records are dealt in messages of consecutive records, message k to worker k mod W: each
    worker's first message holds ``first_batch_size`` records (the first record reaches the main
    process after one record's work, not a whole batch's), every later one ``batch_size`` (one
    round trip per batch, not per record). The DataLoader takes one message from each worker in
    turn, so messages, and the records in them, arrive in input order whatever W is: the outputs
    are byte-identical for any number of workers::

        records   0   1   2..33   34..65   66..97  ...
        worker    0   1     0        1        0    ...     (W = 2, first_batch_size 1, batch_size 32)

    A message is one StoredBatch (the store's bytes of its records' samples, and its skips), not
    a list of Samples: one cheap object to unpickle per message in the main process.
    ``index`` (records.index_records, taken before the workers fork): with its offsets a worker
    seeks to its own messages instead of delimiting every record of the file. ``share_images``: a
    stored message's images cross to the main process in shared memory (``received`` takes them back).
    """

    def __init__(
        self, data_path, builder: SampleBuilder, start: int = 0, end: int | None = None, batch_size: int = 32,
        first_batch_size: int | None = None, index: RecordIndex | None = None,
        share_images: bool = False,
    ):  # fmt: skip
        self.data_path = data_path
        self.share_images = share_images
        self.index = index
        self.builder = builder
        self.start = start
        self.end = end
        self.batch_size = batch_size
        self.first_batch_size = batch_size if first_batch_size is None else first_batch_size

    def _message(self, offset: int, workers: int) -> int:
        """Number of the message that carries the record ``offset`` records after ``start``."""
        first = workers * self.first_batch_size
        if offset < first:
            return offset // self.first_batch_size
        return workers + (offset - first) // self.batch_size

    def _first_record(self, message: int, workers: int) -> int:
        """The record message number ``message`` starts with (the inverse of ``_message``)."""
        if message < workers:
            return self.start + message * self.first_batch_size
        return self.start + workers * self.first_batch_size + (message - workers) * self.batch_size

    def _ranges(self, worker: int, workers: int):
        """The record ranges [first, stop) of ``worker``'s messages, in order (endless when ``end``
        is None: the file's end stops the reader)."""
        for message in itertools.count(worker, workers):
            first, stop = self._first_record(message, workers), self._first_record(message + 1, workers)
            if self.end is not None:
                if first >= self.end:
                    return
                stop = min(stop, self.end)
            yield first, stop

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        run, ignore_index, shape = self.builder.image_run.ids(), self.builder.ignore_index, self.builder.preprocessor.shape
        batch = []
        ranges = self._ranges(worker, workers)
        send = in_shared_memory if self.share_images else _as_is
        for raw in iter_raw_records(self.data_path, self.builder.record_limits, ranges=ranges, index=self.index):
            offset = raw.index - self.start
            message = self._message(offset, workers)
            batch.append(self.builder.build(raw))
            if self._message(offset + 1, workers) != message:
                yield send(stored_batch(batch, run, ignore_index, shape))
                batch = []
        if batch:
            yield send(stored_batch(batch, run, ignore_index, shape))


def in_shared_memory(batch: StoredBatch) -> StoredBatch:
    """The batch with its images as a torch tensor: a DataLoader worker hands a tensor over in
    shared memory (only a handle crosses the pipe), where a NumPy array is pickled through the pipe
    and copied twice more in the main process, which every batch goes through.
    ``received`` undoes it."""
    if not batch.images.size:
        return batch
    return replace(batch, images=torch.from_numpy(batch.images))


def _as_is(batch: StoredBatch) -> StoredBatch:
    return batch


def received(batch: StoredBatch) -> StoredBatch:
    """A message as the main process receives it, its images a NumPy array again (no copy)."""
    if isinstance(batch.images, torch.Tensor):
        return replace(batch, images=batch.images.numpy())
    return batch
