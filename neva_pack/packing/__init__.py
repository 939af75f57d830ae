"""Packing: group sample indices into bins of at most ``capacity`` positions.

The packer sees only lengths (and, under visual budgets, image counts, image tokens and video tokens), never
tokens or pixels::

    from neva_pack.packing import pack
    plan = pack(lengths, 4096, algorithm="first_fit_shuffle", seed=0)
    plan.bin(0)        # sample indices of the first pack
    pack(lengths, 4096, images=num_images, max_images_per_pack=8)   # at most 8 images a pack
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from neva_pack.packing import algorithms, kernels
from neva_pack.packing.budgets import NO_BUDGETS, budget_options, over_image_budget, visual_budgets
from neva_pack.packing.plan import PackingPlan

from neva_pack.packing.algorithms import DEFAULT_CHUNK_SIZE, first_fit_shuffle
from neva_pack.packing.alignment import aligned_capacity, alignment_multiple, fixed_row_length, padded_lengths, padded_view, real_positions, with_padding
from neva_pack.packing.balance import DEFAULT_TOLERANCE, PackCosts, balance_order, reorder_plan, straggler_overhead
from neva_pack.packing.invariant_kernels import fast_pack_problems, pack_is_sound
from neva_pack.packing.invariants import PackSpec, accounting_problem, pack_problems
from neva_pack.packing.plan_table import PlanTable, read_plan_table, write_plan_table
from neva_pack.packing.step_cost import (
    ATTENTION, AUTO, StepCostModel, StepOverheads, Tower, WORTH_IT, modelled_costs, preset_names, step_cost_model, step_overheads,
)
from neva_pack.packing.sum_of_squares import CTZ_TABLE, sum_of_squares_bins, sum_of_squares_reference

ALGORITHMS: dict[str, Callable[..., Any]] = {
    "first_fit_decreasing": algorithms.first_fit_decreasing,
    "first_fit_shuffle": algorithms.first_fit_shuffle,
    "shuffle_and_pack": algorithms.shuffle_and_pack,
    "near_optimal": algorithms.near_optimal,
}
"""Registry name -> algorithm. The command line's choices come from here."""

DEFAULT_ALGORITHM = "first_fit_shuffle"
"""NeMo's default, kept as ours for compatibility."""
RECOMMENDED_ALGORITHM = "near_optimal"
"""Fewest packs: within 0.05% of the lower bound on LLaVA-like data, never worse than FFD."""


def pack(
    lengths,
    capacity: int,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: int = 0,
    max_samples_per_pack: int | None = None,
    *,
    images=None,
    image_tokens=None,
    max_images_per_pack: int | None = None,
    max_image_tokens_per_pack: int | None = None,
    video_tokens=None,
    max_video_tokens_per_pack: int | None = None,
    **options: Any,
) -> PackingPlan:
    """Pack ``lengths`` (one per sample) into bins of at most ``capacity``; with visual budgets,
    every bin also holds at most ``max_images_per_pack`` images, ``max_image_tokens_per_pack``
    image tokens and ``max_video_tokens_per_pack`` video tokens (``images``, ``image_tokens``,
    ``video_tokens``: one count per sample; ignored without their budget). A video clip's run counts
    in the image budgets too, as one image of its positions.

    Raises ValueError for an unknown algorithm, a capacity < 1, a length < 1, any length
    above the capacity (the pipeline truncates before packing; the packer never drops a
    sample), or a sample over a visual budget on its own (the pipeline skips those first).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    if int(capacity) != capacity or capacity < 1:
        raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
    capacity = int(capacity)
    max_per_bin = 0 if max_samples_per_pack is None else int(max_samples_per_pack)
    if max_samples_per_pack is not None and max_per_bin < 1:
        raise ValueError(f"max_samples_per_pack must be >= 1, got {max_samples_per_pack!r}")
    lengths = _validated_lengths(lengths, capacity)
    budgets = visual_budgets(
        len(lengths), images, image_tokens, max_images_per_pack, max_image_tokens_per_pack,
        video_tokens=video_tokens, max_video_tokens_per_pack=max_video_tokens_per_pack,
    )
    rng = np.random.default_rng(seed)
    order, bin_of_pos, num_bins = ALGORITHMS[algorithm](lengths, capacity, rng, max_per_bin, budgets, **options)
    offsets, indices, loads = kernels.group_by_bin(lengths, order, bin_of_pos, num_bins)
    return PackingPlan(
        offsets=offsets, indices=indices, bin_loads=loads, capacity=capacity, algorithm=algorithm, seed=seed
    )


def _validated_lengths(lengths, capacity: int) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.size:
        if array.min() < 1:
            bad = int(np.argmin(array))
            raise ValueError(f"sample {bad} has length {int(array[bad])}; every length must be >= 1")
        if array.max() > capacity:
            too_long = np.flatnonzero(array > capacity)
            raise ValueError(
                f"{too_long.size} sample(s) longer than the capacity {capacity} "
                f"(first: sample {int(too_long[0])}, length {int(array[too_long[0]])}); truncate them before packing"
            )
    return np.ascontiguousarray(array)

__all__ = [
    "step_overheads",
    "step_cost_model",
    "preset_names",
    "modelled_costs",
    "WORTH_IT",
    "Tower",
    "StepOverheads",
    "StepCostModel",
    "AUTO",
    "ATTENTION",
    "ALGORITHMS",
    "CTZ_TABLE",
    "DEFAULT_ALGORITHM",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_TOLERANCE",
    "NO_BUDGETS",
    "PackCosts",
    "PackSpec",
    "PackingPlan",
    "PlanTable",
    "RECOMMENDED_ALGORITHM",
    "accounting_problem",
    "aligned_capacity",
    "alignment_multiple",
    "balance_order",
    "budget_options",
    "fast_pack_problems",
    "first_fit_shuffle",
    "fixed_row_length",
    "over_image_budget",
    "pack",
    "pack_is_sound",
    "pack_problems",
    "padded_lengths",
    "padded_view",
    "read_plan_table",
    "real_positions",
    "reorder_plan",
    "straggler_overhead",
    "sum_of_squares_bins",
    "sum_of_squares_reference",
    "visual_budgets",
    "with_padding",
    "write_plan_table",
]
