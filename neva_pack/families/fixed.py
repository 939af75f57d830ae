"""Fixed-resolution preprocessing (CLIP / SigLIP: one square crop per image), split in two halves.

    RGB PIL --[pad]--> resize/crop --> uint8 (3, H, W)          in workers, stored
    uint8 (3, H, W) --rescale/normalize--> float32 (3, H, W)    at write time

Both halves give exactly transformers' image processor's bytes (its PIL backend), so the stored
uint8 image normalised later is bit-identical to running the processor in one go, while the
intermediate store holds 1 byte per value instead of NeMo's float32. For the settings it is proven
on (every shipped encoder; tested over an image zoo), the geometry is a plain PIL resize + centre
crop (FastGeometry), and the normalisation is core.Normalisation read from the settings:
transformers is then never imported. Other settings go through the processor itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from neva_pack.core import ConfigError, ImageRun
from neva_pack.families.base import CLIP_MEAN, EncoderSpec, FamilyBase, FamilyOptions, Join, RunRequest
from neva_pack.families.decode import DEFAULT_MAX_IMAGE_PIXELS, too_many_pixels
from neva_pack.families.settings_keys import MAX_SIDE, Setting, is_int
from neva_pack.families.image_ids import NEMO_IM_END, NEMO_IM_START, image_run_for
from neva_pack.records import RecordError

__all__ = [
    "ASPECT_RATIOS", "FastGeometry", "ImagePreprocessor", "crop_size", "encoder_tokens", "expand_to_square", "fast_geometry",
    "normalisation_from_settings", "normalisation_of", "processor_class", "processor_halves",
]  # fmt: skip

ASPECT_RATIOS = ("square", "pad")


class ImagePreprocessor(FamilyBase):
    """The fixed-crop family: the encoder's image processor, applied in the two halves described
    above; every image one (3, H, W) crop and one run of ``encoder_tokens`` positions.

    It answers the family interface (base.ModelFamily) with constants where the others compute from
    the size; its stored part is one uint8 (3, H, W) array, which the formats hold as one stack."""

    family = "fixed"
    models = "CLIP / SigLIP"
    image_tokens = (NEMO_IM_START, None, NEMO_IM_END)
    """NeMo's delimiters where the tokenizer has them; the patch token is the template's (``image_run``)."""
    own_size = False
    batch_keys = {"pixel_values": Join.IMAGES}
    """One normalised crop per image."""

    def __init__(self, encoder: EncoderSpec, aspect_ratio: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        if aspect_ratio not in ASPECT_RATIOS:
            raise ConfigError(f"--image_aspect_ratio {aspect_ratio!r}: choose one of {', '.join(ASPECT_RATIOS)}")
        self.encoder = encoder
        self.aspect_ratio = aspect_ratio
        self.max_pixels = max_pixels
        self.shape = (3, *crop_size(encoder))
        self.encoder_tokens = encoder_tokens(encoder)
        """Sequence positions one image's features occupy: (H / patch) * (W / patch)."""
        if self.encoder_tokens < 1:
            raise ConfigError(f"--hf_vision_encoder {encoder.name}: a crop of {self.shape[1]} x {self.shape[2]} holds no patch of {encoder.patch_size}")
        self.vision_cost = self.encoder_tokens**2
        """Attention cost of one image in the encoder: patches² (one pass over its patches)."""
        mean = encoder.preprocessor_config.get("image_mean", CLIP_MEAN if encoder.processor == "clip" else _HALF)
        self._pad_colour = tuple(int(channel * 255) for channel in mean)  # LLaVA's expand2square background
        self._processors = None
        self._geometry = fast_geometry(encoder)
        self._normalisation = None

    settings_keys = (
        Setting("size", f"an integer or an object of height and width, or shortest_edge (and longest_edge), 1 to {MAX_SIDE:,} pixels",
                lambda v: _crop_sides(v, ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}))),
        Setting("crop_size", f"an integer or an object of height and width, 1 to {MAX_SIDE:,} pixels",
                lambda v: _crop_sides(v, ({"height", "width"},))),
    )  # fmt: skip
    """What the processor's geometry reads of a preprocessor_config.json beyond the common keys (settings_keys)."""

    @staticmethod
    def check_settings_file(settings: dict, processor: str, path) -> None:
        """Every image must come out at one (height, width): a center crop gives it (CLIP), or a resize
        to a height and width; a resize of the shortest edge alone, or none, keeps each image's aspect."""
        size = settings.get("size", 224)
        to_box = isinstance(size, dict) and "height" in size or (processor == "siglip" and isinstance(size, int))
        if (processor == "clip" and settings.get("do_center_crop", True)) or (settings.get("do_resize", True) and to_box):
            return
        raise ConfigError(
            f"{path}: do_center_crop/do_resize/size give images of varying shape (no crop, and no resize to a height "
            'and width); packed images have one shape: set do_center_crop to true or size to {"height": H, "width": W}'
        )

    @classmethod
    def from_options(cls, encoder: EncoderSpec, options: FamilyOptions) -> ImagePreprocessor:
        """The crop of the encoder's settings (ConfigError when a settings file asks for another)."""
        if options.crop_size is not None and tuple(options.crop_size) != crop_size(encoder):
            raise ConfigError(
                f"crop_size {list(options.crop_size)} disagrees with {encoder.name}'s processor ({list(crop_size(encoder))})"
            )
        return cls(encoder, options.aspect_ratio, max_pixels=options.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)

    def image_run(self, tokenizer, request: RunRequest) -> ImageRun:
        """NeMo's delimited run where the convention and the tokenizer have it, else explicit ids
        (``image_ids.image_run_for``)."""
        convention = {} if request.tokenization is None else {"tokenization": request.tokenization}
        return image_run_for(
            tokenizer, self.encoder_tokens, use_im_start_end=request.use_im_start_end, patch_id=request.patch_id,
            start_id=request.start_id, end_id=request.end_id, patch_token=request.patch_token, **convention,
        )  # fmt: skip

    def tokens_for_size(self, width: int, height: int) -> int:
        """Every image: ``encoder_tokens``."""
        return self.encoder_tokens

    def fewest_tokens(self) -> int:
        """Every image: ``encoder_tokens``."""
        return self.encoder_tokens

    def pixels_for_size(self, width: int, height: int) -> int:
        """The largest image padding and resizing make (what ``check_size`` holds to the budget)."""
        return max((pixels for _, pixels in self._made(width, height)), default=width * height)

    def vision_cost_for_size(self, width: int, height: int) -> int:
        """Every image: ``vision_cost``."""
        return self.vision_cost

    def model_inputs(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """uint8 (N, 3, H, W) crops -> ``pixel_values`` float32, normalised as the processor does."""
        return {"pixel_values": self.normalize(np.asarray(images).reshape(-1, *self.shape))}

    def _built(self):
        """The two processors, built on first use: a process that never touches an image (the main
        process of a text-only run) never imports transformers."""
        if self._processors is None:
            self._processors = processor_halves(self.encoder)
        return self._processors

    def __getstate__(self):
        return {**self.__dict__, "_processors": None}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def check_size(self, size: tuple[int, int], name: str) -> None:
        """image_too_large when padding (pad) or resizing would make more than ``max_pixels``,
        checked before either runs: a 20000 x 1 image padded is 400 megapixels, and resized so its
        shortest edge is 336 it is 336 x 6,720,000."""
        for what, pixels in self._made(*size):
            if pixels > self.max_pixels:
                raise RecordError("image_too_large", too_many_pixels(name, what, pixels, self.max_pixels))

    def _made(self, width: int, height: int) -> list[tuple[str, int]]:
        """(what, pixels) of the images padding (pad) and a resize of the shortest edge make, in order."""
        made = []
        if self.aspect_ratio == "pad" and width != height:
            side = max(width, height)
            made.append((f"padded to {side} x {side}", side * side))
            if side * side > self.max_pixels:
                return made
            width = height = side
        size = self.encoder.preprocessor_config.get("size")
        shortest = size.get("shortest_edge") if isinstance(size, dict) else None  # an int size: the processor's to read
        if shortest and min(width, height) > 0:
            scale = shortest / min(width, height)
            resized = (max(round(width * scale), shortest), max(round(height * scale), shortest))
            made.append((f"resized to {resized[0]} x {resized[1]} (shortest edge {shortest})", resized[0] * resized[1]))
        return made

    def to_uint8(self, image: Image.Image) -> np.ndarray:
        """RGB image -> (3, H, W) uint8 after padding (if ``pad``), resize and crop."""
        if self.aspect_ratio == "pad":
            image = expand_to_square(image, self._pad_colour)
        if self._geometry is not None:
            pixels = self._geometry.apply(image)
        else:
            geometry, _ = self._built()
            pixels = geometry(images=image, return_tensors="np")["pixel_values"][0]
        if pixels.shape != self.shape:
            raise RuntimeError(f"image processor returned shape {pixels.shape}, expected {self.shape}")
        return pixels.astype(np.uint8, copy=False)

    @property
    def stored_shape(self) -> tuple[int, int, int]:
        """Every image is stored as one crop of this (3, H, W)."""
        return tuple(self.shape)

    @property
    def model_normalisation(self):
        """``normalisation()``: asked of the processor only when the settings do not spell it out."""
        return self.normalisation()

    def normalisation(self):
        """The rescale factor, mean and std the processor applies (what a packed output's meta records,
        and what every writer and reader normalises with: core.Normalisation). Read from the
        encoder's settings when they spell them out; else asked of the processor (transformers)."""
        if self._normalisation is None:
            self._normalisation = normalisation_from_settings(self.encoder) or normalisation_of(self._built()[1])
        return self._normalisation

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """(N, 3, H, W) uint8 -> (N, 3, H, W) float32, rescaled and normalised as the processor does
        (bit-identical: core.Normalisation, the one implementation)."""
        return self.normalisation().apply(pixels)


@dataclass(frozen=True, slots=True, kw_only=True)
class FastGeometry:
    """The processor's resize (+ centre crop) done directly on the PIL image.

    The processor turns the PIL image into an array, back into a PIL image, resizes it with PIL
    and slices the centre out; doing only the PIL resize and the slice gives the same bytes
    (tested over an image zoo for every shipped encoder) without the round trips, or importing
    transformers at all.
    """

    shortest_edge: int | None
    """Resize so that the shorter side has this length (CLIP), or None to resize to ``size``."""
    size: tuple[int, int]
    """(height, width) to resize to when ``shortest_edge`` is None (SigLIP)."""
    crop: tuple[int, int] | None
    """(height, width) of the centre crop, or None."""
    resample: int
    """PIL resampling filter."""

    def apply(self, image: Image.Image) -> np.ndarray:
        width, height = image.size
        if self.shortest_edge is None:
            new_height, new_width = self.size
        else:  # transformers' get_resize_output_image_size(default_to_square=False)
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            new_height, new_width = (new_long, new_short) if width <= height else (new_short, new_long)
        pixels = np.asarray(image.resize((new_width, new_height), resample=self.resample))
        if self.crop is not None:
            top, left = (new_height - self.crop[0]) // 2, (new_width - self.crop[1]) // 2
            pixels = pixels[top : top + self.crop[0], left : left + self.crop[1]]
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def fast_geometry(encoder: EncoderSpec) -> FastGeometry | None:
    """The fast path for the settings it is proven for; None (use the processor) for anything else."""
    cfg = encoder.preprocessor_config
    if set(cfg) - _FAST_KEYS or not cfg.get("do_resize", True) or not isinstance(cfg.get("resample"), int):
        return None
    size = cfg.get("size")
    if encoder.processor == "clip" and isinstance(size, dict) and set(size) == {"shortest_edge"}:
        if not cfg.get("do_center_crop", True):
            return None
        crop = crop_size(encoder)
        if min(crop) < 1 or max(crop) > size["shortest_edge"]:  # the processor would pad the crop
            return None
        return FastGeometry(shortest_edge=int(size["shortest_edge"]), size=crop, crop=crop, resample=cfg["resample"])
    if encoder.processor == "siglip" and isinstance(size, dict) and set(size) == {"height", "width"}:
        return FastGeometry(shortest_edge=None, size=(int(size["height"]), int(size["width"])), crop=None, resample=cfg["resample"])
    return None


def processor_halves(encoder: EncoderSpec):
    """The encoder's transformers image processor as two processors: geometry (pad, resize, crop;
    no rescale or normalise) and values (rescale and normalise only)."""
    image_processor = processor_class(encoder.processor)
    settings = {k: v for k, v in encoder.preprocessor_config.items() if k not in _NOT_PROCESSOR_KWARGS}
    return (
        image_processor(**{**settings, "do_rescale": False, "do_normalize": False}),
        image_processor(**{**settings, "do_resize": False, "do_center_crop": False}),
    )


def normalisation_of(values_processor):
    """The rescale factor, mean and std a transformers image processor applies (core.Normalisation)."""
    from neva_pack.core import Normalisation

    values = values_processor
    scale = float(values.rescale_factor) if values.do_rescale else 1.0
    mean = tuple(float(v) for v in values.image_mean) if values.do_normalize else (0.0, 0.0, 0.0)
    std = tuple(float(v) for v in values.image_std) if values.do_normalize else (1.0, 1.0, 1.0)
    return Normalisation(rescale_factor=scale, mean=mean, std=std)


def normalisation_from_settings(encoder: EncoderSpec):
    """The processor's rescale factor, mean and std read from the encoder's settings, when these spell
    all of them out (every shipped encoder; tested equal to what the processor reports), so that the
    main process never imports transformers; None (ask the processor) for anything else."""
    from neva_pack.core import Normalisation

    cfg = encoder.preprocessor_config
    if set(cfg) - _FAST_KEYS or not (cfg.get("do_rescale", True) and cfg.get("do_normalize", True)):
        return None
    mean, std, scale = cfg.get("image_mean"), cfg.get("image_std"), cfg.get("rescale_factor")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == 3 and isinstance(scale, float)):
        return None
    return Normalisation(rescale_factor=scale, mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std))


