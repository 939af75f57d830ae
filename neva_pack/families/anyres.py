"""LLaVA-NeXT (v1.6) and LLaVA-OneVision "anyres" images: a base image plus tiles of a grid.

    size --select_best_resolution--> grid (H, W) among the pinpoints
    RGB PIL --resize into (H, W), aspect kept--> uint8 (3, h, w)       in workers, stored
            --resize to the tile-------------> uint8 (3, S, S)         (the base image), stored
    stored --pad to (H, W) with 0, cut S x S tiles, normalise--> float32 (1 + tiles, 3, S, S)

The language model sees the base image's features, then the tiles' features laid out as the
grid, "unpadded" back to the image's aspect ratio, one newline feature closing each row
(OneVision's ``anyres_max_9`` first pools a grid of more than ~9 tiles' worth by bilinear
interpolation). The count is arithmetic on the size; two references disagree on it:

- transformers (``LlavaNextProcessor._get_number_of_features`` and OneVision's) rounds the
  unpadded side to 7 digits before ``int``; LLaVA's own ``llava_arch.unpad_image`` truncates
  (``int``), and reads the pinpoints as (width, height) where transformers reads (height, width).
  They disagree on a handful of sizes (88 x 99: 1,272 vs 1,224 tokens). ``arithmetic`` names the
  one to follow: "transformers" (the default: the HF models) or "llava" (LLaVA's training code).

Pixels are transformers' PIL processors' (``LlavaNextImageProcessorPil``,
``LlavaOnevisionImageProcessorPil``), bit-identical (tested over an image zoo); the tiles they
resize again to the tile size and centre-crop are already that size, which PIL returns unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

from neva_pack.core import ConfigError
from neva_pack.families.base import EncoderSpec, FamilyBase, FamilyOptions, Join, processor_normalisation, refuse_layout_options
from neva_pack.families.headers import StoredImage, planar_uint8
from neva_pack.families.fixed import expand_to_square
from neva_pack.families.settings_keys import MAX_SIDE, Setting, check_keys, choice, is_int, whole

__all__ = ["ARITHMETICS", "AnyresProcessor", "AnyresSettings", "anyres_settings", "select_best_resolution"]

ARITHMETICS = ("transformers", "llava")
"""Whose token arithmetic to follow (see the module's docstring)."""


MAX_PINPOINTS = 1024
"""Most grid resolutions a settings file may list (OneVision lists 36), and most tiles of
``anyres_max_N``."""

MAX_GRID_SIDE = 1 << 14
"""Most pixels on a side of a grid resolution (OneVision's largest: 2,304)."""

_TILE_SIDE = f"an object of one square tile's side: height and width (equal) or shortest_edge, 1 to {MAX_SIDE:,} pixels"


def _tile_side(value, keys: tuple[str, ...]) -> bool:
    """A size that names one square tile's side, as anyres_settings reads it."""
    if not isinstance(value, dict) or not any(key in value for key in keys):
        return False
    sides = [value[key] for key in ("height", "width", "shortest_edge") if key in value]
    return all(is_int(side) and 0 < side <= MAX_SIDE for side in sides) and len(set(sides)) == 1


def _pinpoint(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(is_int(side) and 0 < side <= MAX_GRID_SIDE for side in value)


@dataclass(frozen=True, slots=True, kw_only=True)
class AnyresSettings:
    """The numbers that decide an anyres image's grid, tokens and pixels."""

    tile: int
    """Side of a tile and of the base image in pixels (336 for v1.6, 384 for OneVision)."""
    pinpoints: tuple[tuple[int, int], ...]
    """Grid resolutions (height, width) as transformers reads ``image_grid_pinpoints``."""
    features_per_side: int
    """Features per tile side in the language model (336 / 14 = 24; OneVision 27)."""
    base_tokens: int
    """Positions of the base image's features (576 for v1.6: 577 with CLS, less the CLS that the
    "default" feature selection drops; OneVision 729)."""
    max_num_patches: int | None
    """OneVision's ``anyres_max_N``: an unpadded grid over 1.1 x sqrt(N) tiles' side is pooled; None for v1.6."""
    resample: int
    """PIL resampling filter (3, bicubic)."""
    square_colour: tuple[int, int, int] | None
    """OneVision only: the mean colour a multi-image sample's image is padded to a square with."""


def anyres_settings(encoder: EncoderSpec) -> AnyresSettings:
    """The settings of a LLaVA-NeXT / OneVision encoder (preprocessor_config + the model's numbers)."""
    cfg, model = encoder.preprocessor_config, encoder.model_config
    size = cfg.get("size") or {}
    crop = cfg.get("crop_size") or {}
    tile = int(crop.get("height") or size.get("height") or size.get("shortest_edge") or 0)
    if not tile or (encoder.processor == "llava_next" and size.get("shortest_edge") not in (None, tile)):
        raise ConfigError(f"--hf_vision_encoder {encoder.name}: anyres needs size (and crop_size) of one square tile side")
    pinpoints = tuple((int(h), int(w)) for h, w in cfg.get("image_grid_pinpoints") or ())
    if not pinpoints or any(h % tile or w % tile for h, w in pinpoints):
        raise ConfigError(f"--hf_vision_encoder {encoder.name}: image_grid_pinpoints must be multiples of the tile {tile}")
    strategy = model.get("vision_feature_select_strategy", "default")
    if encoder.processor == "llava_onevision":
        base = int(model.get("num_image_tokens", (tile // encoder.patch_size) ** 2))
        per_side = math.isqrt(base)
        if per_side < 1:
            raise ConfigError(f"--hf_vision_encoder {encoder.name}: a tile of {tile} pixels is less than a patch ({encoder.patch_size})")
        found = re.fullmatch(r"anyres_max_(\d+)", str(model.get("vision_aspect_ratio", "anyres_max_9")))
        if found is None:
            raise ConfigError(f"--hf_vision_encoder {encoder.name}: vision_aspect_ratio must be anyres_max_N")
        max_num_patches = int(found[1])
        mean = cfg.get("image_mean", (0.5, 0.5, 0.5))
        square_colour = tuple(int(channel * 255) for channel in mean)
    else:
        per_side = int(model.get("image_size", tile)) // encoder.patch_size
        if per_side < 1:
            raise ConfigError(f"--hf_vision_encoder {encoder.name}: image_size {model.get('image_size', tile)} is less than a patch ({encoder.patch_size})")
        base = per_side * per_side + int(model.get("num_additional_image_tokens", 0))
        max_num_patches, square_colour = None, None
    return AnyresSettings(
        tile=tile,
        pinpoints=pinpoints,
        features_per_side=per_side,
        base_tokens=base - (strategy == "default"),
        max_num_patches=max_num_patches,
        resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
        square_colour=square_colour,
    )


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) pinpoint that keeps the most of the image's pixels once it is scaled to
    fit, then wastes the least; the first such in the list on a tie (as transformers and LLaVA)."""
    best, most_kept, least_wasted = None, 0, math.inf
    for target_height, target_width in pinpoints:
        scale = min(target_width / width, target_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_width * target_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (target_height, target_width), kept, wasted
    return best


class _PinpointOrder:
    """``select_best_resolution`` over one list of pinpoints, the same answer in fewer steps (a
    header's token count is mostly this choice: OneVision has 36 pinpoints).

    The reference picks the least (-kept, wasted, list index). A pinpoint the image fits in
    (both sides at least the image's) keeps every pixel, and any other keeps fewer (a side below the
    image's scales it by less than 1 - 1/side), so when one fits the answer is the fitting pinpoint
    of least area, first in the list on a tie. Otherwise pinpoints are tried by decreasing area:
    one keeps at most its area, so once the areas left are below the most kept, none can win."""

    def __init__(self, pinpoints: tuple[tuple[int, int], ...]):
        indexed = [(h * w, k, h, w) for k, (h, w) in enumerate(pinpoints)]
        self.by_area = [(h, w) for _, _, h, w in sorted(indexed)]
        self.by_decreasing_area = [(area, k, h, w) for area, k, h, w in sorted(indexed, key=lambda p: (-p[0], p[1]))]

    def best(self, height: int, width: int) -> tuple[int, int]:
        for target_height, target_width in self.by_area:
            if target_height >= height and target_width >= width:
                return target_height, target_width
        best, best_key = None, None
        for area, k, target_height, target_width in self.by_decreasing_area:
            if best_key is not None and area < -best_key[0]:
                break
            scale = min(target_width / width, target_height / height)
            kept = min(int(width * scale) * int(height * scale), width * height)
            key = (-kept, area - kept, k)
            if best_key is None or key < best_key:
                best, best_key = (target_height, target_width), key
        return best


class AnyresProcessor(FamilyBase):
    """LLaVA-NeXT / OneVision images: token counts from sizes, uint8 in workers, model tiles at read time."""

    family = "anyres"
    image_tokens = (None, "<image>", None)
    """(start, patch, end) of an image run as transformers' models spell it: one ``<image>`` per feature."""
    models = "LLaVA-NeXT / OneVision"
    option_names = ("arithmetic",)
    """The family's own option (``--tokenization llava`` picks LLaVA's arithmetic), as ``options`` records it."""
    batch_keys = {"pixel_values": Join.IMAGES, "image_sizes": Join.IMAGES, "batch_num_images": Join.SAMPLES}
    """Each image's tiles (padded to the batch's most), its (height, width), and (OneVision only)
    each sample's image count, which tells its model which images are tiled."""

    settings_keys = (
        Setting("size", _TILE_SIDE, lambda v: _tile_side(v, ("height", "shortest_edge"))),
        Setting("crop_size", _TILE_SIDE, lambda v: _tile_side(v, ("height",))),
        Setting("image_grid_pinpoints", f"a list of 1 to {MAX_PINPOINTS} [height, width] pairs of 1 to {MAX_GRID_SIDE:,} pixels",
                lambda v: isinstance(v, list) and 0 < len(v) <= MAX_PINPOINTS and all(map(_pinpoint, v))),
    )  # fmt: skip
    """What the processor reads of a preprocessor_config.json beyond the common keys (settings_keys)."""
    model_keys = (
        whole("image_size", 1, MAX_SIDE, " (the vision tower's input side)"),
        choice("vision_feature_select_strategy", ("default", "full")),
        whole("num_additional_image_tokens", 0, 16, " (a CLS token: 1)"),
        Setting("num_image_tokens", "a square integer from 1 to 65,536 (a base image's features, 27 x 27 = 729)",
                lambda v: is_int(v) and 0 < v <= 1 << 16 and math.isqrt(v) ** 2 == v),
        Setting("vision_aspect_ratio", f"anyres_max_N, N from 1 to {MAX_PINPOINTS}",
                lambda v: isinstance(v, str) and (found := re.fullmatch(r"anyres_max_([1-9]\d{0,3})", v)) is not None
                and int(found[1]) <= MAX_PINPOINTS),
    )  # fmt: skip
    """What the token arithmetic reads of a checkpoint's config.json and processor_config.json."""

    def __init__(self, settings: AnyresSettings, normalisation, *, arithmetic: str = "transformers"):
        if arithmetic not in ARITHMETICS:
            raise ConfigError(f"anyres arithmetic {arithmetic!r}: choose one of {', '.join(ARITHMETICS)}")
        self.settings = settings
        self.normalisation = normalisation
        """core.Normalisation: the processor's rescale factor, mean and std."""
        self.arithmetic = arithmetic
        self._pinpoints = _PinpointOrder(settings.pinpoints)

    @staticmethod
    def model_settings(directory, model_config: dict, read) -> dict:
        """The anyres token arithmetic's settings from a checkpoint directory's config.json and
        processor_config.json (the latter wins, as when transformers builds the processor)."""
        processor_file = directory / "processor_config.json"
        processor_config = read(processor_file) if processor_file.exists() else {}
        vision = model_config.get("vision_config") or {}
        found = {
            "image_size": vision.get("image_size"),
            "vision_feature_select_strategy": model_config.get("vision_feature_select_strategy"),
            "vision_aspect_ratio": model_config.get("vision_aspect_ratio"),
        }
        check_keys({key: value for key, value in found.items() if value is not None}, directory / "config.json", AnyresProcessor.model_keys)
        check_keys(processor_config, processor_file, AnyresProcessor.model_keys)
        for key in ("vision_feature_select_strategy", "num_additional_image_tokens", "num_image_tokens", "vision_aspect_ratio"):
            if key in processor_config:
                found[key] = processor_config[key]
        return {key: value for key, value in found.items() if value is not None}

    @classmethod
    def from_options(cls, encoder: EncoderSpec, options: FamilyOptions) -> AnyresProcessor:
        """LLaVA's own arithmetic under ``--tokenization llava`` (its llava_arch counts), else the HF models'."""
        refuse_layout_options(encoder, options)
        return cls.from_encoder(encoder, arithmetic="llava" if options.tokenization == "llava" else "transformers")

    @classmethod
    def from_encoder(cls, encoder: EncoderSpec, *, arithmetic: str = "transformers") -> AnyresProcessor:
        normalisation = processor_normalisation(encoder, ("do_resize", "do_rescale", "do_normalize", "do_pad"))
        return cls(anyres_settings(encoder), normalisation, arithmetic=arithmetic)

    def options(self) -> dict:
        """Whose token arithmetic the counts follow."""
        return {"arithmetic": self.arithmetic}

    @property
    def counts_images_per_sample(self) -> bool:
        """OneVision (``anyres_max_N``): an image of a sample of several is stored and counted untiled,
        so its count, and the model (``batch_num_images``), need the sample's image count."""
        return self.settings.max_num_patches is not None

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) in pixels of the grid resolution the image is resized into."""
        return self._pinpoints.best(height, width)

    def tiles(self, width: int, height: int) -> int:
        """Tiles of the image's grid (the model's inputs are these plus the base image)."""
        grid_height, grid_width = self.grid(width, height)
        return (grid_height // self.settings.tile) * (grid_width // self.settings.tile)

    def tokens_for_size(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """Language-model positions of the image: base features + unpadded tile features + one
        newline per row. ``sample_images`` over 1: a OneVision sample with several images, whose
        images are not tiled (base features + one newline)."""
        s = self.settings
        if sample_images > 1 and s.max_num_patches is not None:
            return s.base_tokens + 1
        if self.arithmetic == "llava":  # LLaVA reads the pinpoints as (width, height), the size as (width, height)
            grid_width, grid_height = self._pinpoints.best(width, height)
        else:
            grid_height, grid_width = self.grid(width, height)
        rows = s.features_per_side * (grid_height // s.tile)
        columns = s.features_per_side * (grid_width // s.tile)
        if width / height > columns / rows:
            kept = height * (columns / width)
            padding = (rows - self._truncate(kept)) // 2
            rows -= 2 * padding
        else:
            kept = width * (rows / height)
            padding = (columns - self._truncate(kept)) // 2
            columns -= 2 * padding
        features, newlines = rows * columns, rows
        if s.max_num_patches is not None:
            ratio = math.sqrt(rows * columns / (s.max_num_patches * s.features_per_side**2))
            if ratio > 1.1:
                features, newlines = int(rows // ratio) * int(columns // ratio), int(rows // ratio)
        return s.base_tokens + features + newlines

    def fewest_tokens(self) -> int:
        """A lower bound: the base image's features (an image of an extreme aspect ratio may keep no
        row of its tiles' features once unpadded; every other image takes those too)."""
        return self.settings.base_tokens

    def pixels_for_size(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """Pixels of the largest image the processor makes of it: the padded grid (a OneVision
        multi-image sample's image: its square at the tile size)."""
        if sample_images > 1 and self.settings.square_colour is not None:
            return self.settings.tile**2
        grid_height, grid_width = self.grid(width, height)
        return grid_height * grid_width

    def vision_cost_for_size(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """The vision encoder's attention cost of the image: one pass per tile and the base image,
        each of a tile's patches squared (a OneVision multi-image sample's image: one pass)."""
        passes = 1 if sample_images > 1 and self.settings.max_num_patches is not None else 1 + self.tiles(width, height)
        return passes * self.settings.features_per_side**4

    def vision_cost_of_stored(self, size: tuple[int, int], parts: int, tokens: int) -> int:
        """An image stored as one part is a OneVision multi-image sample's square: one encoder pass."""
        return self.vision_cost_for_size(*size, sample_images=2 if parts == 1 else 1)

    def _truncate(self, value: float) -> int:
        return int(value) if self.arithmetic == "llava" else int(round(value, 7))

    def to_uint8(self, image: Image.Image, *, sample_images: int = 1) -> StoredImage:
        """RGB image -> (base image at the tile size, image resized into its grid resolution), uint8.

        ``sample_images`` over 1 (OneVision): the image padded to a square with the mean colour, at the tile size."""
        s = self.settings
        width, height = image.size
        tokens = self.tokens_for_size(width, height, sample_images=sample_images)
        if sample_images > 1 and s.square_colour is not None:
            square = expand_to_square(image, s.square_colour).resize((s.tile, s.tile), resample=s.resample)
            return StoredImage(size=(width, height), parts=(planar_uint8(square),), tokens=tokens)
        base = image.resize((s.tile, s.tile), resample=s.resample)
        resized_height, resized_width = _fit_inside(height, width, *self.grid(width, height))
        resized = image.resize((resized_width, resized_height), resample=s.resample)
        return StoredImage(size=(width, height), parts=(planar_uint8(base), planar_uint8(resized)), tokens=tokens)

    def model_inputs(self, images: list[StoredImage]) -> dict[str, np.ndarray]:
        """``pixel_values`` float32 (n, 1 + max tiles, 3, S, S) (an image with fewer tiles padded with
        zeros, as the processor pads a batch) and ``image_sizes`` int64 (n, 2) as (height, width)."""
        s = self.settings
        stacks = [self._tiles_uint8(image) for image in images]
        most = max((len(stack) for stack in stacks), default=1)
        pixel_values = np.zeros((len(images), most, 3, s.tile, s.tile), dtype=np.float32)
        for k, stack in enumerate(stacks):
            self.normalisation.apply(stack, out=pixel_values[k, : len(stack)])
        sizes = np.array([(image.size[1], image.size[0]) for image in images], dtype=np.int64).reshape(-1, 2)
        return {"pixel_values": pixel_values, "image_sizes": sizes}

    def sample_extras(self, tokens, images, num_images, patch_id) -> dict[str, np.ndarray]:
        """OneVision's ``batch_num_images`` (each sample's image count: its model tiles an image only
        when it is its sample's only one); none for LLaVA-NeXT. ValueError when the pack's ``<image>``
        positions are not its images' tokens, or an image is stored tiled in a sample of several or
        untiled alone in its sample."""
        expected = sum(image.tokens for image in images)
        found = int((np.asarray(tokens) == patch_id).sum())
        if found != expected:
            raise ValueError(f"{found} image positions in the pack, its images make {expected}")
        if not self.counts_images_per_sample:
            return {}
        counts = np.asarray(num_images, dtype=np.int64)
        alone = np.repeat(counts == 1, counts)
        for k, (image, single) in enumerate(zip(images, alone)):
            if (len(image.parts) == 1) == bool(single):
                state = "untiled" if len(image.parts) == 1 else "tiled"
                raise ValueError(f"image {k} of the pack is stored {state} in a sample of {'one image' if single else 'several'}")
        return {"batch_num_images": counts.copy()}

    def _tiles_uint8(self, image: StoredImage) -> np.ndarray:
        """uint8 (1 + tiles, 3, S, S): the base image, then the padded grid's tiles row by row."""
        s = self.settings
        if len(image.parts) == 1:  # a OneVision multi-image sample's square
            return image.parts[0][None]
        base, resized = image.parts
        grid_height, grid_width = self.grid(*image.size)
        _, height, width = resized.shape
        top, left = (grid_height - height) // 2, (grid_width - width) // 2
        canvas = np.zeros((3, grid_height, grid_width), dtype=np.uint8)
        canvas[:, top : top + height, left : left + width] = resized
        rows, columns = grid_height // s.tile, grid_width // s.tile
        tiles = canvas.reshape(3, rows, s.tile, columns, s.tile).transpose(1, 3, 0, 2, 4).reshape(-1, 3, s.tile, s.tile)
        return np.concatenate([base[None], tiles])


def _fit_inside(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
    """(height, width) of the image scaled to fit the target, aspect kept (ceil; the side that
    limits takes the target's size), as transformers' ``get_patch_output_size``."""
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


