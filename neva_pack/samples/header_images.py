"""A sample's images in a dynamic-resolution family: counted from their headers, decoded after.

An image's run length (its token count) is a function of its size, and the size is in the file's
header, so the sample builder lays out a sample's ids (and truncates them) before any pixel is
decoded; only the images that survive truncation are then decoded, from the same bytes, and each
must have the size its header announced (else its count, and the plan made from it, would be wrong).
A plan, which decodes nothing, reads each file's header only (``header_size_of``).

Some families count and store the images of a sample of several images differently (OneVision: no
tiles, one square image, base features + one newline; InternVL's own fine-tuning: the tile budget
shared among them), so an image's count depends on how many images its sample keeps: ``counted`` is
told.

A video clip is planned the same way from its container's header (frame count, fps, size: files'
``read_video_header``, nothing decoded): the family chooses its frames, their size and its run of ids
(``ModelFamily.plan_video``); only the clips kept are decoded, once, and only their chosen frames.
"""

from __future__ import annotations

from dataclasses import dataclass

from neva_pack.families import (
    DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, ImageSource, ModelFamily, StoredImage, VideoPlan,
    check_decoded_size, decode_frames, decode_image, header_size, too_many_pixels
)
from neva_pack.files import VideoHeaderError, read_video_header
from neva_pack.records import VIDEOS_NOT_READ, RecordError

__all__ = ["HeaderImage", "HeaderImages", "header_size_of"]


def header_size_of(source: ImageSource, name: str) -> tuple[int, int]:
    """(width, height) of a source's image from the first bytes of its file only (PIL reads as far as
    the header goes), with ``ImageSource.read``'s skips for the file itself. A header PIL cannot read
    this way is read again from the whole file, so the skip it makes is the one a build reports (the
    same bytes, the same detail)."""
    with source.open(name) as file:
        try:
            return header_size(file, name)
        except RecordError:
            pass
    return header_size(source.read(name), name)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderImage:
    """One image of a record, read but not decoded."""

    name: str
    """The record's name for it."""
    data: bytes | None
    """The file's bytes, read once (the header's size and the decode both come from them); None when
    read for a plan (its header only: never decoded)."""
    size: tuple[int, int]
    """(width, height) from the header."""
    tokens: int
    """Image features in the language model (the run's patch ids)."""
    sample_images: int
    """The images of its sample it was counted with (1: alone, or a family whose counts do not depend
    on it: ``ModelFamily.counts_images_per_sample``)."""
    video: VideoPlan | None = None
    """A video clip's plan (its frames, size and run of ids); None for a still image."""


