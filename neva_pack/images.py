"""Image loading (folder or .tar) and CLIP/SigLIP preprocessing, split in two halves.

    file bytes --open/convert RGB--> PIL --[pad]--> resize/crop --> uint8 (3, H, W)   in workers, stored
    uint8 (3, H, W) --rescale/normalize--> float32 (3, H, W)                        at write time

Both halves run transformers' image processor (its PIL backend), so the stored uint8
image normalised later is bit-identical to running the processor in one go, while the
intermediate store holds 1 byte per value instead of NeMo's float32.

Decisions (as LLaVA and NeMo): ``Image.open(f).convert("RGB")`` drops alpha (no compositing
on white), EXIF orientation is not applied, an animated image contributes its first frame.
"""

from __future__ import annotations

import io
import os
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from neva_pack.encoders import EncoderSpec
from neva_pack.errors import ConfigError
from neva_pack.records import RecordError

ASPECT_RATIOS = ("square", "pad")


@dataclass(frozen=True, slots=True)
class TarMember:
    offset: int
    """Byte offset of the member's data in the archive."""
    size: int
    """Size of the member's data in bytes."""


class ImageSource:
    """Reads image bytes by relative name from a directory or an uncompressed .tar archive.

    A tar archive is indexed once (name -> data offset) and opened once per process;
    reading an image is one seek and one read.
    """

    def __init__(self, root: str | Path | None):
        self.root = None if root is None else Path(root)
        self._tar_index: dict[str, TarMember] | None = None
        self._tar_file = None
        if self.root is None:
            return
        if self.root.is_file() and tarfile.is_tarfile(self.root):
            self._tar_index = _index_tar(self.root)
        elif not self.root.is_dir():
            raise ConfigError(f"--image_folder {self.root}: not a directory or a .tar archive")

    def read(self, name: str) -> bytes:
        if self.root is None:
            raise RecordError("missing_image", f"{name}: the record has an image but no --image_folder was given")
        if self._tar_index is not None:
            return self._read_tar(name)
        path = self.root / name
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise RecordError("missing_image", f"{name}: not found in {self.root}") from None
        except (IsADirectoryError, PermissionError, OSError) as exc:
            raise RecordError("unreadable_image", f"{name}: {exc.__class__.__name__}: {exc.strerror or exc}") from None

    def _read_tar(self, name: str) -> bytes:
        member = self._tar_index.get(_normalise_member_name(name))
        if member is None:
            raise RecordError("missing_image", f"{name}: not a member of {self.root}")
        if self._tar_file is None:
            self._tar_file = open(self.root, "rb")
        self._tar_file.seek(member.offset)
        return self._tar_file.read(member.size)

    def __getstate__(self):
        # the index travels to DataLoader workers; each worker opens the archive once itself
        return {"root": self.root, "_tar_index": self._tar_index}

    def __setstate__(self, state):
        self.root = state["root"]
        self._tar_index = state["_tar_index"]
        self._tar_file = None


