"""Images that the dynamic-resolution tests run through our processors and transformers' alike:
real photos from registry wheels (scikit-image, matplotlib: public domain / CC0), every PIL mode,
an EXIF-rotated JPEG, tiny and extremely elongated images. Each is decoded as the pipeline decodes
it (``decode_image``: RGB, alpha dropped, EXIF orientation not applied)."""

from __future__ import annotations

import importlib.resources
import io

import numpy as np
from PIL import Image

from neva_pack.families import decode_image

SKIMAGE = importlib.resources.files("skimage") / "data"
MPL = importlib.resources.files("matplotlib") / "mpl-data" / "sample_data"


def synthetic(mode: str, size: tuple[int, int], seed: int = 0, exif_orientation: int | None = None) -> bytes:
    """A random image of ``mode`` and (width, height) as file bytes (JPEG when it carries EXIF)."""
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    image = rgb.convert("P", palette=Image.Palette.ADAPTIVE) if mode == "P" else rgb.convert(mode)
    out = io.BytesIO()
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        image.save(out, format="JPEG", exif=exif)
    else:
        image.save(out, format="TIFF" if mode == "CMYK" else "PNG")
    return out.getvalue()


ZOO = {
    "grace_hopper.jpg (512x600 portrait JPEG)": lambda: (MPL / "grace_hopper.jpg").read_bytes(),
    "astronaut.png (RGB 512x512)": lambda: (SKIMAGE / "astronaut.png").read_bytes(),
    "coffee.png (RGB 600x400)": lambda: (SKIMAGE / "coffee.png").read_bytes(),
    "hubble_deep_field.jpg (1000x872, ICC)": lambda: (SKIMAGE / "hubble_deep_field.jpg").read_bytes(),
    "camera.png (L)": lambda: (SKIMAGE / "camera.png").read_bytes(),
    "text.png (L, 448x172, aspect 2.6)": lambda: (SKIMAGE / "text.png").read_bytes(),
    "logo.png (RGBA)": lambda: (SKIMAGE / "logo.png").read_bytes(),
    "no_time_for_that_tiny.gif (P, animated, 14x25)": lambda: (SKIMAGE / "no_time_for_that_tiny.gif").read_bytes(),
    "CMYK 50x70": lambda: synthetic("CMYK", (50, 70)),
    "LA 40x30": lambda: synthetic("LA", (40, 30)),
    "P 31x17": lambda: synthetic("P", (31, 17)),
    "EXIF orientation 6 JPEG 90x60": lambda: synthetic("RGB", (90, 60), exif_orientation=6),
    "1x1": lambda: synthetic("RGB", (1, 1)),
    "2x1": lambda: synthetic("RGB", (2, 1)),
    "1x2": lambda: synthetic("RGB", (1, 2)),
    "400x2 (aspect 200, the most Qwen accepts)": lambda: synthetic("RGB", (400, 2)),
    "5x900 (extreme portrait)": lambda: synthetic("RGB", (5, 900)),
}


def zoo_images() -> dict[str, Image.Image]:
    return {name: decode_image(load(), name) for name, load in ZOO.items()}


def random_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
