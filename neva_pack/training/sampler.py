"""PackedBatchSampler: packs planned afresh every epoch over sample lengths, balanced across ranks.

The online counterpart of our offline packs (axolotl's multipack, multipack_sampler): the dataset
stays a dataset of samples (``dataset.PackedSamples`` for a packed output, or any sample dataset
with known lengths), and each epoch the sampler

    1. packs every length into bins of at most ``capacity`` with our packers (seeded by seed and
       epoch: every rank and machine computes the same plan, no communication);
    2. makes the bin count a multiple of the ranks, so that every rank runs the same number of
       steps: ``drop_last`` drops the least full bins (their samples are listed in ``dropped``),
       otherwise a few bins are taken apart and dealt as whole steps of lighter bins;
    3. orders the bins with ``packing.balance.balance_order``: the R bins of one step cost alike
       in attention (sum of squared sample lengths, as --balance_data_parallel), steps in random order::

        step      0            1            2
        rank 0  [ 9 8 ]      [ 5 4 2 ]    [ 7 1 ]      each [..] a bin of sample indices,
        rank 1  [ 3 6 ]      [ 0 11 ]     [ 10 12 ]    sum of lengths <= capacity

Each rank's DataLoader yields one bin per step: ``DataLoader(samples, batch_sampler=sampler,
collate_fn=hf_collate(...))`` gives one flattened row of at most ``capacity`` positions.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

from neva_pack.packing import RECOMMENDED_ALGORITHM, pack
from neva_pack.packing.balance import DEFAULT_TOLERANCE, PackCosts, balance_order

__all__ = ["EpochPlan", "PackedBatchSampler", "STATE_VERSION"]

STATE_VERSION = 1
"""Version of ``state_dict``'s layout."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochPlan:
    """The bins of one epoch for every rank, step-major: bin s * num_replicas + r is rank r's step s."""

    offsets: np.ndarray
    """int64 (num_steps * num_replicas + 1): bin b holds indices[offsets[b]:offsets[b + 1]]."""
    indices: np.ndarray
    """int64 sample indices, grouped by bin."""
    loads: np.ndarray
    """int64 sum of the lengths of each bin."""
    dropped: np.ndarray
    """int64 sample indices left out of this epoch (drop_last only), sorted."""
    num_replicas: int
    """Ranks the bins are dealt to."""
    capacity: int
    """Most positions of one bin."""

    @property
    def num_steps(self) -> int:
        return (len(self.offsets) - 1) // self.num_replicas

    @property
    def efficiency(self) -> float:
        """Positions holding data / positions of every rank's every step (1.0 for an empty epoch)."""
        slots = (len(self.offsets) - 1) * self.capacity
        return float(self.loads.sum() / slots) if slots else 1.0

    def batch(self, step: int, rank: int) -> list[int]:
        b = step * self.num_replicas + rank
        return self.indices[self.offsets[b] : self.offsets[b + 1]].tolist()


