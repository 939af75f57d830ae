"""Image file bytes -> one RGB PIL image, within a pixel budget read from the header first.

Decisions (as LLaVA and NeMo): ``Image.open(f).convert("RGB")`` drops alpha (no compositing
on white), EXIF orientation is not applied, an animated image contributes its first frame.
"""

from __future__ import annotations

import io
import re
import warnings

import numpy as np
from PIL import Image

from neva_pack.records import RecordError

DEFAULT_MAX_IMAGE_PIXELS = 36_000_000
"""36 megapixels per image as decoded, padded to a square (pad) or resized (square): decoding,
padding and the image processor need 12 to 15 bytes per pixel on top of a process's ~0.9 GB of
libraries, so one image keeps a process under 1.5 GB (benchmarks/bench_hostile.py); a 6000 x 4000
(24-megapixel) photo passes, padded too."""


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
                raise RecordError("image_too_large", too_many_pixels(name, f"{width} x {height}", width * height, max_pixels))
            image.load()
            if image.mode in _WIDE_GRAY_MODES:
                image = _gray_to_8_bits(image)
            return image if image.mode == "RGB" else image.convert("RGB")  # no second copy of a large image
    except Image.DecompressionBombError as exc:  # over PIL's limit, which _allow_pixels keeps above ours
        found = re.search(r"\((\d+) pixels\)", str(exc))
        what = too_many_pixels(name, "size", int(found[1]), max_pixels) if found else f"{name}: {exc}"
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


def too_many_pixels(name: str, what: str, pixels: int, max_pixels: int) -> str:
    return f"{name}: {what} = {pixels:,} pixels > --max_image_pixels {max_pixels:,}"

