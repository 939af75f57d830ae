"""Images: reading their bytes (source), decoding them (decode), and one module per processing family.

    source.py   ImageSource: a folder or a .tar archive, names confined to it, budgets before reading
    decode.py   decode_image: bytes -> RGB PIL image, pixel budget from the header, decode-time budget
    fixed.py    ImagePreprocessor: CLIP / SigLIP fixed-resolution crop (LLaVA-1.5 / NeVA)
    anyres.py   AnyresProcessor: LLaVA-NeXT / OneVision base image + grid tiles, unpadded token counts
    native.py   NativeProcessor: Qwen2-VL / Qwen2.5-VL smart_resize, patch rows, image_grid_thw
    dynamic.py  what those two share: StoredImage, token counts from image headers
    families.py dynamic_processor(encoder): the family's processor
"""

from neva_pack.images.anyres import ARITHMETICS, AnyresProcessor, AnyresSettings, select_best_resolution
from neva_pack.images.decode import DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, decode_image
from neva_pack.images.dynamic import DynamicProcessor, StoredImage, check_decoded_size, header_size, tokens_from_header
from neva_pack.images.families import dynamic_processor
from neva_pack.images.fixed import (
    ASPECT_RATIOS,
    FastGeometry,
    ImagePreprocessor,
    expand_to_square,
    fast_geometry,
    normalisation_from_settings,
    processor_class,
)
from neva_pack.images.native import NativeProcessor, NativeSettings, smart_resize
from neva_pack.images.source import DEFAULT_MAX_IMAGE_BYTES, ImageSource

__all__ = [
    "ARITHMETICS",
    "ASPECT_RATIOS",
    "AnyresProcessor",
    "AnyresSettings",
    "DynamicProcessor",
    "NativeProcessor",
    "NativeSettings",
    "StoredImage",
    "check_decoded_size",
    "dynamic_processor",
    "header_size",
    "select_best_resolution",
    "smart_resize",
    "tokens_from_header",
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
