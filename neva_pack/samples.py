"""Record -> Sample: render the template, tokenize, expand image placeholders, label, load images.

One sample's token ids, with NeMo's shift into tokens/labels::

    ids     = [bos] USER: <im_start> 0 0 ... 0 <im_end> \\n What ? ASSISTANT: ▁It ▁is . </s>
    trained =   .     .      .       . . ... .    .      .   .   .     .       x   x   x  x
    tokens  = ids[:-1]
    labels  = ids[1:] where trained, else ignore_index (-1)

The sample's length (what is packed) is len(tokens): text plus image positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from neva_pack.errors import ConfigError
from neva_pack.images import ImagePreprocessor, ImageSource, decode_image
from neva_pack.records import RawRecord, RecordError, Turn, iter_raw_records, parse_record
from neva_pack.templates import Piece, Template, render
from neva_pack.tokenizer import Tokenizer

NEMO_IM_START = "<extra_id_4>"
NEMO_IM_END = "<extra_id_5>"
MAX_EXACT_FLOAT32_ID = 2**24
"""Token ids are stored as float32 in NeMo's packed format: exact only below 2**24."""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageTokenLayout:
    """How one image's positions are spelled as token ids."""

    positions: int
    """Sequence positions per image (what the encoder produces, plus start/end if added)."""
    patch_id: int
    """Id of every image-embedding position."""
    start_id: int | None
    """Id opening an image run (NeMo: <extra_id_4>), or None."""
    end_id: int | None
    """Id closing an image run (NeMo: <extra_id_5>), or None."""

    def run(self) -> np.ndarray:
        inner = self.positions - (self.start_id is not None) - (self.end_id is not None)
        parts = [[self.start_id]] if self.start_id is not None else []
        parts.append([self.patch_id] * inner)
        if self.end_id is not None:
            parts.append([self.end_id])
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def image_token_layout(
    tokenizer: Tokenizer,
    encoder_tokens: int,
    use_im_start_end: bool = False,
    patch_id: int = 0,
    start_id: int | None = None,
    end_id: int | None = None,
) -> ImageTokenLayout:
    """NeMo's layout when the tokenizer has <extra_id_4>/<extra_id_5>, else the given ids.

    NeMo: start + patch x (N - 2) + end (N positions), or start + patch x N + end with
    use_im_start_end. Without those tokens: N patch ids, with optional explicit start/end.
    """
    if start_id is None and end_id is None:
        start_id = tokenizer.token_to_id(NEMO_IM_START)
        end_id = tokenizer.token_to_id(NEMO_IM_END)
        if start_id is None or end_id is None:
            start_id = end_id = None
    delimiters = (start_id is not None) + (end_id is not None)
    positions = encoder_tokens + delimiters if use_im_start_end or delimiters == 0 else encoder_tokens
    if positions - delimiters < 1:
        raise ConfigError(f"an image of {encoder_tokens} positions cannot hold its start/end tokens")
    return ImageTokenLayout(positions=positions, patch_id=patch_id, start_id=start_id, end_id=end_id)


