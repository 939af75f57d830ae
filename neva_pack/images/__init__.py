"""Images: reading their bytes (source), decoding them (decode), and one module per processing family.

    source.py   ImageSource: a folder or a .tar archive, names confined to it, budgets before reading
    decode.py   decode_image: bytes -> RGB PIL image, pixel budget from the header, decode-time budget
    fixed.py    ImagePreprocessor: CLIP / SigLIP fixed-resolution crop (LLaVA-1.5 / NeVA)
"""

from neva_pack.images.decode import DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, decode_image
from neva_pack.images.fixed import (
    ASPECT_RATIOS,
    FastGeometry,
    ImagePreprocessor,
    expand_to_square,
    fast_geometry,
    normalisation_from_settings,
    processor_class,
)
from neva_pack.images.source import DEFAULT_MAX_IMAGE_BYTES, ImageSource

__all__ = [
    "ASPECT_RATIOS",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_DECODE_SECONDS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "FastGeometry",
    "ImagePreprocessor",
    "ImageSource",
    "decode_image",
    "expand_to_square",
    "fast_geometry",
    "normalisation_from_settings",
    "processor_class",
]