def decode_image(data: bytes, name: str) -> Image.Image:
    """Bytes -> RGB PIL image; anything PIL cannot decode is an ``unreadable_image`` skip."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise RecordError("unreadable_image", f"{name}: {exc.__class__.__name__}: {exc}") from None


class ImagePreprocessor:
    """The encoder's image processor, applied in the two halves described above."""

    def __init__(self, encoder: EncoderSpec, aspect_ratio: str):
        if aspect_ratio not in ASPECT_RATIOS:
            raise ConfigError(f"--image_aspect_ratio {aspect_ratio!r}: choose one of {', '.join(ASPECT_RATIOS)}")
        self.encoder = encoder
        self.aspect_ratio = aspect_ratio
        self.shape = (3, *encoder.crop_size)
        mean = encoder.preprocessor_config.get("image_mean", _CLIP_MEAN if encoder.processor == "clip" else _HALF)
        self._pad_colour = tuple(int(channel * 255) for channel in mean)  # LLaVA's expand2square background
        self._processors = None
        self._geometry = fast_geometry(encoder)
        self._values = value_table(encoder)

    def _built(self):
        """The two processors, built on first use: a process that never touches an image (the main
        process of a text-only run) never imports transformers."""
        if self._processors is None:
            processor_class = _processor_class(self.encoder.processor)
            settings = {k: v for k, v in self.encoder.preprocessor_config.items() if k not in _NOT_PROCESSOR_KWARGS}
            self._processors = (
                processor_class(**{**settings, "do_rescale": False, "do_normalize": False}),
                processor_class(**{**settings, "do_resize": False, "do_center_crop": False}),
            )
        return self._processors

    def __getstate__(self):
        return {**self.__dict__, "_processors": None}

    def __setstate__(self, state):
        self.__dict__.update(state)

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

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """(N, 3, H, W) uint8 -> (N, 3, H, W) float32, rescaled and normalised by the processor."""
        if len(pixels) == 0:
            return np.zeros((0, *self.shape), dtype=np.float32)
        if self._values is not None:  # one float per (channel, uint8 value): a lookup, not arithmetic
            out = np.empty(pixels.shape, dtype=np.float32)
            for channel, table in enumerate(self._values):
                out[:, channel] = table[pixels[:, channel]]
            return out
        _, values = self._built()
        out = values(
            images=list(pixels), return_tensors="np", input_data_format="channels_first", data_format="channels_first"
        )["pixel_values"]
        return out.astype(np.float32, copy=False)


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
        crop = encoder.crop_size
        if min(crop) < 1 or max(crop) > size["shortest_edge"]:  # the processor would pad the crop
            return None
        return FastGeometry(shortest_edge=int(size["shortest_edge"]), size=crop, crop=crop, resample=cfg["resample"])
    if encoder.processor == "siglip" and isinstance(size, dict) and set(size) == {"height", "width"}:
        return FastGeometry(shortest_edge=None, size=(int(size["height"]), int(size["width"])), crop=None, resample=cfg["resample"])
    return None


def value_table(encoder: EncoderSpec) -> np.ndarray | None:
    """(3, 256) float32: the processor's rescale + normalise of every uint8 value of each channel.

    The same operations in the same dtypes as transformers (float64 product, cast to float32,
    then float32 subtract and divide), so a lookup gives the processor's bytes (tested for every
    shipped encoder); None when the settings are not the plain rescale + normalise.
    """
    cfg = encoder.preprocessor_config
    if set(cfg) - _FAST_KEYS or not (cfg.get("do_rescale", True) and cfg.get("do_normalize", True)):
        return None
    mean, std, scale = cfg.get("image_mean"), cfg.get("image_std"), cfg.get("rescale_factor")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == 3 and isinstance(scale, float)):
        return None
    values = (np.arange(256, dtype=np.uint8).astype(np.float64) * scale).astype(np.float32)
    mean32, std32 = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return np.stack([(values - mean32[c]) / std32[c] for c in range(3)])


def expand_to_square(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Pad the shorter side to a square, image centred, as LLaVA's expand2square."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), background)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN, the CLIP processor default
_HALF = (0.5, 0.5, 0.5)  # the SigLIP processor default
_NOT_PROCESSOR_KWARGS = {"image_processor_type", "processor_class", "feature_extractor_type", "auto_map"}
_FAST_KEYS = _NOT_PROCESSOR_KWARGS | {
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor", "do_normalize",
    "image_mean", "image_std", "do_convert_rgb",
}  # fmt: skip
"""Settings the fast paths understand; any other key sends the image through the processor."""


def _processor_class(kind: str):
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


def _index_tar(path: Path) -> dict[str, TarMember]:
    try:
        with tarfile.open(path, "r:") as archive:
            return {
                _normalise_member_name(m.name): TarMember(m.offset_data, m.size) for m in archive if m.isfile()
            }
    except (tarfile.TarError, OSError) as exc:
        raise ConfigError(f"--image_folder {path}: unreadable tar archive ({exc}); compressed archives are not supported") from None


def _normalise_member_name(name: str) -> str:
    return os.path.normpath(name).lstrip("/").removeprefix("./")
