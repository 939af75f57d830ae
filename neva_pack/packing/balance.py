"""Order packs so that data-parallel ranks wait for each other as little as possible.

With N data-parallel ranks and one pack per rank per micro-step (packed training runs with
micro_batch_size 1 and a sequential sampler), the packs at positions kN .. kN+N-1 of the epoch run
together and the step lasts as long as the most expensive of them. Two full packs can differ
several-fold in attention work (sum of squared sample lengths), so a random order wastes

    straggler overhead = sum over steps of (max - mean) / sum over steps of mean

of the attention time (35% for N = 8, 120% for N = 64 on LLaVA-665K-like packs of 4096).
A rank runs its pack's images through the vision encoder and then the pack through the LM, and
the ranks meet at the gradient all-reduce, so what a rank costs is both: its *step cost* is the
modelled step time (``PackCosts.modelled``, from ``step_cost.py``: the LM's linear layers and
attention, the projector and the vision encoder, in FLOPs), or without a model the LM's attention
plus the encoder's (``vision``: sum over images of patches squared, per encoder pass; zero without
images), the order of earlier releases. ``balance_order`` makes each group of N consecutive packs alike,
without sorting the epoch::

    1. packs sorted by step cost (ties in seeded random order), cut into groups of N
    2. consecutive groups whose step cost differs by at most ``tolerance`` (relative) form a
       block; inside a block the packs are sorted again by vision cost, images, then tokens,
       and cut into groups again: the vision encoder (hence the LM's attention too) and the
       linear layers are balanced as well, at a bounded step cost (each such group's
       max - mean <= tolerance * mean)
    3. the groups, in a seeded random order; the short last group (N does not divide the
       number of packs) stays last

Step 1 alone gives the smallest step-cost overhead any order can have (cutting a sorted list
into consecutive groups minimises the sum of the group maxima); step 2 adds at most
``tolerance`` to it. Without vision costs the step cost is the attention. Step 3 keeps the order random at the scale of groups, so training sees no
length curriculum. Pure: costs in, permutation out, an explicit np.random.Generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_TOLERANCE = 0.01
"""Relative attention spread allowed inside a block re-sorted by images and tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackCosts:
    """What one pack costs on its rank, per pack (in plan order)."""

    attention: np.ndarray
    """int64 sum of squared sample lengths: causal attention work."""
    tokens: np.ndarray
    """int64 positions: linear layers' work."""
    images: np.ndarray
    """int64 images: the vision encoder's batch."""
    vision: np.ndarray | None = None
    """int64 sum over the pack's images of patches squared (per encoder pass): the vision encoder's
    attention work; None: not known (balanced as zero)."""
    modelled: np.ndarray | None = None
    """float64 modelled step time of the pack (``step_cost.modelled_costs``: FLOPs of the LM, the
    projector and the vision encoder); None: no model (the step cost is attention + vision)."""

    @classmethod
    def of(cls, lengths: np.ndarray, offsets: np.ndarray, num_images: np.ndarray, vision_cost=None) -> "PackCosts":
        """From per-sample lengths, image counts and (optional) vision costs in pack order, and the
        plan's offsets."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return cls(
            attention=_per_pack(lengths * lengths, offsets),
            tokens=_per_pack(lengths, offsets),
            images=_per_pack(np.asarray(num_images, dtype=np.int64), offsets),
            vision=None if vision_cost is None else _per_pack(np.asarray(vision_cost, dtype=np.int64), offsets),
        )

    @property
    def step(self) -> np.ndarray:
        """What a rank spends on the pack: its modelled step time, or without a model the LM's
        attention plus the vision encoder's (int64)."""
        if self.modelled is not None:
            return self.modelled
        return self.attention if self.vision is None else self.attention + self.vision


def _per_pack(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values`` over each pack's slice offsets[p]:offsets[p + 1]."""
    if len(offsets) < 2:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(values, np.asarray(offsets[:-1], dtype=np.int64))


def straggler_overhead(cost: np.ndarray, group_size: int, order: np.ndarray | None = None) -> float:
    """sum over whole steps of (max - mean) / sum of mean, packs taken ``group_size`` at a time in
    ``order`` (default: as given). A last incomplete step is left out (it is not a full step)."""
    cost = np.asarray(cost, dtype=np.float64)
    if order is not None:
        cost = cost[order]
    steps = len(cost) // group_size
    if steps == 0:
        return 0.0
    groups = cost[: steps * group_size].reshape(steps, group_size)
    mean = groups.mean(axis=1)
    total = mean.sum()
    return float((groups.max(axis=1) - mean).sum() / total) if total > 0 else 0.0


def balance_order(
    costs: PackCosts,
    group_size: int,
    rng: np.random.Generator,
    tolerance: float = DEFAULT_TOLERANCE,
) -> np.ndarray:
    """A permutation of the packs in which every ``group_size`` consecutive packs cost alike.

    ``tolerance=0`` balances the step cost alone (the least step-cost overhead of any order; the
    attention's when no vision cost is given).
    """
    attention = np.asarray(costs.step, dtype=np.float64)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    count = len(attention)
    shuffled = rng.permutation(count).astype(np.int64)
    ordered = shuffled[np.argsort(-attention[shuffled], kind="stable")]
    num_groups = count // group_size
    whole = num_groups * group_size
    first = 0
    while first < num_groups:  # step 2: blocks of groups within tolerance, re-sorted by vision, images, tokens
        last = first + 1
        while last < num_groups and _within(attention, ordered, first * group_size, (last + 1) * group_size - 1, tolerance):
            last += 1
        if last - first > 1:
            block = ordered[first * group_size : last * group_size]
            vision = np.zeros(len(block), np.int64) if costs.vision is None else np.asarray(costs.vision)[block]
            keys = np.lexsort((-np.asarray(costs.tokens)[block], -np.asarray(costs.images)[block], -vision))
            ordered[first * group_size : last * group_size] = block[keys]
        first = last
    groups = ordered[:whole].reshape(num_groups, group_size)
    return np.concatenate([groups[rng.permutation(num_groups)].reshape(-1), ordered[whole:]])


def _within(attention: np.ndarray, ordered: np.ndarray, top: int, bottom: int, tolerance: float) -> bool:
    """Whether the packs ordered[top..bottom] (sorted by decreasing attention) differ by <= tolerance."""
    high, low = attention[ordered[top]], attention[ordered[bottom]]
    return high - low <= tolerance * low


def reorder_plan(plan, order: np.ndarray):
    """The same bins as ``plan``, in ``order`` (a permutation of its bin numbers)."""
    from dataclasses import replace

    order = np.asarray(order, dtype=np.int64)
    sizes = plan.samples_per_bin[order]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    starts = plan.offsets[:-1][order]
    indices = plan.indices[np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])]
    return replace(plan, offsets=offsets, indices=indices, bin_loads=plan.bin_loads[order])
