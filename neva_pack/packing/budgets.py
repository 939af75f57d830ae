"""Visual budgets: at most so many images, image tokens and video tokens in one pack.

With dynamic-resolution encoders one image costs from a few dozen to thousands of positions, and the
vision encoder's memory grows with the images of a pack, not with its length: a pack may fit its
positions and still be too heavy for the encoder. Every packing kernel takes the budgets beside the
capacity, as per-sample values and per-pack limits (0: no limit), one row per budget that binds::

    images       [1, 0, 2]      max_images = 2            a bin holds samples 0 + 1, or 2 alone
    image_tokens [900, 0, 300]  max_image_tokens = 1000
    video_tokens [0, 0, 300]    max_video_tokens = 256     (positions of a sample's video clips' runs)

A clip's run is one of its sample's image runs too: it counts in ``images`` and ``image_tokens`` as a
still image does, and in ``video_tokens`` besides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["NO_BUDGETS", "VisualBudgets", "budget_options", "over_image_budget", "visual_budgets"]

_EMPTY = np.zeros(0, np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class VisualBudgets:
    """Per-sample image counts, image tokens and video tokens, and the limit per pack of each (0: none)."""

    images: np.ndarray
    """int64 images of each sample (read only when ``max_images`` > 0)."""
    image_tokens: np.ndarray
    """int64 image tokens (positions of its image runs) of each sample (read only when ``max_image_tokens`` > 0)."""
    video_tokens: np.ndarray = field(default_factory=lambda: _EMPTY)
    """int64 video tokens (positions of its video clips' runs) of each sample (read only when ``max_video_tokens`` > 0)."""
    max_images: int = 0
    max_image_tokens: int = 0
    max_video_tokens: int = 0

    def pairs(self) -> tuple[tuple[np.ndarray, int], ...]:
        """(per-sample values, limit) of every budget that binds, in a fixed order."""
        every = ((self.images, self.max_images), (self.image_tokens, self.max_image_tokens),
                 (self.video_tokens, self.max_video_tokens))  # fmt: skip
        return tuple((values, limit) for values, limit in every if limit > 0)

    @property
    def active(self) -> bool:
        return bool(self.pairs())

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray]:
        """What every kernel takes after ``max_per_bin``: the per-sample values of the binding
        budgets, one row each (int64, budgets x samples), and their limits (int64, one each)."""
        pairs = self.pairs()
        if not pairs:
            return np.zeros((0, 0), np.int64), _EMPTY
        values = np.ascontiguousarray(np.stack([values for values, _ in pairs]), dtype=np.int64)
        return values, np.array([limit for _, limit in pairs], dtype=np.int64)

    def bins_needed(self, items: np.ndarray | None = None) -> int:
        """ceil(values / limit) of ``items`` (all when None) for every budget, the largest: no plan
        uses fewer bins (0 without budgets)."""
        needed = 0
        for values, limit in self.pairs():
            total = int(values.sum() if items is None else values[items].sum())
            needed = max(needed, -(-total // limit))
        return needed


NO_BUDGETS = VisualBudgets(images=_EMPTY, image_tokens=_EMPTY)
"""No visual budget: every kernel packs by length (and max_samples_per_pack) alone."""

_BUDGETS = (  # (pack()'s limit argument, its per-sample argument, the VisualBudgets fields)
    ("max_images_per_pack", "images", "max_images"),
    ("max_image_tokens_per_pack", "image_tokens", "max_image_tokens"),
    ("max_video_tokens_per_pack", "video_tokens", "max_video_tokens"),
)


def visual_budgets(
    count: int,
    images=None,
    image_tokens=None,
    max_images_per_pack: int | None = None,
    max_image_tokens_per_pack: int | None = None,
    *,
    video_tokens=None,
    max_video_tokens_per_pack: int | None = None,
) -> VisualBudgets:
    """The budgets of ``pack()``'s arguments, checked: ValueError for a budget < 1, a budget without
    its per-sample array, an array of the wrong shape or with negative values, and a sample that is
    over a budget on its own (no pack could hold it)."""
    given = {"images": (images, max_images_per_pack), "image_tokens": (image_tokens, max_image_tokens_per_pack),
             "video_tokens": (video_tokens, max_video_tokens_per_pack)}  # fmt: skip
    if all(limit is None for _, limit in given.values()):
        return NO_BUDGETS
    fields = {}
    for name, array_name, limit_field in _BUDGETS:
        values, limit = given[array_name]
        if limit is None:
            fields[array_name], fields[limit_field] = _EMPTY, 0
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
        fields[array_name], fields[limit_field] = array, int(limit)
    return VisualBudgets(**fields)


def over_image_budget(
    rows: np.ndarray, max_images: int | None, max_image_tokens: int | None, max_video_tokens: int | None = None
) -> np.ndarray:
    """The rows (``num_images``, ``image_tokens`` and, under a video budget, ``video_tokens`` fields;
    a run's as cut for a pack size) whose own images, image tokens or video tokens exceed a visual
    budget: no pack can hold them, so a run skips them at that size (``over_image_budget``)."""
    over = np.zeros(len(rows), dtype=bool)
    if max_images is not None:
        over |= rows["num_images"] > max_images
    if max_image_tokens is not None:
        over |= rows["image_tokens"] > max_image_tokens
    if max_video_tokens is not None:
        over |= rows["video_tokens"] > max_video_tokens
    return np.flatnonzero(over).astype(np.int64)


def budget_options(rows: np.ndarray, max_images: int | None, max_image_tokens: int | None, max_video_tokens: int | None = None) -> dict:
    """``pack()``'s visual budget arguments for these rows (nothing without a budget)."""
    if max_images is None and max_image_tokens is None and max_video_tokens is None:
        return {}
    options = {
        "images": rows["num_images"].astype(np.int64),
        "image_tokens": rows["image_tokens"].astype(np.int64),
        "max_images_per_pack": max_images,
        "max_image_tokens_per_pack": max_image_tokens,
    }
    if max_video_tokens is not None:
        options.update(video_tokens=rows["video_tokens"].astype(np.int64), max_video_tokens_per_pack=max_video_tokens)
    return options
