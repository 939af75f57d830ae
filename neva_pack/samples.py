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

from dataclasses import dataclass

import numpy as np

from neva_pack.defaults import IGNORE_INDEX
from neva_pack.errors import ConfigError
from neva_pack.image_ids import NEMO_IM_END, NEMO_IM_START, check_token_ids
from neva_pack.image_run import ImageRun
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
    RecordLimits,
    Turn,
    parse_record,
)
from neva_pack.label_chunks import Marker, TextChunk, chunk_labels, trained_tokens
from neva_pack.templates import DEFAULT_TOKENIZATION, TOKENIZATIONS, Piece, Template, Tokenization, render
from neva_pack.tokenizer import Tokenizer

__all__ = ["Sample", "SampleBuilder", "Skipped", "truncation"]


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
    image_tokens: np.ndarray
    """int32 positions of each image's run (fixed-crop encoders: the same for every image)."""
    vision_cost: int
    """The vision encoder's attention cost of the sample's images, in patches² per encoder pass
    (what --balance_data_parallel weighs images by)."""
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


_PROBE_TURNS = (Turn("user", "<image>q"), Turn("assistant", "a"), Turn("user", "q"), Turn("assistant", "a"))
"""A small conversation, rendered once to find which special tokens a template uses."""


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

    def _resolve_markers(self) -> dict[str, Marker]:
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
                markers[name] = Marker(name=name, text="".join(texts), ids=np.asarray(ids, dtype=np.int64), id_list=ids)
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
            image_tokens=np.full(len(names), len(self._run_ids), dtype=np.int32),
            vision_cost=len(names) * self.preprocessor.vision_cost,
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
        segments: list[TextChunk | tuple[np.ndarray, np.ndarray, bool]] = []
        chunk = None
        rendered = 0
        for piece in pieces:
            kind = piece.kind
            if kind == "text" or kind == "content":
                value = piece.value
                if value:
                    if chunk is None:
                        chunk = TextChunk()
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
                    chunk = TextChunk()
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
            if type(segment) is TextChunk:
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
        if len(segments) == 1 and type(segments[0]) is TextChunk:  # the ids are this sample's own
            return id_parts[0], mask_parts[0], image_starts
        return np.concatenate(id_parts), np.concatenate(mask_parts), image_starts

    def _run_mask(self, name: str, trained: bool) -> np.ndarray:
        """The mask of an image run or a BOS/EOS id (shared: only ever copied into a sample)."""
        key = (name, trained)
        if key not in self._run_masks:
            length = len(self._run_ids) if name == "image" else 1
            self._run_masks[key] = np.full(length, trained)
        return self._run_masks[key]

    def _encode_chunk(self, chunk: TextChunk, continues: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
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

    def _replace_markers(self, chunk: TextChunk, encoding, mask, flagged) -> tuple | None:
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

    def _repair(self, chunk: TextChunk, text: str, encoding, mask, flagged) -> tuple[np.ndarray, np.ndarray, list[int]]:
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
            replace[k] = (literal.ids, trained_tokens(literal.starts, literal.ends, trained_chars[start:end]), False)
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
