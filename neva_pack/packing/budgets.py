"""Visual budgets: at most so many images, and so many image tokens, in one pack.

With dynamic-resolution encoders one image costs from a few dozen to thousands of positions, and the
vision encoder's memory grows with the images of a pack, not with its length: a pack may fit its
positions and still be too heavy for the encoder. Every packing kernel takes the budgets beside the
capacity, as per-sample arrays and per-pack limits (0: no limit)::

    images       [1, 0, 2]      max_images = 2       a bin holds samples 0 + 1, or 2 alone
    image_tokens [900, 0, 300]  max_image_tokens = 1000
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["NO_BUDGETS", "VisualBudgets", "budget_options", "over_image_budget", "visual_budgets"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VisualBudgets:
    """Per-sample image counts and image tokens, and the limit per pack of each (0: none)."""

    images: np.ndarray
    """int64 images of each sample (read only when ``max_images`` > 0)."""
    image_tokens: np.ndarray
    """int64 image tokens (positions of its image runs) of each sample (read only when ``max_image_tokens`` > 0)."""
    max_images: int = 0
    max_image_tokens: int = 0

    @property
    def active(self) -> bool:
        return self.max_images > 0 or self.max_image_tokens > 0

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """What every kernel takes after ``max_per_bin``."""
        return self.images, self.image_tokens, self.max_images, self.max_image_tokens

    def bins_needed(self, items: np.ndarray | None = None) -> int:
        """ceil(images / max_images) and ceil(image tokens / max_image_tokens) of ``items`` (all when
        None), the larger: no plan uses fewer bins (0 without budgets)."""
        needed = 0
        for values, limit in ((self.images, self.max_images), (self.image_tokens, self.max_image_tokens)):
            if limit > 0:
                total = int(values.sum() if items is None else values[items].sum())
                needed = max(needed, -(-total // limit))
        return needed


NO_BUDGETS = VisualBudgets(images=np.zeros(0, np.int64), image_tokens=np.zeros(0, np.int64))
"""No visual budget: every kernel packs by length (and max_samples_per_pack) alone."""


def visual_budgets(
    count: int,
    images=None,
    image_tokens=None,
    max_images_per_pack: int | None = None,
    max_image_tokens_per_pack: int | None = None,
) -> VisualBudgets:
    """The budgets of ``pack()``'s arguments, checked: ValueError for a budget < 1, a budget without
    its per-sample array, an array of the wrong shape or with negative values, and a sample that is
    over a budget on its own (no pack could hold it)."""
    if max_images_per_pack is None and max_image_tokens_per_pack is None:
        return NO_BUDGETS
    limits = {}
    for name, values, limit, array_name in (
        ("max_images_per_pack", images, max_images_per_pack, "images"),
        ("max_image_tokens_per_pack", image_tokens, max_image_tokens_per_pack, "image_tokens"),
    ):
        if limit is None:
            limits[array_name] = (np.zeros(0, np.int64), 0)
            continue
        if int(limit) != limit or limit < 1:
            raise ValueError(f"{name} must be a positive integer, got {limit!r}")
        if values is None:
            raise ValueError(f"{name} needs the {array_name} of every sample")
        array = np.asarray(values)
        if array.shape != (count,) or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"{array_name} must be {count} integers (one per sample), got shape {array.shape}, dtype {array.dtype}")
        array = np.ascontiguousarray(array, dtype=np.int64)
        if array.size and array.min() < 0:
            raise ValueError(f"sample {int(np.argmin(array))} has {int(array.min())} {array_name}; they must be >= 0")
        over = np.flatnonzero(array > limit)
        if over.size:
            raise ValueError(
                f"{over.size} sample(s) with more {array_name} than {name} {int(limit)} "
                f"(first: sample {int(over[0])}, {int(array[over[0]])}); no pack can hold them"
            )
        limits[array_name] = (array, int(limit))
    (images_array, max_images), (tokens_array, max_tokens) = limits["images"], limits["image_tokens"]
    return VisualBudgets(images=images_array, image_tokens=tokens_array, max_images=max_images, max_image_tokens=max_tokens)


def over_image_budget(rows: np.ndarray, max_images: int | None, max_image_tokens: int | None) -> np.ndarray:
    """The rows (``num_images`` and ``image_tokens`` fields; a run's as cut for a pack size) whose own
    images or image tokens exceed a visual budget: no pack can hold them, so a run skips them at that
    size (``over_image_budget``)."""
    over = np.zeros(len(rows), dtype=bool)
    if max_images is not None:
        over |= rows["num_images"] > max_images
    if max_image_tokens is not None:
        over |= rows["image_tokens"] > max_image_tokens
    return np.flatnonzero(over).astype(np.int64)


def budget_options(rows: np.ndarray, max_images: int | None, max_image_tokens: int | None) -> dict:
    """``pack()``'s visual budget arguments for these rows (nothing without a budget)."""
    if max_images is None and max_image_tokens is None:
        return {}
    return {
        "images": rows["num_images"].astype(np.int64),
        "image_tokens": rows["image_tokens"].astype(np.int64),
        "max_images_per_pack": max_images,
        "max_image_tokens_per_pack": max_image_tokens,
    }
