"""Native-resolution images (Qwen2-VL, Qwen2.5-VL): each image keeps (nearly) its own size.

    size --smart_resize--> (H, W), multiples of patch * merge       tokens = (H/patch)(W/patch) / merge^2
    RGB PIL --resize to (W, H)--> uint8 (3, H, W)                      in workers, stored
    uint8 --patchify, normalise--> float32 rows (H/p * W/p, 3 * t * p * p)   at read time

``smart_resize`` rounds each side to the nearest multiple of ``patch_size * merge_size`` with
Python's ``round`` (half to even: 70 / 28 = 2.5 -> 56), then, if the area leaves
[min_pixels, max_pixels], scales both sides by the same factor (floor above the maximum, ceil
below the minimum). Pixels are transformers' ``Qwen2VLImageProcessorPil`` (PIL resize, then its
float ops), bit-identical (tested over an image zoo): a still image is repeated
``temporal_patch_size`` times in every row, so the float rows cost 4 x 2 = 8 times the stored uint8
image. transformers is never imported.

On read, a pack's language model positions are multimodal rotary ids (mRoPE), three rows (temporal,
height, width). Text positions advance by one on all three rows. An image whose language-model grid
is h' x w' (``image_grid_thw`` h and w over the merge size), starting at text position ``st``, takes
(st, st + i, st + j) for its token at row i, column j, in row-major order; the text after it starts
at ``st + max(h', w')``. Every sample starts at 0, so the ids of a sample inside a pack are those of
the sample alone: what transformers' ``get_rope_index`` gives for it (Qwen2-VL and Qwen2.5-VL agree
for still images; tested against both); a sample's padding continues from its largest id + 1.

Two references for an image's size (``reference``, the command line's ``--image_reference``):

- "transformers" (default): the Hugging Face processor, as above, with the encoder's bounds.
- "qwen_vl_utils": Qwen's own ``qwen-vl-utils`` (0.0.14), whose ``fetch_image`` resizes the image with
  PIL before the processor (called with ``do_resize=False``, as Qwen3-VL's model card does; for
  Qwen2/2.5-VL the processor's own resize is then the identity). Its ``smart_resize`` takes each
  rounded side to at least one factor and does not hold a floored side at one factor; its bounds are
  4 and 16,384 tokens (``4 * factor**2`` .. ``16384 * factor**2`` pixels, factor ``2 * patch_size``:
  ``image_patch_size`` 14 for Qwen2/2.5-VL, 16 for Qwen3-VL), not the encoder's, replaced by
  ``--min_pixels`` / ``--max_pixels`` as a message's own ``min_pixels`` / ``max_pixels`` replace
  them; PIL's default filter (bicubic). Tokens, grid and pixels equal it (tests/families/
  test_native_references.py, golden data from the package). Not followed: its compositing of an RGBA
  image on white (every family here drops alpha, decode.py); a record carries no per-image bounds.
- "megatron_bridge": what Megatron Bridge's Qwen-VL task encoder gives the model (its collate at 067f987d,
  run; tests/golden/megatron_bridge): qwen-vl-utils' ``fetch_image`` called without ``image_patch_size``
  resizes with PIL to a multiple of 28 within its 4 .. 16,384 tokens of 28 x 28 (``BRIDGE_FIRST_RESIZE``,
  whatever the model's patch), then the processor resizes that again to its own factor (32 for Qwen3-VL)
  within Bridge's ``min_pixels`` / ``max_pixels`` (``BRIDGE_BOUNDS``, replaced by ``--min_pixels`` /
  ``--max_pixels``), with its torchvision backend (the one transformers 5 loads for these checkpoints):
  torchvision's bicubic antialiased resize of the uint8 image, rescale and normalise fused
  (``fused_normalisation``). A 480 x 320 image: 476 x 308, then 576 x 384 for Qwen3-VL (216 tokens, where
  the processor alone gives 150).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from PIL import Image

from neva_pack.core import ConfigError, Normalisation
from neva_pack.families.base import CLIP_MEAN, CLIP_STD, EncoderSpec, FamilyBase, FamilyOptions, Join, RunRequest, VideoPlan, VideoRequest, fused_normalisation, model_image_run, processor_normalisation, refuse_layout_options, run_starts
from neva_pack.families.headers import StoredImage, planar_uint8
from neva_pack.families.native_settings import NativeSettings, native_settings, settings_areas
from neva_pack.families.patch_grid import clip_patches, smart_resize, still_patches
from neva_pack.families.patch_grid import smart_resize_unheld as qwen_vl_utils_resize  # qwen-vl-utils' own variant
from neva_pack.families.settings_keys import MAX_AREA, MAX_PATCH, Setting, whole
from neva_pack.families.video_frames import (
    arange_indices, bounded_frame_count, duration_indices, fit_frame_area, linspace_indices, paired_times, paired_timestamps,
    patch_frame_count, rate_frame_count, stack_frames, temporal_smart_resize, torch_linspace_indices, unstack_frames, video_timestamp,
)  # fmt: skip

__all__ = ["REFERENCES", "VIDEO_PROFILES", "NativeProcessor", "NativeSettings", "NativeVideo", "mrope_position_ids", "qwen_vl_utils_resize",
           "smart_resize"]  # fmt: skip

REFERENCES = ("transformers", "qwen_vl_utils", "megatron_bridge")
"""Whose resize an image's size follows (the module's docstring)."""

BRIDGE_FIRST_RESIZE = (28, 4 * 28 * 28, 16384 * 28 * 28)
"""(factor, min_pixels, max_pixels) of Megatron Bridge's first resize: qwen-vl-utils' ``fetch_image`` as
its Qwen-VL collate calls it, without ``image_patch_size`` (14-pixel patches merged 2 x 2, whatever the
model's), within its default 4 .. 16,384 tokens."""
BRIDGE_BOUNDS = (200704, 1003520)
"""Megatron Bridge's ``QwenVLEnergonTaskEncoderConfig`` ``min_pixels`` / ``max_pixels`` defaults, which its
collate hands to the processor's (second) resize."""

QWEN_VL_UTILS_TOKENS = (4, 16384)
"""qwen-vl-utils' default bounds of an image, in tokens (its IMAGE_MIN_TOKEN_NUM, IMAGE_MAX_TOKEN_NUM):
``factor**2`` pixels each."""


def reference_settings(settings: NativeSettings, reference: str | None, *, min_pixels: int | None = None,
                       max_pixels: int | None = None) -> NativeSettings:  # fmt: skip
    """``settings`` for ``reference`` (None: transformers'): for qwen-vl-utils, its own bounds (the
    flags over them) and PIL's default filter; ConfigError for a reference this family does not know or
    a merge size qwen-vl-utils cannot make (it merges 2 x 2)."""
    reference = reference or "transformers"
    if reference not in REFERENCES:
        raise ConfigError(f"--image_reference {reference}: Qwen2-VL / Qwen2.5-VL / Qwen3-VL images follow one of {', '.join(REFERENCES)}")
    if reference == "transformers":
        return settings
    if reference == "megatron_bridge":  # the second resize is the processor's, with Bridge's bounds (the flags over them)
        low, high = min_pixels or BRIDGE_BOUNDS[0], max_pixels or BRIDGE_BOUNDS[1]
        if not 0 < low <= high:
            raise ConfigError(f"--min_pixels {low} / --max_pixels {high}: need 0 < min <= max")
        return dataclasses.replace(settings, min_pixels=low, max_pixels=high, resample=int(Image.Resampling.BICUBIC), reference=reference)
    if settings.merge_size != 2:
        raise ConfigError(f"--image_reference {reference}: it merges 2 x 2 patches, the encoder {settings.merge_size} x {settings.merge_size}")
    low, high = (tokens * settings.factor**2 for tokens in QWEN_VL_UTILS_TOKENS)
    low, high = min_pixels or low, max_pixels or high
    if not 0 < low <= high:
        raise ConfigError(f"--min_pixels {low} / --max_pixels {high}: need 0 < min <= max")
    return dataclasses.replace(settings, min_pixels=low, max_pixels=high, resample=int(Image.Resampling.BICUBIC), reference=reference)


class NativeProcessor(FamilyBase):
    """Qwen2-VL / Qwen2.5-VL images: token counts from sizes, uint8 in workers, model rows at read time."""

    family = "native"
    image_tokens = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    """(start, patch, end) of an image run as the models' tokenizers spell them: one ``<|image_pad|>``
    per merged patch between ``<|vision_start|>`` and ``<|vision_end|>``."""
    models = "Qwen2-VL / Qwen2.5-VL"
    option_names = ("arithmetic", "min_pixels", "max_pixels")
    """The family's own options (``--image_reference``, as ``arithmetic``; ``--min_pixels`` / ``--max_pixels``),
    as ``options`` records them."""
    references = REFERENCES
    batch_keys = {"pixel_values": Join.IMAGES, "image_grid_thw": Join.IMAGES, "pixel_values_videos": Join.IMAGES,
                  "video_grid_thw": Join.IMAGES, "second_per_grid_ts": Join.IMAGES}  # fmt: skip
    """Patch rows of every image end to end, and one (t, h, w) row per image; likewise for video clips
    (a family reading videos), with Qwen2.5-VL's seconds per temporal patch of each clip."""
    settings_patch_size = True
    """Its preprocessor_config.json names the patch size (a checkpoint's config.json may not)."""
    settings_keys = (
        Setting("size", "an object of shortest_edge and/or longest_edge, or min_pixels and/or max_pixels (areas in pixels)",
                lambda v: isinstance(v, dict) and bool(v) and (set(v) <= {"shortest_edge", "longest_edge"} or set(v) <= {"min_pixels", "max_pixels"})),
        whole("patch_size", 1, MAX_PATCH),
        whole("merge_size", 1, 8, " (patches merged per side: 2 in every release)"),
        whole("temporal_patch_size", 1, 8, " (frames per patch: 2 in every release)"),
        whole("min_pixels", 1, MAX_AREA),
        whole("max_pixels", 1, MAX_AREA),
    )  # fmt: skip
    """What the processor reads of a preprocessor_config.json beyond the common keys (settings_keys)."""

    @staticmethod
    def check_settings_file(settings: dict, processor: str, path) -> None:
        """The smallest area must be at most the largest, as the settings spell them."""
        low, high = settings_areas(settings)
        if low > high:
            raise ConfigError(f"{path}: min_pixels (or size) {low:,} > max_pixels (or size) {high:,}: need min <= max "
                              "(defaults 3,136 and 1,003,520)")

    def __init__(self, settings: NativeSettings, normalisation, encoder: EncoderSpec | None = None, video: NativeVideo | None = None):
        self.settings = settings
        self.normalisation = normalisation
        """core.Normalisation: the processor's rescale factor, mean and std."""
        self.encoder = encoder
        self.video = video
        """How video clips are read (``with_videos``); None: the family reads none."""

    @property
    def takes_videos(self) -> bool:
        return self.video is not None

    @classmethod
    def from_options(cls, encoder: EncoderSpec, options: FamilyOptions) -> NativeProcessor:
        """``--min_pixels`` / ``--max_pixels`` over the encoder's settings."""
        refuse_layout_options(encoder, options)
        return cls.from_encoder(encoder, arithmetic=options.reference, min_pixels=options.min_pixels, max_pixels=options.max_pixels)

    @classmethod
    def from_encoder(cls, encoder: EncoderSpec, *, arithmetic: str | None = None, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> NativeProcessor:  # fmt: skip
        """``arithmetic``: whose resize to follow (``REFERENCES``; None: transformers')."""
        normalisation = processor_normalisation(encoder, ("do_resize", "do_rescale", "do_normalize"), CLIP_MEAN, CLIP_STD)
        if arithmetic == "megatron_bridge":  # its processor's torchvision backend: rescale and normalise fused
            normalisation = fused_normalisation(encoder, CLIP_MEAN, CLIP_STD)
        bounds = {"min_pixels": min_pixels, "max_pixels": max_pixels} if arithmetic in (None, "transformers") else {}
        settings = native_settings(encoder, **bounds)  # qwen-vl-utils' bounds are its own, not the encoder's
        return cls(reference_settings(settings, arithmetic, min_pixels=min_pixels, max_pixels=max_pixels), normalisation, encoder)

    def options(self) -> dict:
        """Whose resize (``arithmetic``) and ``min_pixels`` / ``max_pixels`` as resolved (the flags, or the
        reference's bounds), and the video settings of a family reading videos."""
        options = {"arithmetic": self.settings.reference, "min_pixels": self.settings.min_pixels, "max_pixels": self.settings.max_pixels}
        if self.video is not None:
            options["video"] = self.video.to_json()
        return options

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        s = self.settings
        if s.reference == "megatron_bridge":
            height, width = qwen_vl_utils_resize(height, width, *BRIDGE_FIRST_RESIZE)
        resize = qwen_vl_utils_resize if s.reference == "qwen_vl_utils" else smart_resize
        return resize(height, width, s.factor, s.min_pixels, s.max_pixels)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The image's ``image_grid_thw`` row: (1, H / patch, W / patch)."""
        resized_height, resized_width = self.resized_size(width, height)
        return 1, resized_height // self.settings.patch_size, resized_width // self.settings.patch_size

    def tokens_for_size(self, width: int, height: int) -> int:
        """t * h * w / merge^2 language-model positions (one ``<|image_pad|>`` each)."""
        t, h, w = self.grid_thw(width, height)
        return t * h * w // self.settings.merge_size**2

    def pixels_for_size(self, width: int, height: int) -> int:
        """Pixels of the resized image (what a worker holds besides the decoded one)."""
        resized_height, resized_width = self.resized_size(width, height)
        return resized_height * resized_width

    def vision_cost_for_size(self, width: int, height: int) -> int:
        """The vision encoder's attention cost of the image: its patches, squared (one pass over them all)."""
        return (self.tokens_for_size(width, height) * self.settings.merge_size**2) ** 2

    def to_uint8(self, image: Image.Image) -> StoredImage:
        """RGB image -> the smart-resized uint8 (3, H, W) (PIL's resize, as the processor's; Megatron Bridge's
        reference: PIL's to the first size, then torchvision's to the second)."""
        width, height = image.size
        resized_height, resized_width = self.resized_size(width, height)
        if self.settings.reference == "megatron_bridge":
            first_height, first_width = qwen_vl_utils_resize(height, width, *BRIDGE_FIRST_RESIZE)
            first = planar_uint8(image.resize((first_width, first_height), resample=self.settings.resample))
            return StoredImage(size=(width, height), parts=(_torchvision_resize(first, (resized_height, resized_width)),),
                               tokens=self.tokens_for_size(width, height))  # fmt: skip
        resized = image.resize((resized_width, resized_height), resample=self.settings.resample)
        return StoredImage(size=(width, height), parts=(planar_uint8(resized),), tokens=self.tokens_for_size(width, height))

    def model_inputs(self, images: list[StoredImage]) -> dict[str, np.ndarray]:
        """``pixel_values`` float32 (sum of patches, 3 * t * p * p) and ``image_grid_thw`` int64 (n, 3),
        as transformers' processor returns them for these images in this order; for a family reading
        videos also ``pixel_values_videos`` / ``video_grid_thw`` of the clips among them, in their order
        (and Qwen2.5-VL's ``second_per_grid_ts``, float32 per clip).

        The uint8 pixels are put in row order first (a byte per value) and normalised straight into
        the rows: no float image in between, no strided copy of floats, no concatenation."""
        s = self.settings
        p, t = s.patch_size, s.temporal_patch_size
        stills = [image for image in images if not image.frames]
        clips = [image for image in images if image.frames]
        if clips and self.video is None:
            raise ValueError("a pack holds video clips, but the output's family reads none")
        grids = [(1, image.parts[0].shape[1] // p, image.parts[0].shape[2] // p) for image in stills]
        counts = [h * w for _, h, w in grids]
        pixel_values = np.empty((sum(counts), 3 * t * p * p), dtype=np.float32)
        start = 0
        for image, count in zip(stills, counts):
            rows = pixel_values[start : start + count].reshape(count, 3, t * p, p)
            self.normalisation.apply(still_patches(image.parts[0], p, s.merge_size, t).reshape(rows.shape), out=rows)
            start += count
        inputs = {"pixel_values": pixel_values, "image_grid_thw": np.array(grids, dtype=np.int64).reshape(-1, 3)}
        if self.video is not None:
            inputs.update(self._video_inputs(clips))
        return inputs

    def position_ids(self, tokens, cu_seqlens, real_lengths, num_images, inputs, patch_id) -> np.ndarray:
        """(3, L): each sample's mRoPE ids alone; its padding continues from its largest id + 1."""
        tokens = np.asarray(tokens, dtype=np.int64)
        bounds = np.asarray(cu_seqlens, dtype=np.int64)
        out = np.empty((3, int(bounds[-1])), dtype=np.int64)
        image_grids = iter(np.asarray(inputs["image_grid_thw"], dtype=np.int64).reshape(-1, 3).tolist())
        video_runs = iter(self._video_runs(inputs))
        video_pad = None if self.video is None else self.video.pad_id
        for k in range(len(bounds) - 1):
            start, end, length = int(bounds[k]), int(bounds[k + 1]), int(real_lengths[k])
            sample_tokens = tokens[start : start + length]
            image_mask = sample_tokens == patch_id
            video_mask = np.zeros_like(image_mask) if video_pad is None else sample_tokens == video_pad
            grids, intervals = [], []
            for first in run_starts(image_mask | video_mask):
                grid, interval = (next(video_runs, None) if video_mask[first] else (next(image_grids, None), 1.0)) or (None, 1.0)
                if grid is None:
                    raise ValueError(f"more {'video' if video_mask[first] else 'image'} token runs than grids")
                grids.append(grid)
                intervals.append(interval)
            sample = mrope_position_ids(image_mask | video_mask, np.array(grids, dtype=np.int64).reshape(-1, 3),
                                        self.settings.merge_size, time_intervals=intervals)  # fmt: skip
            out[:, start : start + length] = sample
            following = int(sample.max(initial=-1)) + 1
            out[:, start + length : end] = np.arange(following, following + end - start - length)
        return out

    # ------------------------------------------------------------ video clips

    def with_videos(self, request: VideoRequest, tokenizer) -> NativeProcessor:
        """The family reading video clips as ``request`` asks (``NativeVideo.resolve``)."""
        video = NativeVideo.resolve(self.encoder, self.settings, request, tokenizer)
        return NativeProcessor(self.settings, self.normalisation, self.encoder, video)

    def with_video_record(self, record: dict | None) -> NativeProcessor:
        """The family with the video settings an output recorded (``options()["video"]``)."""
        if record is None:
            return self
        return NativeProcessor(self.settings, self.normalisation, self.encoder, NativeVideo.from_json(record))

    def plan_video(self, frame_count: int, fps: float, width: int, height: int, tokenizer, *, duration_s: float | None = None) -> VideoPlan:
        """The clip's frames, frame size, run and cost, as the profile's reference lays it out."""
        v, s = self.video, self.settings
        if v is None:
            raise ValueError(f"{self.models}: this run reads no video")
        tps, factor, lf = s.temporal_patch_size, s.factor, v.profile == "llamafactory"
        if lf:  # LLaMA-Factory 0.9.5's Qwen2/3-VL plugins: by the stream's duration, each frame fitted to an area, frames made even
            indices = duration_indices(frame_count, duration_s, v.fps, v.max_frames)
            width, height = fit_frame_area(width, height, *_LLAMAFACTORY_FRAME_AREA)
            even, seconds = len(indices) + len(indices) % 2, tps / (len(indices) / duration_s) if v.timing == "seconds" else 0.0
            height_out, width_out = (smart_resize(height, width, factor, v.min_pixels, v.max_pixels) if v.timing == "seconds" else
                                     temporal_smart_resize(even, height, width, tps, factor, v.min_pixels, v.max_pixels))  # fmt: skip
        elif v.profile == "qwen_vl_utils":  # qwen-vl-utils 0.0.14's fetch_video: frames, then a per-frame budget
            count = rate_frame_count(frame_count, fps, v.fps, v.min_frames, v.max_frames, tps)
            indices = torch_linspace_indices(frame_count, count)
            most = max(min(v.max_pixels, v.max_video_tokens * factor * factor * 0.9 / count * tps), int(v.min_pixels * 1.05))
            height_out, width_out = qwen_vl_utils_resize(height, width, factor, v.min_pixels, most)
            seconds = tps / (count / max(frame_count, 1e-6) * fps) if v.timing == "seconds" else 0.0
        elif v.timing == "seconds":  # transformers' Qwen2VLVideoProcessor (Qwen2.5-VL)
            count = patch_frame_count(frame_count, fps, v.fps, v.min_frames, v.max_frames, tps)
            indices = arange_indices(frame_count, count)
            most = v.max_pixels
            if v.cap_pixels_per_frame:
                most = max(min(most, int(v.max_video_tokens * factor * factor * 0.9) * tps // len(indices)), int(v.min_pixels * 1.05))
            height_out, width_out = smart_resize(height, width, factor, v.min_pixels, most)
            seconds = tps / (len(indices) / frame_count * fps)
        else:  # transformers' Qwen3VLVideoProcessor
            count = bounded_frame_count(frame_count, fps, v.fps, v.min_frames, v.max_frames)
            indices = linspace_indices(frame_count, count)
            most = v.max_pixels
            if v.cap_pixels_per_frame:
                most = max(min(v.max_video_tokens * factor * factor, v.max_pixels // count), int(v.min_pixels * 1.05)) * count
            height_out, width_out = temporal_smart_resize(count, height, width, tps, factor, v.min_pixels, most)
            seconds = 0.0
        grid_t = -(-len(indices) // tps)
        grid_h, grid_w = height_out // s.patch_size, width_out // s.patch_size
        frame_tokens = grid_h * grid_w // s.merge_size**2
        pads = np.full(frame_tokens, v.pad_id, dtype=np.int64)
        if v.timing == "seconds":
            ids = np.concatenate([[v.start_id], np.tile(pads, grid_t), [v.end_id]])
        else:  # LLaMA-Factory: each stamp from the index rescaled to its fps (it writes no start and end around the clip: docs/video.md)
            stamps = paired_times([i / fps * v.fps for i in indices], v.fps, s.merge_size) if lf else paired_timestamps(indices, fps, tps)
            runs = [part for stamp in stamps for part in (tokenizer.encode_literal(video_timestamp(stamp)).ids, [v.start_id], pads, [v.end_id])]
            ids = np.concatenate([[v.start_id], *runs, [v.end_id]])
        return VideoPlan(indices=tuple(int(i) for i in indices), size=(height_out, width_out), tokens=grid_t * frame_tokens,
                         ids=ids.astype(np.int64), grid_seconds=seconds, cost=grid_t * (grid_h * grid_w) ** 2,
                         resize="v1" if v.profile == "qwen_vl_utils" else "v2")  # fmt: skip

    def video_to_stored(self, frames: np.ndarray, plan: VideoPlan, size: tuple[int, int]) -> StoredImage:
        """uint8 (T, 3, h, w) -> one part (3, T h, w), the frames top to bottom (core.StoredImage)."""
        part = stack_frames(frames)
        return StoredImage(size=tuple(size), parts=(part,), tokens=plan.tokens, frames=len(frames), grid_seconds=plan.grid_seconds)

    def _video_inputs(self, clips: list[StoredImage]) -> dict[str, np.ndarray]:
        """``pixel_values_videos`` float32 (sum of patches, 3 t p p), ``video_grid_thw`` int64 (n, 3) and,
        for Qwen2.5-VL, ``second_per_grid_ts`` float32 (n,): the video processor's, clip by clip."""
        s = self.settings
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        grids, blocks = [], []
        for clip in clips:
            block, grid = clip_patches(unstack_frames(clip.parts[0], clip.frames, t), p, m, t)
            blocks.append(block)
            grids.append(grid)
        rows = np.concatenate(blocks) if blocks else np.zeros((0, 3, t * p, p), dtype=np.uint8)
        values = self.video.normalisation.apply(rows).reshape(len(rows), 3 * t * p * p)
        inputs = {"pixel_values_videos": values, "video_grid_thw": np.array(grids, dtype=np.int64).reshape(-1, 3)}
        if self.video.timing == "seconds":
            inputs["second_per_grid_ts"] = np.array([clip.grid_seconds for clip in clips], dtype=np.float32)
        return inputs

    def _video_runs(self, inputs: dict) -> list[tuple[tuple[int, int, int], float]]:
        """(grid, temporal interval) of each run of video pads, in order: Qwen2.5-VL one run per clip,
        its temporal positions ``tokens_per_second x second_per_grid_ts`` apart (float32, truncated,
        as ``get_rope_index``); Qwen3-VL one run per temporal patch, each a grid of one."""
        if self.video is None:
            return []
        grids = np.asarray(inputs["video_grid_thw"], dtype=np.int64).reshape(-1, 3).tolist()
        if self.video.timing == "timestamps":
            return [((1, h, w), 1.0) for t, h, w in grids for _ in range(t)]
        seconds = np.asarray(inputs["second_per_grid_ts"], dtype=np.float32)
        return [(tuple(grid), float(np.float32(self.video.tokens_per_second) * second)) for grid, second in zip(grids, seconds)]


def _torchvision_resize(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 (3, H, W) -> uint8 (3, h, w): torchvision's bicubic, antialiased resize of the uint8 tensor, as
    transformers' torchvision image processors resize (``transforms.v2.functional``)."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional

    resized = functional.resize(torch.from_numpy(pixels), list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)
    return np.ascontiguousarray(resized.numpy())


VIDEO_PROFILES = ("hf", "hf_cap", "qwen_vl_utils", "llamafactory")
"""Whose arithmetic samples and sizes the clips: ``hf``, transformers' video processors; ``hf_cap``, the
same with ``cap_pixels_per_frame`` on (each frame's share of the whole-clip budget); ``qwen_vl_utils``,
Qwen's own ``fetch_video`` (0.0.14: 2 fps, frames a multiple of 2, 128..768 tokens a frame within a
whole-clip budget of 128,000 x 0.9 tokens), whose frames the processor then takes as they are; ``llamafactory``,
LLaMA-Factory 0.9.5's (``video_fps`` 2 over the stream's duration, at most ``video_maxlen`` 128; each frame fitted to 256 x 256 first)."""
_LLAMAFACTORY_FRAME_AREA = (256 * 256, 16 * 16, 28, 200, 180)  # video_max/min_pixels' defaults; least side, most ratio, cut to


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeVideo:
    """How a native-resolution family reads video clips: the profile's numbers and the run's ids."""

    profile: str
    timing: str
    """"seconds" (Qwen2.5-VL: ``second_per_grid_ts``) or "timestamps" (Qwen3-VL: text before each temporal patch)."""
    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    """Smallest area: of a frame ("seconds"), of all frames together ("timestamps")."""
    max_pixels: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    tokens_per_second: int
    """Qwen2.5-VL's ``vision_config.tokens_per_second``: temporal positions per second of video."""
    pad_id: int
    start_id: int
    end_id: int
    normalisation: Normalisation
    """The video processor's fused rescale and normalise: ``(v - 255 mean) / (255 std)`` in float32."""

    @classmethod
    def resolve(cls, encoder: EncoderSpec, settings: NativeSettings, request: VideoRequest, tokenizer) -> NativeVideo:
        """The settings transformers' video processor of ``encoder`` uses (module docstring), the
        request's fps / max frames / cap over them, the ids from ``tokenizer``."""
        if request.profile not in VIDEO_PROFILES:
            raise ConfigError(f"--video_profile {request.profile!r}: one of {', '.join(VIDEO_PROFILES)}")
        kind = encoder.preprocessor_config.get("processor_class", "")
        if kind == "Qwen3VLProcessor":
            timing, (low, high), tokens = "timestamps", _QWEN3_VIDEO_SIZE, 768
        elif kind == "Qwen2_5_VLProcessor":
            timing, (low, high), tokens = "seconds", (settings.min_pixels, settings.max_pixels), 128000
        else:
            raise ConfigError(f"video clips: {encoder.name} ({kind or 'no processor_class'}) is not a Qwen2.5-VL or Qwen3-VL encoder")
        if request.profile == "qwen_vl_utils":  # VIDEO_MIN/MAX_TOKEN_NUM and MODEL_SEQ_LEN, in pixels of the factor
            (low, high), tokens = (128 * settings.factor**2, 768 * settings.factor**2), 128000
        run = model_image_run(tokenizer, ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>"), "Qwen2.5-VL / Qwen3-VL", RunRequest())
        start, pad, end = run.start_id, run.patch_id, run.end_id
        return cls(
            profile=request.profile, timing=timing, fps=float(request.fps or 2.0), min_frames=4,
            max_frames=int(request.max_frames or (128 if request.profile == "llamafactory" else 768)), min_pixels=int(low), max_pixels=int(high),
            cap_pixels_per_frame=bool(request.cap_pixels_per_frame) or request.profile == "hf_cap", max_video_tokens=tokens,
            tokens_per_second=int(encoder.model_config.get("tokens_per_second", 2)), pad_id=pad, start_id=start, end_id=end,
            normalisation=fused_normalisation(encoder, CLIP_MEAN, CLIP_STD),
        )  # fmt: skip

    def to_json(self) -> dict:
        values = {name: getattr(self, name) for name in self.__slots__ if name != "normalisation"}
        return {**values, "normalisation": self.normalisation.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> NativeVideo:
        return cls(**{**data, "normalisation": Normalisation.from_json(data["normalisation"])})


_QWEN3_VIDEO_SIZE = (4096, 25165824)
"""The released Qwen3-VL video_preprocessor_config.json's ``size`` (shortest_edge, longest_edge): a
pixel budget for all the sampled frames of a clip together."""


def mrope_position_ids(image_mask: np.ndarray, image_grid_thw: np.ndarray, merge_size: int = 2, *, time_intervals=None) -> np.ndarray:
    """int64 (3, L) mRoPE position ids of one sample (the module's docstring).

    ``image_mask``: bool (L,), True where the token is an image placeholder (``<|image_pad|>``, or a
    clip's ``<|video_pad|>``); each maximal run of them is one image (or clip, or temporal patch), in
    order. ``image_grid_thw``: int (n, 3), one row per run. ``time_intervals``: per run, the temporal
    spacing of its patches (float32 arithmetic, truncated, as ``get_rope_index``); None: 1 each.
    ValueError when the runs and the grids disagree (count or length): the positions would silently
    be those of other images.
    """
    mask = np.asarray(image_mask, dtype=bool).reshape(-1)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(grids):
        raise ValueError(f"{len(starts)} image token runs but {len(grids)} image_grid_thw rows")
    intervals = [1.0] * len(grids) if time_intervals is None else list(time_intervals)
    out = np.empty((3, mask.size), dtype=np.int64)
    position = 0  # the next text position
    cursor = 0  # the next token index
    for (t, h, w), interval, start, end in zip(grids.tolist(), intervals, starts.tolist(), ends.tolist()):
        rows, columns = h // merge_size, w // merge_size
        if end - start != t * rows * columns:
            raise ValueError(f"an image token run of {end - start} tokens at {start}, but its grid {t} x {h} x {w} makes {t * rows * columns}")
        out[:, cursor:start] = np.arange(position, position + start - cursor)
        position += start - cursor
        times = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        temporal, row, column = np.meshgrid(times, np.arange(rows), np.arange(columns), indexing="ij")
        out[0, start:end] = temporal.reshape(-1) + position
        out[1, start:end] = row.reshape(-1) + position
        out[2, start:end] = column.reshape(-1) + position
        position += max(rows, columns)
        cursor = end
    out[:, cursor:] = np.arange(position, position + mask.size - cursor)
    return out
