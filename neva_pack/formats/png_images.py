"""A row's images as PNG bytes (LLaMA-Factory's ``images`` column): written losslessly and deterministically,
read back only through PNG's plugin with the size checked before a pixel is decoded."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from neva_pack.core import InputError

__all__ = ["MAX_STORED_PIXELS", "png_bytes", "png_pixels"]


def png_bytes(part: np.ndarray) -> bytes:
    """uint8 (3, H, W) -> PNG bytes (lossless; deterministic: no timestamps, fixed compression)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(np.asarray(part, np.uint8).transpose(1, 2, 0)), "RGB").save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


MAX_STORED_PIXELS = 36_000_000
"""Most pixels a stored image of a row may have: what ``--max_image_pixels`` lets through by default
(every family's stored part is resized to far fewer)."""


def png_pixels(data: bytes, shape: tuple[int, int] | None, where: Path) -> np.ndarray:
    """PNG bytes of a row -> uint8 (3, H, W), of ``shape`` (H, W) where the meta fixes one. The bytes are
    a file's we did not write until verify says so: only PNG's plugin opens them, and its header's size
    is checked before a pixel is decoded; a damaged one is an InputError naming the file."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=("PNG",)) as image:
            width, height = image.size
            if (shape is not None and (height, width) != tuple(shape)) or width * height > MAX_STORED_PIXELS:
                expected = f"the stored {shape[1]} x {shape[0]}" if shape is not None else f"at most {MAX_STORED_PIXELS:,} pixels"
                raise ValueError(f"an image of {width} x {height} pixels, not {expected}")
            return np.ascontiguousarray(np.asarray(image.convert("RGB"), np.uint8).transpose(2, 0, 1))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InputError(" ".join(f"{where}: a damaged image in a row ({type(exc).__name__}: {exc})".split())) from None
