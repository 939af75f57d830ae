"""The pack stage: a pack size's plan from the stored lengths alone (the samples kept at that size),
its order balanced over data-parallel ranks, and what the recommended algorithm would save."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from neva_pack.config import PackConfig
from neva_pack.packing import (
    PackCosts, PackingPlan, RECOMMENDED_ALGORITHM, budget_options, modelled_costs, pack, reorder_plan, step_cost_model
)
from neva_pack.commands import AlgorithmSuggestion, BalanceReport, balance_report

__all__ = ["SUGGEST_WHEN_SAVING", "balance", "better_algorithm", "pack_kept"]

SUGGEST_WHEN_SAVING = 0.01
"""Suggest the recommended algorithm when it would need at least this fraction fewer packs."""


def balance(
    settings: PackConfig, plan: PackingPlan, rows: np.ndarray, encoder: str | None = None, family: str | None = None
) -> tuple[PackingPlan, BalanceReport | None]:
    """With --balance_data_parallel N: the plan's packs reordered so that every N consecutive packs
    cost alike -- in modelled step time (--step_cost_model; ``auto`` picks the preset of the run's
    ``encoder`` or ``family``), or with ``attention`` in the LM's attention plus the vision encoder's
    -- and the straggler overheads before (the packer's order) and after, with the modelled step
    time's for a random order, the attention order and the one written."""
    group = settings.balance_data_parallel
    if not group:
        return plan, None
    chosen = rows[plan.indices]
    model = step_cost_model(settings.step_cost_model, encoder, family)
    if model is None:
        costs = PackCosts.of(chosen["length"], plan.offsets, chosen["num_images"], chosen["vision_cost"])
    else:
        costs = modelled_costs(
            model, chosen["length"], plan.offsets, chosen["num_images"], chosen["image_tokens"], chosen["vision_cost"]
        )
    order, report = balance_report(costs, group, settings.step_cost_model, model, settings.seed)
    return reorder_plan(plan, order), report


def pack_kept(settings: PackConfig, padded: np.ndarray, rows: np.ndarray, kept: np.ndarray, size: int) -> PackingPlan:
    """The plan of the samples ``kept`` at this size, its indices into the store's rows (all of
    them when none is left out: the same plan as packing every row), within the visual budgets."""
    plan = pack(
        padded[kept], size, algorithm=settings.packing_algorithm, seed=settings.seed,
        max_samples_per_pack=settings.max_samples_per_pack,
        **budget_options(rows[kept], settings.max_images_per_pack, settings.max_image_tokens_per_pack, settings.max_video_tokens_per_pack),
    )  # fmt: skip
    return replace(plan, indices=kept[plan.indices])


def better_algorithm(
    lengths: np.ndarray, plan: PackingPlan, *, algorithm: str, seed: int, max_samples_per_pack: int | None, **budgets
) -> AlgorithmSuggestion | None:
    """The recommended algorithm, when it packs ``lengths`` into at least SUGGEST_WHEN_SAVING fewer
    packs than ``plan`` (made by ``algorithm``, within the visual ``budgets``: ``budget_options``);
    None otherwise. It is fast enough to run on every run."""
    if algorithm == RECOMMENDED_ALGORITHM:
        return None
    alternative = pack(
        lengths, plan.capacity, RECOMMENDED_ALGORITHM, seed=seed, max_samples_per_pack=max_samples_per_pack, **budgets
    )
    if alternative.num_bins > plan.num_bins * (1 - SUGGEST_WHEN_SAVING):
        return None
    return AlgorithmSuggestion(
        algorithm=RECOMMENDED_ALGORITHM, packs=alternative.num_bins, saving=1 - alternative.num_bins / plan.num_bins
    )
