"""The processor of an encoder's dynamic-resolution family: one registry line per family module."""

from __future__ import annotations

from neva_pack.families.encoders import EncoderSpec
from neva_pack.core import ConfigError
from neva_pack.families.anyres import AnyresProcessor
from neva_pack.families.dynamic import DynamicProcessor
from neva_pack.families.native import NativeProcessor

__all__ = ["dynamic_processor"]


def dynamic_processor(
    encoder: EncoderSpec, *, arithmetic: str = "transformers", min_pixels: int | None = None, max_pixels: int | None = None
) -> DynamicProcessor:
    """The processor for ``encoder``'s family. ``arithmetic`` (anyres: "transformers" or "llava",
    the latter for ``--tokenization llava``) and ``min_pixels`` / ``max_pixels`` (native: ``--min_pixels`` /
    ``--max_pixels``) are the families' own options; ConfigError for one given to the other family."""
    if encoder.family == "anyres":
        if min_pixels is not None or max_pixels is not None:
            raise ConfigError(f"--min_pixels / --max_pixels: {encoder.name} is not a native-resolution (Qwen2-VL) encoder")
        return AnyresProcessor.from_encoder(encoder, arithmetic=arithmetic)
    if encoder.family == "native":
        return NativeProcessor.from_encoder(encoder, min_pixels=min_pixels, max_pixels=max_pixels)
    raise ConfigError(f"--hf_vision_encoder {encoder.name}: a fixed-crop encoder ({encoder.processor}), not a dynamic-resolution one")