def truncation(image_starts, run_length: int, max_seq_length: int) -> tuple[int, int]:
    """Where to cut a sample's ids to fit ``max_seq_length`` positions: (ids to keep, images to keep).

    ids are cut to max_seq_length + 1 (tokens = ids[:-1]), or right before the first image run
    that would not fit whole: an image run is never split.
    """
    cut = max_seq_length + 1
    kept = 0
    while kept < len(image_starts) and image_starts[kept] + run_length <= cut:
        kept += 1
    if kept < len(image_starts):
        cut = min(cut, int(image_starts[kept]))
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
        layout: ImageTokenLayout,
        max_seq_length: int,
        truncate: bool = True,
        ignore_index: int = -1,
        system_prompt: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.template = template
        self.image_source = image_source
        self.preprocessor = preprocessor
        self.layout = layout
        self.max_seq_length = max_seq_length
        self.truncate = truncate
        self.ignore_index = ignore_index
        self.system_prompt = system_prompt
        self._image_run = layout.run()
        self._special_ids = self._resolve_specials()
        if tokenizer.vocab_size > MAX_EXACT_FLOAT32_ID:
            raise ConfigError(f"vocabulary of {tokenizer.vocab_size} ids does not fit NeMo's float32 packed format")

    def _resolve_specials(self) -> dict[str, int]:
        probe = render(self.template, _PROBE_TURNS)
        ids = {"bos": self.tokenizer.bos_id, "eos": self.tokenizer.eos_id}
        for piece in probe:
            if piece.kind == "special" and ids[piece.value] is None:
                raise ConfigError(
                    f"template {self.template.name!r} needs the tokenizer's {piece.value.upper()} token, "
                    f"but {self.tokenizer.name} defines none"
                )
        return ids

    def build(self, raw: RawRecord) -> Sample | Skipped:
        record_id = raw.value.get("id") if isinstance(raw.value, dict) else None
        record_id = None if record_id is None else str(record_id)
        try:
            return self._build(raw)
        except RecordError as error:
            return Skipped(index=raw.index, record_id=record_id, reason=error.reason, detail=error.detail)

    def _build(self, raw: RawRecord) -> Sample:
        conversation = parse_record(raw)
        pieces = render(self.template, conversation.turns, self.system_prompt)
        ids, trained, image_starts = self._encode(pieces)
        truncated = False
        if len(ids) > self.max_seq_length + 1:
            if not self.truncate:
                raise RecordError("too_long", f"{len(ids) - 1} positions > max_seq_length {self.max_seq_length}")
            cut, kept = truncation(image_starts, len(self._image_run), self.max_seq_length)
            ids, trained, image_starts = ids[:cut], trained[:cut], image_starts[:kept]
            truncated = True
        if len(ids) < 2:
            raise RecordError("empty_conversation", "the conversation renders to fewer than 2 tokens")
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

    def _encode(self, pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Pieces -> (ids, trained mask, start position of each image run).

        Consecutive text pieces are tokenized as one string (as a model sees them); the
        mask comes from the character offsets of the tokens actually emitted. Text is
        split at images and special tokens, as LLaVA's tokenizer_image_token splits at <image>.
        """
        id_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        image_starts: list[int] = []
        position = 0
        run: list[Piece] = []

        def flush():
            nonlocal position
            if run:
                ids, mask = self._encode_text(run)
                id_parts.append(ids)
                mask_parts.append(mask)
                position += len(ids)
                run.clear()

        for piece in pieces:
            if piece.kind == "text":
                run.append(piece)
                continue
            flush()
            if piece.kind == "image":
                image_starts.append(position)
                id_parts.append(self._image_run)
                mask_parts.append(np.zeros(len(self._image_run), dtype=bool))
                position += len(self._image_run)
            else:
                id_parts.append(np.asarray([self._special_ids[piece.value]], dtype=np.int64))
                mask_parts.append(np.asarray([piece.trained]))
                position += 1
        flush()
        if not id_parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), []
        return np.concatenate(id_parts), np.concatenate(mask_parts), image_starts

    def _encode_text(self, run: list[Piece]) -> tuple[np.ndarray, np.ndarray]:
        text = "".join(p.value for p in run)
        trained_chars = np.concatenate([np.full(len(p.value), p.trained, dtype=bool) for p in run])
        encoding = self.tokenizer.encode(text)
        if len(encoding.ids) == 0:
            return encoding.ids, np.zeros(0, dtype=bool)
        cumulative = np.concatenate([[0], np.cumsum(trained_chars)])
        overlaps = cumulative[encoding.ends] - cumulative[encoding.starts] > 0
        zero_width = encoding.ends <= encoding.starts
        if zero_width.any() and len(text):
            at = np.minimum(encoding.starts[zero_width], len(text) - 1)
            overlaps[zero_width] = trained_chars[at]
        return encoding.ids, overlaps

    def _load(self, name: str) -> np.ndarray:
        return self.preprocessor.to_uint8(decode_image(self.image_source.read(name), name))

    def _no_images(self) -> np.ndarray:
        return np.zeros((0, *self.preprocessor.shape), dtype=np.uint8)


_PROBE_TURNS = (Turn("user", "q"), Turn("assistant", "a"))
"""A minimal conversation, rendered once to find which special tokens a template uses."""


class SampleStream(IterableDataset):
    """Records of ``data_path`` -> lists of Sample | Skipped, for a multi-worker DataLoader.

    Records are dealt in batches of ``batch_size`` consecutive records, batch k to worker
    k mod W, and a worker sends a whole batch as one message (one round trip per batch, not
    per record). The DataLoader takes one message from each worker in turn, so batches, and
    the records in them, arrive in input order whatever W is: the outputs are byte-identical
    for any number of workers::

        records   0..31   32..63   64..95   96..127  ...
        worker      0        1        0        1     ...     (W = 2, batch_size = 32)
    """

    def __init__(self, data_path, builder: SampleBuilder, start: int = 0, end: int | None = None, batch_size: int = 32):
        self.data_path = data_path
        self.builder = builder
        self.start = start
        self.end = end
        self.batch_size = batch_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        batch = []
        for raw in iter_raw_records(self.data_path):
            if self.end is not None and raw.index >= self.end:
                break
            if raw.index < self.start or ((raw.index - self.start) // self.batch_size) % workers != worker:
                continue
            batch.append(self.builder.build(raw))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


def passthrough(item):
    """DataLoader collate that leaves Sample/Skipped as they are (no tensor conversion)."""
    return item
