"""The stored image of a dynamic-resolution family: the type a sample builder makes, the sample
store's pool keeps and a compact output's reader gives back (re-exported as ``images.StoredImage``).

It lives with the store, not with the processors, so that the store and the formats that read its
pool name it without importing the processors (which import the formats' normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StoredImage"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredImage:
    """One image as a sample store holds it: uint8, at the sizes the processor resized it to.

    The model's float layout is rebuilt from it bit-identically by the processor's
    ``model_inputs`` (a quarter of float32's bytes, and for Qwen an eighth of its repeated patches).
    """

    size: tuple[int, int]
    """(width, height) of the decoded image, as its header gives it (LLaVA-NeXT's ``image_sizes``
    are made from it; its token count is a function of it)."""
    parts: tuple[np.ndarray, ...]
    """uint8 (3, H, W) arrays, C-contiguous, each at its own shape: Qwen one (the smart-resized
    image); LLaVA-NeXT / OneVision two (the base image resized to the tile, then the image resized
    into its best grid resolution, before padding), or one for a OneVision multi-image sample."""
    tokens: int
    """Sequence positions the image takes in the language model."""
    frames: int = 0
    """0 for a still image; for a video clip, the frames kept (its one part is them stacked top to
    bottom: (3, frames * h, w), frame k at rows [k h, (k + 1) h))."""
    grid_seconds: float = 0.0
    """A video's seconds per temporal patch (what the model reads as ``second_per_grid_ts``); 0 for an image."""