class HeaderImages:
    """Reads, counts and later decodes a sample's images for a dynamic-resolution processor."""

    def __init__(
        self,
        processor: ModelFamily,
        image_source: ImageSource,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_image_decode_seconds: float = DEFAULT_MAX_IMAGE_DECODE_SECONDS,
        tokenizer=None,
    ):
        """``tokenizer``: what spells a video clip's run (its timestamp text, where the model has one)."""
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_source = image_source
        self.max_image_pixels = max_image_pixels
        self.max_image_decode_seconds = max_image_decode_seconds
        self._per_sample = processor.counts_images_per_sample

    def read(self, names: tuple[str, ...] | list[str], header_only: bool = False, video_slots=()) -> list[HeaderImage]:
        """Each image's bytes and header size, checked against the pixel budget, and its count (no
        decode); ``header_only``: the header's bytes only, for a plan (the image cannot be loaded).
        ``video_slots``: which of ``names`` are video clips (``_video``)."""
        sample_images = len(names) if self._per_sample else 1
        images = []
        for k, name in enumerate(names):
            if k in video_slots:
                images.append(self._video(name, header_only))
                continue
            if header_only:
                data, size = None, header_size_of(self.image_source, name)
            else:
                data = self.image_source.read(name)
                size = header_size(data, name)
            images.append(self._counted(name, data, size, sample_images))
        return images

    def counted(self, image: HeaderImage, sample_images: int) -> HeaderImage:
        """The image counted as one of ``sample_images`` images of its sample (a clip: as it is)."""
        if image.video is not None:
            return image
        sample_images = sample_images if self._per_sample else 1
        return image if sample_images == image.sample_images else self._counted(image.name, image.data, image.size, sample_images)

    def _counted(self, name: str, data: bytes | None, size: tuple[int, int], sample_images: int) -> HeaderImage:
        width, height = size
        if width * height > self.max_image_pixels:
            raise RecordError("image_too_large", too_many_pixels(name, f"{width} x {height}", width * height, self.max_image_pixels))
        options = _per_sample(sample_images)
        try:
            pixels = self.processor.pixels_for_size(width, height, **options)
            tokens = self.processor.tokens_for_size(width, height, **options)
        except ValueError as exc:  # smart_resize refuses an aspect ratio over 200, as the reference does
            raise RecordError("unreadable_image", f"{name}: {exc}") from None
        if pixels > self.max_image_pixels:
            what = f"{width} x {height} resized"
            raise RecordError("image_too_large", too_many_pixels(name, what, pixels, self.max_image_pixels))
        return HeaderImage(name=name, data=data, size=size, tokens=tokens, sample_images=sample_images)

    def _video(self, name: str, header_only: bool) -> HeaderImage:
        """A clip's header read and planned by the family: skipped when the family reads no video, the
        header is refused (its own reason), it announces frames a decode would not give, the clip is
        one the reference refuses, or a resized frame exceeds the pixel budget."""
        if not self.processor.takes_videos:
            raise RecordError(VIDEOS_NOT_READ, f"{name}: a video clip, and {self.processor.models} (as this run reads it) reads none")
        data = self.image_source.read(name)
        try:
            header = read_video_header(data, max_pixels=self.max_image_pixels)
        except VideoHeaderError as exc:
            raise RecordError(exc.reason, f"{name}: {exc}") from None
        if header.frames_disagree:
            raise RecordError("video_frames_mismatch", f"{name}: its header declares {header.frame_count} frames, "
                                                       f"a decoder presents {header.presented_frames}")  # fmt: skip
        try:
            stream_s = header.duration_s if header.container == "mp4" else None  # FFmpeg gives a Matroska stream no duration
            plan = self.processor.plan_video(header.frame_count, header.fps, header.width, header.height, self.tokenizer, duration_s=stream_s)
        except ValueError as exc:
            raise RecordError("unreadable_video", f"{name}: {exc}") from None
        if plan.size[0] * plan.size[1] > self.max_image_pixels:
            raise RecordError("image_too_large", too_many_pixels(name, "a frame resized", plan.size[0] * plan.size[1], self.max_image_pixels))
        return HeaderImage(name=name, data=None if header_only else data, size=(header.width, header.height), tokens=plan.tokens,
                           sample_images=1, video=plan)  # fmt: skip

    def load(self, image: HeaderImage) -> StoredImage:
        """Decode the image's bytes (decode_image's budgets), check the size against the header's, and
        make its stored uint8 parts; a clip's chosen frames decoded and resized (``decode_frames``)."""
        if image.data is None:
            raise ValueError(f"{image.name}: read for its header only, it cannot be decoded")
        if image.video is not None:
            plan = image.video
            frames = decode_frames(image.data, plan.indices, plan.size, name=image.name, max_seconds=self.max_image_decode_seconds,
                                   resize_api=plan.resize, declared=image.size)  # fmt: skip
            return self.processor.video_to_stored(frames, plan, image.size)
        decoded = decode_image(image.data, image.name, self.max_image_pixels, self.max_image_decode_seconds)
        check_decoded_size(decoded, image.size, image.name)
        return self.processor.to_uint8(decoded, **_per_sample(image.sample_images))

    def vision_cost(self, image: HeaderImage) -> int:
        """The vision encoder's cost of the image (patches² per encoder pass; a clip's, summed over its passes)."""
        if image.video is not None:
            return image.video.cost
        return self.processor.vision_cost_for_size(*image.size, **_per_sample(image.sample_images))


def _per_sample(sample_images: int) -> dict:
    """The keyword a family counting per sample takes, only when the sample holds several images (so that
    the families that do not take it are never given it)."""
    return {"sample_images": sample_images} if sample_images > 1 else {}