class PackedBatchSampler(Sampler[list[int]]):
    """Per-rank batches of sample indices whose lengths sum to at most ``capacity``.

    ``rank=None`` yields every rank's batches, step by step (step 0 rank 0, step 0 rank 1, ...):
    for loaders that deal batches to processes round robin, as accelerate does for a Trainer
    running several processes (its BatchSamplerShard gives process r the batches r, r + R, ...).

    ``num_images`` (per sample, optional) lets bins of equal attention be balanced by images too
    (the vision encoder's work), within ``tolerance``. The extra options go to ``packing.pack``
    (``max_samples_per_pack``, an algorithm's own options).
    """

    def __init__(
        self,
        lengths,
        capacity: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        algorithm: str = RECOMMENDED_ALGORITHM,
        drop_last: bool = False,
        *,
        num_images=None,
        tolerance: float = DEFAULT_TOLERANCE,
        **pack_options,
    ):
        if int(num_replicas) != num_replicas or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if rank is not None and (int(rank) != rank or not 0 <= rank < num_replicas):
            raise ValueError(f"rank must be in [0, {num_replicas}) or None, got {rank!r}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.num_images = np.zeros(len(self.lengths), np.int64) if num_images is None else np.asarray(num_images, np.int64)
        if self.num_images.shape != self.lengths.shape:
            raise ValueError(f"num_images has {len(self.num_images)} entries for {len(self.lengths)} lengths")
        self.capacity, self.num_replicas, self.seed = int(capacity), int(num_replicas), int(seed)
        self.rank = None if rank is None else int(rank)
        self.algorithm, self.drop_last, self.tolerance, self.pack_options = algorithm, bool(drop_last), tolerance, pack_options
        self.epoch = 0
        self._next_step = 0  # batches of this epoch handed out: where __iter__ starts
        self._resumed = False  # a loaded state at the end of its epoch resumes with nothing left of it
        self._plan: tuple[int, EpochPlan] | None = None
        self.plan_epoch(0)  # bad settings fail here, not at the first step

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` next (a resumed position in that same epoch is kept)."""
        if epoch != self.epoch:
            self.epoch, self._next_step = int(epoch), 0

    def plan_epoch(self, epoch: int) -> EpochPlan:
        """Every rank's bins for ``epoch``: a pure function of the lengths, the settings and ``epoch``."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = np.random.default_rng([self.seed, int(epoch)])
        plan = pack(self.lengths, self.capacity, self.algorithm, seed=int(rng.integers(2**63)), **self.pack_options)
        offsets, indices = plan.offsets, plan.indices
        loads = plan.bin_loads
        costs = PackCosts.of(self.lengths[indices], offsets, self.num_images[indices])
        extra = -len(loads) % self.num_replicas
        dropped = np.zeros(0, np.int64)
        if extra and self.drop_last:
            offsets, indices, dropped = _without_least_full(offsets, indices, loads, self.num_replicas - extra)
        elif extra:
            spread = _spread_over_steps(offsets, self.lengths[indices], self.capacity, extra, self.num_replicas)
            if spread is None:
                offsets = _cut_heaviest(offsets, self.lengths[indices], costs.attention, extra)
            else:
                offsets, positions = spread
                indices = indices[positions]
        sizes = self.lengths[indices]
        costs = PackCosts.of(sizes, offsets, self.num_images[indices])
        order = balance_order(costs, self.num_replicas, rng, self.tolerance).reshape(-1, self.num_replicas)
        order = np.take_along_axis(order, np.argsort(rng.random(order.shape), axis=1), axis=1).reshape(-1)
        lengths_per_bin = np.diff(offsets)[order]
        new_offsets = np.concatenate([[0], np.cumsum(lengths_per_bin)]).astype(np.int64)
        gather = np.repeat(offsets[:-1][order] - new_offsets[:-1], lengths_per_bin) + np.arange(new_offsets[-1])
        result = EpochPlan(
            offsets=new_offsets,
            indices=indices[gather],
            loads=costs.tokens[order],
            dropped=np.sort(dropped),
            num_replicas=self.num_replicas,
            capacity=self.capacity,
        )
        self._plan = (int(epoch), result)
        return result

    @property
    def dropped(self) -> np.ndarray:
        """Sample indices the current epoch leaves out (empty unless drop_last)."""
        return self.plan_epoch(self.epoch).dropped

    def __len__(self) -> int:
        """Batches of the current epoch: its steps (the same on every rank), times the ranks for rank=None."""
        plan = self.plan_epoch(self.epoch)
        return plan.num_steps * (self.num_replicas if self.rank is None else 1)

    def __iter__(self):
        plan, count = self.plan_epoch(self.epoch), len(self)
        if self._next_step >= count and not self._resumed:
            self._next_step = 0  # a finished epoch iterated again (no set_epoch) repeats, as DistributedSampler's
        self._resumed = False
        while self._next_step < count:
            position = self._next_step
            self._next_step += 1
            if self.rank is None:  # every rank's bins, step by step
                yield plan.batch(position // self.num_replicas, position % self.num_replicas)
            else:
                yield plan.batch(position, self.rank)

    def state_dict(self) -> dict:
        """Where this rank is: the epoch and the steps handed out in it (a DataLoader that prefetches
        has handed fewer to training: store the trainer's own step count as ``step`` then)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self._next_step,
            **self._settings(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s epoch and step; settings that change the plan must match."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r}, this neva_pack reads {STATE_VERSION}")
        for name, value in self._settings().items():
            if state.get(name) != value:
                raise ValueError(f"the sampler state was saved with {name}={state.get(name)!r}, this sampler has {value!r}")
        self.epoch, self._next_step, self._resumed = int(state["epoch"]), int(state["step"]), True

    def _settings(self) -> dict:
        return {
            "seed": self.seed,
            "capacity": self.capacity,
            "num_replicas": self.num_replicas,
            "algorithm": self.algorithm,
            "drop_last": self.drop_last,
            "num_samples": len(self.lengths),
            "total_length": int(self.lengths.sum()),
        }


def _without_least_full(offsets, indices, loads, count):
    """Drop the ``count`` least full bins (of equal loads, those of fewest samples): (offsets, indices,
    dropped samples)."""
    drop = np.sort(np.lexsort((np.diff(offsets), loads))[:count])
    keep = np.ones(len(loads), bool)
    keep[drop] = False
    member = np.repeat(keep, np.diff(offsets))
    sizes = np.diff(offsets)[keep]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), indices[member], indices[~member]


def _spread_over_steps(offsets, sizes, capacity, extra, replicas):
    """``extra`` more bins, as whole steps of light bins: the ``replicas - extra`` bins of most samples
    (or R more of them, while they hold fewer samples than bins to make) are taken apart and their
    samples dealt longest first, each to the least loaded of ``replicas`` new bins (LPT). Returns
    (offsets, positions into the plan's indices), or None when a new bin would pass the capacity.

    Every step then holds either full bins or alike light ones, so no rank waits on a step's fuller
    bins (cutting single bins in two would put half-empty bins beside full ones).
    """
    counts = np.diff(offsets)
    by_count = np.argsort(-counts, kind="stable")
    taken, pieces = replicas - extra, replicas
    while counts[by_count[:taken]].sum() < pieces:
        if taken + replicas > len(counts):
            return None
        taken, pieces = taken + replicas, pieces + replicas
    chosen = np.zeros(len(counts), bool)
    chosen[by_count[:taken]] = True
    member = np.repeat(chosen, counts)
    dealt = np.flatnonzero(member)
    dealt = dealt[np.argsort(-sizes[dealt], kind="stable")]
    heap = [(0, piece) for piece in range(pieces)]
    piece_of = np.empty(len(dealt), np.int64)
    for k, position in enumerate(dealt.tolist()):
        load, piece = heapq.heappop(heap)
        piece_of[k] = piece
        heapq.heappush(heap, (load + int(sizes[position]), piece))
    if max(load for load, _ in heap) > capacity:
        return None
    positions = np.concatenate([np.flatnonzero(~member), dealt[np.argsort(piece_of, kind="stable")]])
    new_counts = np.concatenate([counts[~chosen], np.bincount(piece_of, minlength=pieces)])
    return np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int64), positions


def _cut_heaviest(offsets, sizes, attention, count):
    """``count`` more bins when ``_spread_over_steps`` cannot: the bins of most attention work (two
    samples or more) cut in two where their load passes half; if too few such bins, further cuts
    between any two samples of a bin."""
    splittable = np.flatnonzero(np.diff(offsets) >= 2)
    chosen = splittable[np.argsort(-attention[splittable], kind="stable")[:count]]
    cuts = []
    for b in chosen.tolist():
        start, end = int(offsets[b]), int(offsets[b + 1])
        prefix = np.cumsum(sizes[start:end])
        cut = int(np.searchsorted(prefix, prefix[-1] / 2))  # first sample whose end passes half the load
        cuts.append(start + min(max(cut, 0) + 1, end - start - 1))
    boundaries = set(offsets.tolist()) | set(cuts)
    if len(cuts) < count:
        free = [i for i in range(1, int(offsets[-1])) if i not in boundaries]
        if len(free) < count - len(cuts):
            raise ValueError(
                f"{len(offsets) - 1} bins of {int(offsets[-1])} samples cannot be dealt evenly to the ranks "
                "(fewer samples than ranks x steps): use drop_last=True or fewer ranks"
            )
        boundaries |= set(free[: count - len(cuts)])
    return np.asarray(sorted(boundaries), dtype=np.int64)
