"""A dynamic-resolution processor as an output records it, and rebuilt from that record offline.

The sample store's progress file and a compact output's meta keep the record (``image_processor``)
so that a reader, a re-pack or a check rebuilds exactly the processor the images were made with,
without the command line that made them::

    {"family": "native", "encoder": "Qwen/Qwen2-VL-7B-Instruct", "processor": "qwen2_vl",
     "preprocessor_config": {...}, "model_config": {...}, "patch_size": 14,
     "arithmetic": null, "min_pixels": 3136, "max_pixels": 12845056}

``min_pixels`` / ``max_pixels`` are the values the processor resolved (its flags or the encoder's
settings), ``arithmetic`` the anyres family's token arithmetic; each is null for the other family.
"""

from __future__ import annotations

from neva_pack.families.encoders import EncoderSpec
from neva_pack.families.dynamic import DynamicProcessor, StoredImage
from neva_pack.families.registry import dynamic_processor

__all__ = ["processor_from_record", "processor_record", "stored_vision_cost", "vision_cost_of_size"]


def processor_record(encoder: EncoderSpec, processor: DynamicProcessor) -> dict:
    """What rebuilds ``processor`` (made from ``encoder`` by ``images.dynamic_processor``), as JSON values."""
    native = processor.family == "native"
    return {
        "family": processor.family,
        "encoder": encoder.name,
        "processor": encoder.processor,
        "preprocessor_config": encoder.preprocessor_config,
        "model_config": encoder.model_config,
        "patch_size": encoder.patch_size,
        "arithmetic": None if native else processor.arithmetic,
        "min_pixels": processor.settings.min_pixels if native else None,
        "max_pixels": processor.settings.max_pixels if native else None,
    }


def processor_from_record(record: dict) -> DynamicProcessor:
    """The processor ``processor_record`` describes (ConfigError for settings it refuses)."""
    encoder = EncoderSpec(
        name=record["encoder"], processor=record["processor"], preprocessor_config=record["preprocessor_config"],
        patch_size=int(record["patch_size"]), model_config=record.get("model_config") or {},
    )  # fmt: skip
    if record["family"] == "native":
        return dynamic_processor(encoder, min_pixels=record["min_pixels"], max_pixels=record["max_pixels"])
    return dynamic_processor(encoder, arithmetic=record["arithmetic"])


def stored_vision_cost(processor: DynamicProcessor, image: StoredImage) -> int:
    """The vision encoder's attention cost of one stored image (the processor's ``vision_cost_for_size``,
    as the sample builder weighed it)."""
    return vision_cost_of_size(processor, image.size, len(image.parts))


def vision_cost_of_size(processor: DynamicProcessor, size: tuple[int, int], parts: int) -> int:
    """``stored_vision_cost`` from what a pool's image record holds (no pixel read): an anyres image
    stored as one part is a OneVision multi-image sample's square, one encoder pass."""
    if processor.family == "anyres" and parts == 1:
        return processor.vision_cost_for_size(*size, multi_image=True)
    return processor.vision_cost_for_size(*size)
