"""Image loading (folder or .tar) and CLIP/SigLIP preprocessing, split in two halves.

    file bytes --open/convert RGB--> PIL --[pad]--> resize/crop --> uint8 (3, H, W)   in workers, stored
    uint8 (3, H, W) --rescale/normalize--> float32 (3, H, W)                        at write time

Both halves give exactly transformers' image processor's bytes (its PIL backend), so the stored
uint8 image normalised later is bit-identical to running the processor in one go, while the
intermediate store holds 1 byte per value instead of NeMo's float32. For the settings it is proven
on (every shipped encoder; tested over an image zoo), the geometry is a plain PIL resize + centre
crop (FastGeometry), and the normalisation is formats.meta.Normalisation read from the settings:
transformers is then never imported. Other settings go through the processor itself.

Decisions (as LLaVA and NeMo): ``Image.open(f).convert("RGB")`` drops alpha (no compositing
on white), EXIF orientation is not applied, an animated image contributes its first frame.
"""

from __future__ import annotations

import io
import os
import re
import stat
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
DEFAULT_MAX_IMAGE_BYTES = 64 << 20
"""64 MiB per image file (a 24-megapixel JPEG is about 10 MB)."""
DEFAULT_MAX_IMAGE_PIXELS = 36_000_000
"""36 megapixels per image as decoded, padded to a square (pad) or resized (square): decoding,
padding and the image processor need 12 to 15 bytes per pixel on top of a process's ~0.9 GB of
libraries, so one image keeps a process under 1.5 GB (benchmarks/bench_hostile.py); a 6000 x 4000
(24-megapixel) photo passes, padded too."""


@dataclass(frozen=True, slots=True)
class TarMember:
    offset: int
    """Byte offset of the member's data in the archive."""
    size: int
    """Size of the member's data in bytes."""
    sparse: bool = False
    """A sparse member (GNU/pax ``--sparse``): its data is not one run of bytes, so it is not read."""


class ImageSource:
    """Reads image bytes by relative name from a directory or an uncompressed .tar archive.

    A tar archive is indexed once (name -> data offset) and opened once per process;
    reading an image is one seek and one read. A name must stay inside the folder (after
    normalisation and symlinks) unless ``allow_outside``; only regular files are opened (never a
    device, FIFO or socket, which could block or never end), and at most ``max_bytes`` are read.
    """

    def __init__(self, root: str | Path | None, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, allow_outside: bool = False):
        self.root = None if root is None else Path(root)
        self.max_bytes = max_bytes
        self.allow_outside = allow_outside
        self._tar_index: dict[str, TarMember] | None = None
        self._tar_file = None
        self._resolved_root = None
        if self.root is None:
            return
        if self.root.is_file() and tarfile.is_tarfile(self.root):
            self._tar_index = _index_tar(self.root)
        elif self.root.is_file():
            raise ConfigError(f"--image_folder {self.root}: {_not_a_tar(self.root)}")
        elif not self.root.is_dir():
            raise ConfigError(f"--image_folder {self.root}: not a directory or a .tar archive")
        else:
            self._resolved_root = self.root.resolve()

    def read(self, name: str) -> bytes:
        if self.root is None:
            raise RecordError("missing_image", f"{name}: the record has an image but no --image_folder was given")
        if self._tar_index is not None:
            return self._read_tar(name)
        path = self._confined(name)
        try:
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                raise RecordError("unreadable_image", f"{name}: not a regular file (a directory, device, FIFO or socket)")
            self._check_bytes(name, info.st_size)
            # O_NONBLOCK: a FIFO swapped in after the stat cannot block the open; fstat refuses it
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise RecordError("missing_image", f"{name}: not found in {self.root}") from None
        except OSError as exc:
            raise RecordError("unreadable_image", f"{name}: {exc.__class__.__name__}: {exc.strerror or exc}") from None
        with open(descriptor, "rb") as f:
            try:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise RecordError("unreadable_image", f"{name}: not a regular file")
                data = f.read(self.max_bytes + 1)
            except OSError as exc:
                raise RecordError("unreadable_image", f"{name}: {exc.__class__.__name__}: {exc.strerror or exc}") from None
        self._check_bytes(name, len(data))
        return data

    def _confined(self, name: str) -> Path:
        """The file a name points at; outside_image_folder unless it stays inside the folder."""
        if self.allow_outside:
            return Path(os.path.normpath(self.root / name))
        self._check_relative(name)
        try:
            resolved = (self._resolved_root / name).resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
            raise RecordError("unreadable_image", f"{name}: its path cannot be resolved ({exc})") from None
        if not resolved.is_relative_to(self._resolved_root):
            raise RecordError("outside_image_folder", f"{name}: resolves to {resolved}, outside --image_folder {self.root}")
        return resolved

    def _check_relative(self, name: str) -> None:
        """The same names are outside the folder whether it is a directory or a .tar archive."""
        if _leaves_folder(name):
            raise RecordError("outside_image_folder", f"{name}: not a relative path inside --image_folder {self.root}")

    def _check_bytes(self, name: str, size: int) -> None:
        if size > self.max_bytes:
            raise RecordError(
                "image_too_large", f"{name}: more than --max_image_bytes {self.max_bytes:,} bytes ({size:,}+)"
            )

    def _read_tar(self, name: str) -> bytes:
        if not self.allow_outside:
            self._check_relative(name)
        member = self._tar_index.get(_normalise_member_name(name))
        if member is None:
            raise RecordError("missing_image", f"{name}: not a member of {self.root}")
        if member.sparse:
            raise RecordError("unreadable_image", f"{name}: a sparse member of {self.root} (archive it without --sparse)")
        self._check_bytes(name, member.size)
        if self._tar_file is None:
            self._tar_file = open(self.root, "rb")
        self._tar_file.seek(member.offset)
        return self._tar_file.read(member.size)

    def __getstate__(self):
        # the index travels to DataLoader workers; each worker opens the archive once itself
        return {key: getattr(self, key) for key in _SOURCE_STATE}

    def __setstate__(self, state):
        for key in _SOURCE_STATE:
            setattr(self, key, state[key])
        self._tar_file = None


