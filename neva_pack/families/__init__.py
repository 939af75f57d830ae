"""Images: reading their bytes (source), decoding them (decode), and one module per processing family.

    source.py   ImageSource: a folder or a .tar archive, names confined to it, budgets before reading
    decode.py   decode_image: bytes -> RGB PIL image, pixel budget from the header, decode-time budget
    fixed.py    ImagePreprocessor: CLIP / SigLIP fixed-resolution crop (LLaVA-1.5 / NeVA)
    anyres.py   AnyresProcessor: LLaVA-NeXT / OneVision base image + grid tiles, unpadded token counts
    native.py   NativeProcessor: Qwen2-VL / Qwen2.5-VL smart_resize, patch rows, image_grid_thw
    dynamic.py  what those two share: StoredImage, token counts from image headers
    families.py dynamic_processor(encoder): the family's processor
"""

from neva_pack.families.anyres import ARITHMETICS, AnyresProcessor, AnyresSettings, select_best_resolution
from neva_pack.families.decode import DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, decode_image
from neva_pack.families.dynamic import DynamicProcessor, StoredImage, check_decoded_size, header_size, tokens_from_header
from neva_pack.families.registry import dynamic_processor
from neva_pack.families.fixed import (
    ASPECT_RATIOS,
    FastGeometry,
    ImagePreprocessor,
    expand_to_square,
    fast_geometry,
    normalisation_from_settings,
    normalisation_of,
    processor_class,
    processor_halves,
)
from neva_pack.families.native import NativeProcessor, NativeSettings, smart_resize
from neva_pack.families.source import DEFAULT_MAX_IMAGE_BYTES, ImageSource

from neva_pack.families.decode import too_many_pixels
from neva_pack.families.encoders import EncoderSpec, known_encoders, resolve_encoder
from neva_pack.families.image_ids import IMAGE_DELIMITER_PIECES, check_token_ids, dynamic_image_run, image_run_for, missing_nemo_specials
from neva_pack.families.model_inputs import pack_model_inputs, restarting_positions
from neva_pack.families.mrope import mrope_position_ids
from neva_pack.families.recorded import processor_from_record, processor_record, stored_vision_cost, vision_cost_of_size

__all__ = [
    "ARITHMETICS",
    "ASPECT_RATIOS",
    "AnyresProcessor",
    "AnyresSettings",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_DECODE_SECONDS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DynamicProcessor",
    "EncoderSpec",
    "FastGeometry",
    "IMAGE_DELIMITER_PIECES",
    "ImagePreprocessor",
    "ImageSource",
    "NativeProcessor",
    "NativeSettings",
    "StoredImage",
    "check_decoded_size",
    "check_token_ids",
    "decode_image",
    "dynamic_image_run",
    "dynamic_processor",
    "expand_to_square",
    "fast_geometry",
    "header_size",
    "image_run_for",
    "known_encoders",
    "missing_nemo_specials",
    "mrope_position_ids",
    "normalisation_from_settings",
    "normalisation_of",
    "pack_model_inputs",
    "processor_class",
    "processor_from_record",
    "processor_halves",
    "processor_record",
    "resolve_encoder",
    "restarting_positions",
    "select_best_resolution",
    "smart_resize",
    "stored_vision_cost",
    "tokens_from_header",
    "too_many_pixels",
    "vision_cost_of_size",
]