def crop_size(encoder: EncoderSpec) -> tuple[int, int]:
    """(height, width) of every processed image: CLIP's centre crop, else the resize's size.
    ConfigError for an encoder of another family, whose images have no one size."""
    if encoder.family != "fixed":
        raise ConfigError(
            f"--hf_vision_encoder {encoder.name}: a dynamic-resolution encoder ({encoder.processor}); each image has "
            "its own size and token count, which this command does not handle (use the fixed-crop encoders)"
        )
    cfg = encoder.preprocessor_config
    if encoder.processor == "clip" and cfg.get("do_center_crop", True):
        crop = cfg.get("crop_size", 224)
        return _height_width(crop)
    return _height_width(cfg.get("size", 224))


def encoder_tokens(encoder: EncoderSpec) -> int:
    """Sequence positions one image's features occupy: (H / patch) * (W / patch) of the crop."""
    height, width = crop_size(encoder)
    return (height // encoder.patch_size) * (width // encoder.patch_size)


def _crop_sides(value, key_sets) -> bool:
    """A size of one of ``key_sets`` (or one integer), every side from 1 to MAX_SIDE pixels."""
    if is_int(value):
        return 0 < value <= MAX_SIDE
    return isinstance(value, dict) and set(value) in key_sets and all(is_int(v) and 0 < v <= MAX_SIDE for v in value.values())


def _height_width(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if "height" in size:
        return int(size["height"]), int(size["width"])
    return int(size["shortest_edge"]), int(size["shortest_edge"])



def expand_to_square(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Pad the shorter side to a square, image centred, as LLaVA's expand2square."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), background)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


_HALF = (0.5, 0.5, 0.5)  # the SigLIP processor default
_NOT_PROCESSOR_KWARGS = {"image_processor_type", "processor_class", "feature_extractor_type", "auto_map"}
_FAST_KEYS = _NOT_PROCESSOR_KWARGS | {
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor", "do_normalize",
    "image_mean", "image_std", "do_convert_rgb",
}  # fmt: skip
"""Settings the fast paths understand; any other key sends the image through the processor."""


def processor_class(kind: str):
    from transformers import models

    if kind == "clip":
        module = models.clip
        names = ("CLIPImageProcessorPil", "CLIPImageProcessor")
    else:
        module = models.siglip
        names = ("SiglipImageProcessorPil", "SiglipImageProcessor")
    for name in names:  # transformers 5 names the numpy/PIL backend *Pil; 4.x has only the plain name
        if hasattr(module, name):
            return getattr(module, name)
    raise ConfigError(f"the installed transformers has no {names[-1]}")