_SOURCE_STATE = ("root", "max_bytes", "allow_outside", "_tar_index", "_resolved_root")


def decode_image(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Bytes -> RGB PIL image; anything PIL cannot decode is an ``unreadable_image`` skip.

    The size is read from the header and checked against ``max_pixels`` before any pixel is
    decoded. 16-bit grayscale (mode I;16, I) is scaled to 8 bits, not clipped (which whitens it).
    """
    _allow_pixels(max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own budget is checked first
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise RecordError("image_too_large", _too_many_pixels(name, f"{width} x {height}", width * height, max_pixels))
            image.load()
            if image.mode in _WIDE_GRAY_MODES:
                image = _gray_to_8_bits(image)
            return image if image.mode == "RGB" else image.convert("RGB")  # no second copy of a large image
    except Image.DecompressionBombError as exc:  # over PIL's limit, which _allow_pixels keeps above ours
        found = re.search(r"\((\d+) pixels\)", str(exc))
        what = _too_many_pixels(name, "size", int(found[1]), max_pixels) if found else f"{name}: {exc}"
        raise RecordError("image_too_large", what) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise RecordError("unreadable_image", f"{name}: {exc.__class__.__name__}: {exc}") from None


def _allow_pixels(max_pixels: int) -> None:
    """PIL refuses an image of more than twice ``Image.MAX_IMAGE_PIXELS`` (178,956,970 by default)
    in ``Image.open``, before its size can be checked against ``--max_image_pixels``; a budget above
    that, which the user asked for, raises PIL's limit to it (never lowers it): our check from the
    header then comes first, and PIL's only refuses what is over twice the budget."""
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > 2 * Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels


_WIDE_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _gray_to_8_bits(image: Image.Image) -> Image.Image:
    """16-bit grayscale (also PIL's 32-bit mode I, which PNG's 16-bit grayscale may open as) -> L,
    keeping the top 8 of 16 bits."""
    values = np.asarray(image).astype(np.int64)
    return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), mode="L")


def _too_many_pixels(name: str, what: str, pixels: int, max_pixels: int) -> str:
    return f"{name}: {what} = {pixels:,} pixels > --max_image_pixels {max_pixels:,}"


