"""Model families: one module per family, one registry, and what reading an image file needs.

    base.py        ModelFamily: the one interface every family offers (image run, token counts,
                   stored parts, model inputs and how their keys join a batch, positions, vision cost)
    fixed.py       the fixed-crop family (CLIP / SigLIP: one square crop per image)
    anyres.py      the family of a base image plus grid tiles
    native.py      the native-resolution family (each image near its own size; multimodal positions)
    patch_grid.py  sizes on a patch grid (sides multiples of a factor within pixel bounds) and uint8
                   pixels cut into merge-ordered patches, for a family that resizes that way
    registry.py    the families by name, the shipped encoder settings, and a family rebuilt from an
                   output's record
    model_inputs.py  a pack's model inputs, put together from what its family gives
    image_ids.py   a fixed-length run's ids (NeMo's delimiters) and the checks of a run's ids
    headers.py     header sizes and token counts from headers, planar uint8 parts
    source.py      ImageSource: a folder or a .tar archive, names confined to it, budgets before reading
    decode.py      decode_image: bytes -> RGB PIL image, pixel budget from the header, decode-time budget
    video_frames.py  a clip's frame sampling and frame-size arithmetic, its frames stacked into one stored
                   part, and its kept frames decoded once (PyAV)

Code outside this package asks a family object for what it needs and never names a family: the
names of one family's module (its settings, its arithmetic) are imported from that module.
"""

from neva_pack.families.base import AttentionNeeds, EncoderSpec, FamilyOptions, Join, ModelFamily, RunRequest, VideoPlan, VideoRequest, restarting_positions
from neva_pack.families.decode import DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, decode_image, too_many_pixels
from neva_pack.families.headers import StoredImage, check_decoded_size, header_size, tokens_from_header
from neva_pack.families.image_ids import check_token_ids, image_run_for, missing_nemo_specials
from neva_pack.families.model_inputs import pack_model_inputs, stored_vision_cost
from neva_pack.families.registry import (
    FAMILIES,
    IMAGE_DELIMITER_PIECES,
    IMAGE_REFERENCES,
    dynamic_image_run,
    dynamic_processor,
    known_encoders,
    model_family,
    processor_from_record,
    processor_record,
    registered_batch_keys,
    resolve_encoder,
)
from neva_pack.families.source import DEFAULT_MAX_IMAGE_BYTES, ImageSource
from neva_pack.families.video_frames import decode_frames

__all__ = [
    "AttentionNeeds",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_DECODE_SECONDS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "EncoderSpec",
    "FAMILIES",
    "FamilyOptions",
    "IMAGE_DELIMITER_PIECES",
    "IMAGE_REFERENCES",
    "ImageSource",
    "Join",
    "ModelFamily",
    "RunRequest",
    "StoredImage",
    "VideoPlan",
    "VideoRequest",
    "check_decoded_size",
    "check_token_ids",
    "decode_frames",
    "decode_image",
    "dynamic_image_run",
    "dynamic_processor",
    "header_size",
    "image_run_for",
    "known_encoders",
    "missing_nemo_specials",
    "model_family",
    "pack_model_inputs",
    "processor_from_record",
    "processor_record",
    "registered_batch_keys",
    "resolve_encoder",
    "restarting_positions",
    "stored_vision_cost",
    "tokens_from_header",
    "too_many_pixels",
]
