"""The numbers that decide a native-resolution image's size, tokens and pixels, read from an encoder's
settings as its Hugging Face processor reads them (the native family, native.py, follows a reference
with them)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from neva_pack.core import ConfigError
from neva_pack.families.base import EncoderSpec

__all__ = ["NativeSettings", "native_settings", "settings_areas"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeSettings:
    """The numbers that decide a native-resolution image's size, tokens and pixels."""

    patch_size: int
    """Vision transformer patch side in pixels (14)."""
    merge_size: int
    """Patches merged per side into one language-model token (2: 2 x 2 patches per token)."""
    temporal_patch_size: int
    """Frames per patch; a still image is repeated this many times (2)."""
    min_pixels: int
    """Smallest resized area (the checkpoints' 3136 = 56 x 56)."""
    max_pixels: int
    """Largest resized area (the checkpoints' 12,845,056; transformers' class default is 1,003,520)."""
    resample: int
    """PIL resampling filter of the resize (3, bicubic)."""
    reference: str = "transformers"
    """Whose resize the sizes follow (native.py's ``REFERENCES`` and docstring)."""

    @property
    def factor(self) -> int:
        """Each resized side is a multiple of this (28)."""
        return self.patch_size * self.merge_size


def native_settings(encoder: EncoderSpec, *, min_pixels: int | None = None, max_pixels: int | None = None) -> NativeSettings:
    """The settings of a Qwen2-VL encoder, read as its processor reads them (``min_pixels`` and
    ``max_pixels`` over ``size``'s ``shortest_edge`` / ``longest_edge``); the keyword arguments
    (``--min_pixels`` / ``--max_pixels``) override both."""
    cfg = encoder.preprocessor_config
    file_low, file_high = settings_areas(cfg)
    low, high = min_pixels or file_low, max_pixels or file_high
    settings = NativeSettings(
        patch_size=int(cfg.get("patch_size", encoder.patch_size)),
        merge_size=int(cfg.get("merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
        min_pixels=int(low),
        max_pixels=int(high),
        resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
    )
    if not 0 < settings.min_pixels <= settings.max_pixels:
        raise ConfigError(f"--min_pixels {settings.min_pixels} / --max_pixels {settings.max_pixels}: need 0 < min <= max")
    return settings


def settings_areas(cfg: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) as the processor reads a settings file: its own keys over ``size``'s,
    the class defaults for what it leaves out."""
    size = cfg.get("size") or {}
    low = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    high = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    return low, high