class ImagePreprocessor:
    """The encoder's image processor, applied in the two halves described above."""

    def __init__(self, encoder: EncoderSpec, aspect_ratio: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        if aspect_ratio not in ASPECT_RATIOS:
            raise ConfigError(f"--image_aspect_ratio {aspect_ratio!r}: choose one of {', '.join(ASPECT_RATIOS)}")
        self.encoder = encoder
        self.aspect_ratio = aspect_ratio
        self.max_pixels = max_pixels
        self.shape = (3, *encoder.crop_size)
        mean = encoder.preprocessor_config.get("image_mean", _CLIP_MEAN if encoder.processor == "clip" else _HALF)
        self._pad_colour = tuple(int(channel * 255) for channel in mean)  # LLaVA's expand2square background
        self._processors = None
        self._geometry = fast_geometry(encoder)
        self._normalisation = None

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

    def check_size(self, size: tuple[int, int], name: str) -> None:
        """image_too_large when padding (pad) or resizing would make more than ``max_pixels``,
        checked before either runs: a 20000 x 1 image padded is 400 megapixels, and resized so its
        shortest edge is 336 it is 336 x 6,720,000."""
        width, height = size
        if self.aspect_ratio == "pad" and width != height:
            side = max(width, height)
            if side * side > self.max_pixels:
                raise RecordError("image_too_large", _too_many_pixels(name, f"padded to {side} x {side}", side * side, self.max_pixels))
            width = height = side
        shortest = self.encoder.preprocessor_config.get("size", {}).get("shortest_edge")
        if shortest and min(width, height) > 0:
            scale = shortest / min(width, height)
            resized = (max(round(width * scale), shortest), max(round(height * scale), shortest))
            if resized[0] * resized[1] > self.max_pixels:
                what = f"resized to {resized[0]} x {resized[1]} (shortest edge {shortest})"
                raise RecordError("image_too_large", _too_many_pixels(name, what, resized[0] * resized[1], self.max_pixels))

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

    def normalisation(self):
        """The rescale factor, mean and std the processor applies (what a packed output's meta records,
        and what every writer and reader normalises with: formats.meta.Normalisation). Read from the
        encoder's settings when they spell them out; else asked of the processor (transformers)."""
        if self._normalisation is None:
            self._normalisation = normalisation_from_settings(self.encoder) or self._processor_normalisation()
        return self._normalisation

    def _processor_normalisation(self):
        from neva_pack.formats.meta import Normalisation

        _, values = self._built()
        scale = float(values.rescale_factor) if values.do_rescale else 1.0
        mean = tuple(float(v) for v in values.image_mean) if values.do_normalize else (0.0, 0.0, 0.0)
        std = tuple(float(v) for v in values.image_std) if values.do_normalize else (1.0, 1.0, 1.0)
        return Normalisation(rescale_factor=scale, mean=mean, std=std)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """(N, 3, H, W) uint8 -> (N, 3, H, W) float32, rescaled and normalised as the processor does
        (bit-identical: formats.meta.Normalisation, the one implementation)."""
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
        crop = encoder.crop_size
        if min(crop) < 1 or max(crop) > size["shortest_edge"]:  # the processor would pad the crop
            return None
        return FastGeometry(shortest_edge=int(size["shortest_edge"]), size=crop, crop=crop, resample=cfg["resample"])
    if encoder.processor == "siglip" and isinstance(size, dict) and set(size) == {"height", "width"}:
        return FastGeometry(shortest_edge=None, size=(int(size["height"]), int(size["width"])), crop=None, resample=cfg["resample"])
    return None


def normalisation_from_settings(encoder: EncoderSpec):
    """The processor's rescale factor, mean and std read from the encoder's settings, when these spell
    all of them out (every shipped encoder; tested equal to what the processor reports), so that the
    main process never imports transformers; None (ask the processor) for anything else."""
    from neva_pack.formats.meta import Normalisation

    cfg = encoder.preprocessor_config
    if set(cfg) - _FAST_KEYS or not (cfg.get("do_rescale", True) and cfg.get("do_normalize", True)):
        return None
    mean, std, scale = cfg.get("image_mean"), cfg.get("image_std"), cfg.get("rescale_factor")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == 3 and isinstance(scale, float)):
        return None
    return Normalisation(rescale_factor=scale, mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std))


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


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _not_a_tar(path: Path) -> str:
    """Why a file given as --image_folder is not an archive we can index, in one phrase."""
    with open(path, "rb") as f:
        head = f.read(8)
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            return f"a {kind}-compressed file; compressed archives are not supported (decompress it to a .tar)"
    return "not a directory or a .tar archive"


def _index_tar(path: Path) -> dict[str, TarMember]:
    """Name -> data of every regular file, hard link and symlink (to a file in the archive), as
    ``tar x`` would lay them out in a folder: the same dataset then reads the same either way."""
    size = path.stat().st_size
    try:
        with tarfile.open(path, "r:") as archive:
            index, symlinks = {}, {}
            for member in archive:
                name = _normalise_member_name(member.name)
                index.pop(name, None)  # a later member of the same name replaces it, as tar x does
                symlinks.pop(name, None)
                if member.issparse():  # its expanded size is not what the archive holds
                    index[name] = TarMember(member.offset_data, member.size, sparse=True)
                elif member.isfile():
                    if member.offset_data + member.size > size:
                        raise ConfigError(f"--image_folder {path}: truncated tar archive ({member.name} is cut short)")
                    index[name] = TarMember(member.offset_data, member.size)
                elif member.islnk():  # a hard link's data is its target's, archived before it
                    target = index.get(_normalise_member_name(member.linkname))
                    if target is not None:
                        index[name] = target
                elif member.issym():
                    symlinks[name] = os.path.join(os.path.dirname(name), member.linkname)
            for name, link in symlinks.items():
                target = _follow_symlinks(link, symlinks)
                if target in index:
                    index[name] = index[target]
            return index
    except (tarfile.TarError, OSError) as exc:
        reason = _not_a_tar(path)
        if reason.startswith("not a"):
            reason = f"truncated or corrupt tar archive ({exc})"
        raise ConfigError(f"--image_folder {path}: {reason}") from None


def _leaves_folder(name: str) -> bool:
    """An absolute name, or one whose ``..`` climb above the folder it is relative to."""
    return os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir


def _follow_symlinks(link: str, symlinks: dict[str, str], hops: int = 40) -> str | None:
    """The member a symlink ends at inside the archive; None when it leaves it or loops."""
    for _ in range(hops):
        if _leaves_folder(link):
            return None
        link = _normalise_member_name(link)
        if link not in symlinks:
            return link
        link = symlinks[link]
    return None


def _normalise_member_name(name: str) -> str:
    return os.path.normpath(name).lstrip("/").removeprefix("./")
