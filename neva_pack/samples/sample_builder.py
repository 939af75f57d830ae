"""Record -> Sample: render the template, tokenize, expand image placeholders, label, load images.

One sample's token ids (NeMo's v1, one tokenizer call), with NeMo's shift into tokens/labels::

    ids     = ▁USER : ▁ <im_start> 0 0 ... 0 <im_end> \\n What ? ▁ASSISTANT : ▁It ▁is . </s>
    trained =    .  . .     .      . . ... .    .      .   .   .     .       .  x   x   x  x
    tokens  = ids[:-1]
    labels  = ids[1:] where trained, else ignore_index (-1)

The sample's length (what is packed) is len(tokens): text plus image positions. Conversation
text never yields a control id (conversation_ids.py).

A dynamic-resolution family (Qwen2-VL, LLaVA-NeXT / OneVision) gives each image a run of its own
length, counted from the image's header before anything is decoded (header_images.py); the ids are
laid out and truncated with those lengths, then only the images kept are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neva_pack.samples.conversation_ids import ConversationIds
from neva_pack.core import ConfigError, IGNORE_INDEX, ImageRun
from neva_pack.samples.header_images import HeaderImage, HeaderImages, header_size_of
from neva_pack.families import (
    DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, ImageSource, ModelFamily, StoredImage,
    check_token_ids, decode_image, too_many_pixels
)
from neva_pack.records import (
    DEFAULT_MAX_CONVERSATION_CHARS,
    DEFAULT_MAX_IMAGES_PER_RECORD,
    IMAGES_NOT_HELD,
    Conversation,
    RawRecord,
    RecordError,
    RecordLimits,
    VIDEOS_NOT_READ,
    parse_record,
)
from neva_pack.text import DEFAULT_TOKENIZATION, TOKENIZATIONS, Template, Tokenization, Tokenizer

__all__ = ["Sample", "SampleBuilder", "SampleLayout", "Skipped", "truncation"]


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
    images: np.ndarray | tuple[StoredImage, ...]
    """In placeholder order: fixed-crop encoders uint8 (num_images, 3, H, W); dynamic-resolution
    families one StoredImage per image, each at its own size."""
    image_starts: np.ndarray
    """int32 position in tokens where each image run starts (to truncate again later)."""
    image_tokens: np.ndarray
    """int32 positions of each image's run, start/end included (fixed-crop encoders: the same for every image)."""
    vision_cost: int
    """The vision encoder's attention cost of the sample's images, in patches² per encoder pass
    (what --balance_data_parallel weighs images by)."""
    truncated: bool
    """Whether the ids were cut to max_seq_length + 1."""

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleLayout:
    """A record's sample laid out from its text and its images' headers, before any pixel is
    decoded (``SampleBuilder.layout``): what a packing plan needs, equal to the built Sample's."""

    index: int
    """Source record index."""
    record_id: str | None
    """The record's "id"."""
    length: int
    """Positions (len(Sample.tokens))."""
    image_starts: np.ndarray
    """int32 position of each kept image's run (Sample.image_starts)."""
    image_tokens: np.ndarray
    """int32 positions of each kept image's run (Sample.image_tokens)."""
    image_costs: np.ndarray
    """int64 vision encoder cost of each kept image (their sum is Sample.vision_cost)."""
    first_trained: int
    """Position of the first trained label (``length`` when none): a cut keeping no more tokens than
    this leaves the sample untrained."""
    truncated: bool
    """Whether the ids were cut to max_seq_length + 1."""

    @property
    def num_images(self) -> int:
        return len(self.image_starts)

    @property
    def vision_cost(self) -> int:
        return int(self.image_costs.sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class _Arranged:
    """A sample's ids, cut and checked, and the images it keeps, not yet decoded."""

    ids: np.ndarray
    trained: np.ndarray
    image_starts: list[int]
    run_lengths: list[int]
    costs: list[int]
    to_load: tuple[str, ...] | list[HeaderImage]
    """Names (fixed-crop encoders) or header-read images (dynamic families), in placeholder order."""
    truncated: bool


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


def truncation(image_starts, run_lengths, max_seq_length: int) -> tuple[int, int]:
    """Where to cut a sample's ids to fit ``max_seq_length`` positions: (ids to keep, images to keep).
    ``run_lengths``: the positions of every image's run (an int), or of each image's (a sequence).

    ids are cut to max_seq_length + 1 (tokens = ids[:-1]), or so that the tokens end right before
    the first image run that would not fit whole: an image run is never split. Both limits are
    about the *tokens*, which hold one id less than the ids::

        ids     t t t [A A A][B B B] t      max_seq_length 7: run A fits in the tokens, B does not:
        tokens  t t t [A A A]               ids[:7] (up to B's first id, which only labels the
        labels  . . . [. . .]               last token, and untrained), tokens = ids[:6], 1 image

    (Cutting the ids at B's start would make tokens = ids[:5]: A's last position lost.)
    """
    cut = max_seq_length + 1
    lengths = np.broadcast_to(np.asarray(run_lengths, dtype=np.int64), (len(image_starts),))
    kept = 0
    while kept < len(image_starts) and image_starts[kept] + lengths[kept] <= max_seq_length:
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
        preprocessor: ModelFamily,
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
        """``text_only``: the output holds no image, so a record with images is skipped (``images_not_held``).

        ``preprocessor``: the family object (``families.model_family``) with its ``image_run``: a fixed
        run for a family of one crop, a dynamic one for a family whose images each have their own size."""
        if image_run.dynamic != preprocessor.own_size:
            raise ConfigError("a dynamic-resolution processor needs a dynamic image run, a fixed-crop one a fixed run")
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
        self._run_ids = None if image_run.dynamic else image_run.ids()
        self._header_images = (
            HeaderImages(preprocessor, image_source, max_image_pixels, max_image_decode_seconds, tokenizer) if image_run.dynamic else None
        )
        self._ids = ConversationIds(
            tokenizer=tokenizer, template=template, image_run=image_run, tokenization=self.tokenization,
            system_prompt=system_prompt, max_conversation_chars=max_conversation_chars,
        )  # fmt: skip
        check_token_ids(image_run, tokenizer.vocab_size, ignore_index=ignore_index, specials={"BOS": tokenizer.bos_id, "EOS": tokenizer.eos_id})

    def build(self, raw: RawRecord) -> Sample | Skipped:
        try:
            return self._build(raw)
        except RecordError as error:
            return Skipped(index=raw.index, record_id=raw.record_id, reason=error.reason, detail=error.detail)

    def layout(self, raw: RawRecord) -> SampleLayout | Skipped:
        """The record's sample as ``build`` lays it out (length, images kept, their run lengths and
        vision costs), from the text and the images' headers alone: no pixel is decoded. A record
        ``build`` would skip for a reason known before decoding (its text, a missing or oversized
        image, a header no decoder can read) is Skipped the same way; one skipped only when decoded
        (a corrupt body, a decode over its time budget, a size that disagrees with its header) is not."""
        try:
            conversation = parse_record(raw, self.max_conversation_chars, self.max_images_per_record)
            arranged = self._arranged(conversation, header_only=True)
            for name in arranged.to_load if self._header_images is None else ():
                self._check_header(name)
        except RecordError as error:
            return Skipped(index=raw.index, record_id=raw.record_id, reason=error.reason, detail=error.detail)
        trained_labels = np.flatnonzero(arranged.trained[1:])
        return SampleLayout(
            index=conversation.index,
            record_id=conversation.record_id,
            length=len(arranged.ids) - 1,
            image_starts=np.asarray(arranged.image_starts, dtype=np.int32),
            image_tokens=np.asarray(arranged.run_lengths, dtype=np.int32).reshape(-1),
            image_costs=np.asarray(arranged.costs, dtype=np.int64).reshape(-1),
            first_trained=int(trained_labels[0]) if len(trained_labels) else len(arranged.ids) - 1,
            truncated=arranged.truncated,
        )

    def _build(self, raw: RawRecord) -> Sample:
        conversation = parse_record(raw, self.max_conversation_chars, self.max_images_per_record)
        arranged = self._arranged(conversation)
        if self._header_images is not None:
            images = tuple(self._header_images.load(h) for h in arranged.to_load)
        else:
            images = np.stack([self._load(name) for name in arranged.to_load]) if arranged.to_load else self._no_images()
        labels = np.where(arranged.trained[1:], arranged.ids[1:], self.ignore_index)
        return Sample(
            index=conversation.index,
            record_id=conversation.record_id,
            tokens=arranged.ids[:-1].astype(np.int32),
            labels=labels.astype(np.int32),
            images=images,
            image_starts=np.asarray(arranged.image_starts, dtype=np.int32),
            image_tokens=np.asarray(arranged.run_lengths, dtype=np.int32).reshape(-1),
            vision_cost=int(sum(arranged.costs)),
            truncated=arranged.truncated,
        )

    def _arranged(self, conversation: Conversation, header_only: bool = False) -> _Arranged:
        """The sample's ids, cut and checked to be worth training, and the images it keeps, before
        any is decoded (what ``build`` and ``layout`` share; ``header_only``: a layout's, whose dynamic
        images are read as far as their headers only)."""
        if self.text_only and conversation.images:
            raise RecordError(IMAGES_NOT_HELD, f"{len(conversation.images)} image(s), and the output format holds text only")
        if conversation.video_slots and not getattr(self.preprocessor, "takes_videos", False):
            what = getattr(self.preprocessor, "models", "the encoder")
            raise RecordError(VIDEOS_NOT_READ, f"{len(conversation.video_slots)} video clip(s), and {what} (as this run reads it) reads none")
        if self._header_images is not None:
            return self._arranged_dynamic(conversation, header_only)
        ids, trained, image_starts = self.encode(conversation)
        ids, trained, kept, truncated = self._truncated(ids, trained, image_starts, len(self._run_ids))
        return _Arranged(
            ids=ids, trained=trained, image_starts=image_starts[:kept], run_lengths=[len(self._run_ids)] * kept,
            costs=[self.preprocessor.vision_cost] * kept, to_load=conversation.images[:kept], truncated=truncated,
        )  # fmt: skip

    def _arranged_dynamic(self, conversation: Conversation, header_only: bool) -> _Arranged:
        """Each image's run length from its header; ids laid out and truncated with them (a OneVision
        sample cut to one image counts it again as its only one); the images kept, still undecoded."""
        headers = self._header_images.read(conversation.images, header_only, conversation.video_slots)
        ids, trained, image_starts = self.encode(conversation, [h.tokens if h.video is None else h.video.ids for h in headers])
        lengths = [self.image_run.length(h.tokens) if h.video is None else len(h.video.ids) for h in headers]
        ids, trained, kept, truncated = self._truncated(ids, trained, image_starts, lengths, keep=True)
        if 0 < kept < len(headers) and kept == 1 and headers[0].sample_images > 1:
            headers = [self._header_images.counted(headers[0], sample_images=1), *headers[1:]]
            ids, trained, image_starts = self.encode(conversation, [h.tokens for h in headers])
            lengths = [self.image_run.length(h.tokens) for h in headers]
            ids, trained, kept, truncated = self._truncated(ids, trained, image_starts, lengths, keep=True)
        self._check_trained(trained, truncated)
        kept_headers: list[HeaderImage] = headers[:kept]
        return _Arranged(
            ids=ids, trained=trained, image_starts=image_starts[:kept], run_lengths=lengths[:kept],
            costs=[self._header_images.vision_cost(h) for h in kept_headers], to_load=kept_headers, truncated=truncated,
        )  # fmt: skip

    def _truncated(self, ids, trained, image_starts, run_lengths, keep: bool = False) -> tuple:
        """(ids, trained, images kept, truncated): cut to max_seq_length + 1 (never inside an image
        run), or skipped as too_long; then checked to be a sample worth training (``keep``: later)."""
        truncated = False
        kept = len(image_starts)
        if len(ids) > self.max_seq_length + 1:
            if not self.truncate:
                raise RecordError("too_long", f"{len(ids) - 1} positions > max_seq_length {self.max_seq_length}")
            cut, kept = truncation(image_starts, run_lengths, self.max_seq_length)
            ids, trained = ids[:cut], trained[:cut]
            truncated = True
        if not keep:
            self._check_trained(trained, truncated)
        return ids, trained, kept, truncated

    def _check_trained(self, trained: np.ndarray, truncated: bool) -> None:
        if len(trained) < 2 and not truncated:
            raise RecordError("empty_conversation", "the conversation renders to fewer than 2 tokens")
        if not trained[1:].any():  # e.g. cut before its answer (or its image) by a short max_seq_length
            where = f" after truncation to max_seq_length {self.max_seq_length}" if truncated else ""
            raise RecordError("no_supervised_tokens", f"no trained label{where}")

    def encode(self, conversation: Conversation, image_features=None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The text side of a sample, before truncation: (ids, trained mask, start of each image
        run). No pixels are read; the parity tests against NeMo's and LLaVA's goldens call this.
        ``image_features``: a dynamic run's features per image, in placeholder order."""
        return self._ids.encode(conversation, image_features)

    def _check_header(self, name: str) -> None:
        """What ``_load`` would refuse before decoding, from the file's header (its first bytes only):
        the file, a header PIL can read, the pixel budget and the crop's resize budget."""
        width, height = header_size_of(self.image_source, name)
        if width * height > self.max_image_pixels:
            raise RecordError("image_too_large", too_many_pixels(name, f"{width} x {height}", width * height, self.max_image_pixels))
        self.preprocessor.check_size((width, height), name)

    def _load(self, name: str) -> np.ndarray:
        image = decode_image(self.image_source.read(name), name, self.max_image_pixels, self.max_image_decode_seconds)
        self.preprocessor.check_size(image.size, name)
        return self.preprocessor.to_uint8(image)

    def _no_images(self) -> np.ndarray:
        return np.zeros((0, *self.preprocessor.shape), dtype=np.uint8)
