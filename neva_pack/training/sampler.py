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
       in modelled step time (``packing.step_cost``: the LM's linear layers and attention, the
       projector and the vision encoder, as --balance_data_parallel), steps in random order::

        step      0            1            2
        rank 0  [ 9 8 ]      [ 5 4 2 ]    [ 7 1 ]      each [..] a bin of sample indices,
        rank 1  [ 3 6 ]      [ 0 11 ]     [ 10 12 ]    sum of lengths <= capacity

Each rank's DataLoader yields one bin per step: ``DataLoader(samples, batch_sampler=sampler,
collate_fn=hf_collate(...))`` gives one flattened row of at most ``capacity`` positions.

Visual budgets (``max_images_per_pack``, ``max_image_tokens_per_pack``) hold in every bin of every
step: the packer honours them, and steps 2 and 3 only drop bins, cut bins in two, or deal samples
to new bins that have room for them in positions, samples, images and image tokens alike.
``PackedBatchSampler.for_samples(samples, capacity, ...)`` takes the lengths, images and image
tokens of a ``PackedSamples``, and by default the budgets its output was packed under.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

from neva_pack.packing import (
    AUTO, DEFAULT_TOLERANCE, PackCosts, RECOMMENDED_ALGORITHM, StepCostModel, balance_order, modelled_costs, pack,
    step_cost_model, visual_budgets,
)
from neva_pack.training.sampler_state import STATE_VERSION, check_state, lengths_digest, meta_checksum_of, state_of

__all__ = ["FROM_META", "STATE_VERSION", "EpochPlan", "PackedBatchSampler"]

FROM_META = "meta"
"""``for_samples``: a visual budget taken from the output's meta."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BinLimits:
    """What every bin stays within when samples are dealt to new bins: positions, and the caps of
    ``packing.pack`` (0: none), with the images and image tokens of each position of the plan's
    indices (None without their cap)."""

    capacity: int
    max_samples: int = 0
    images: np.ndarray | None = None
    max_images: int = 0
    image_tokens: np.ndarray | None = None
    max_image_tokens: int = 0


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

    The R bins of a step are balanced by their modelled step time (``step_cost_model``: a
    ``packing.StepCostModel``, a preset's name, a JSON file, ``auto`` -- the preset of ``encoder`` or
    ``family``, else the default one -- or ``attention``: Σ s² plus ``vision_cost``, unweighted, the
    order of old), from the lengths, ``image_tokens`` and ``vision_cost`` (per sample, optional: the
    vision encoder's Σ patches² of its images). ``num_images`` (per sample, optional) lets bins of
    equal cost be balanced by images too, within ``tolerance`` (None: 0 under a model, whose cost
    holds the images already; ``DEFAULT_TOLERANCE`` under ``attention``). ``max_images_per_pack`` (needs ``num_images``)
    and ``max_image_tokens_per_pack`` (needs ``image_tokens``, per sample) cap every bin as
    ``packing.pack`` does. The extra options go to ``packing.pack`` (``max_samples_per_pack``, an
    algorithm's own options). ``meta_checksum``: that of the packed output the lengths come from
    (``for_samples`` sets it), part of the states' fingerprint (``sampler_state.py``).
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
        image_tokens=None,
        vision_cost=None,
        max_images_per_pack: int | None = None,
        max_image_tokens_per_pack: int | None = None,
        tolerance: float | None = None,
        meta_checksum: str | None = None,
        step_cost_model: StepCostModel | str | None = AUTO,
        encoder: str | None = None,
        family: str | None = None,
        **pack_options,
    ):
        if int(num_replicas) != num_replicas or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if rank is not None and (int(rank) != rank or not 0 <= rank < num_replicas):
            raise ValueError(f"rank must be in [0, {num_replicas}) or None, got {rank!r}")
        given = np.asarray(lengths)
        if given.ndim != 1 or not (np.issubdtype(given.dtype, np.integer) or given.size == 0):  # not 1.5, "3", True or NaN
            raise ValueError(f"lengths must be a 1-D sequence of integers, got {given.dtype} of shape {given.shape}")
        self.lengths = given.astype(np.int64)
        self.num_images = np.zeros(len(self.lengths), np.int64) if num_images is None else np.asarray(num_images, np.int64)
        if self.num_images.shape != self.lengths.shape:
            raise ValueError(f"num_images has {len(self.num_images)} entries for {len(self.lengths)} lengths")
        self.image_tokens = None if image_tokens is None else np.asarray(image_tokens)
        self.vision_cost = None if vision_cost is None else np.asarray(vision_cost, np.int64)
        if self.vision_cost is not None and (self.vision_cost.shape != self.lengths.shape or np.any(self.vision_cost < 0)):
            raise ValueError(f"vision_cost must be {len(self.lengths)} non-negative values, one per sample")
        self.budgets = visual_budgets(
            len(self.lengths), None if num_images is None else self.num_images, self.image_tokens,
            max_images_per_pack, max_image_tokens_per_pack,
        )  # fmt: skip
        self.max_images_per_pack = None if max_images_per_pack is None else int(max_images_per_pack)
        self.max_image_tokens_per_pack = None if max_image_tokens_per_pack is None else int(max_image_tokens_per_pack)
        self.capacity, self.num_replicas, self.seed = int(capacity), int(num_replicas), int(seed)
        self.rank = None if rank is None else int(rank)
        self.algorithm, self.drop_last, self.tolerance, self.pack_options = algorithm, bool(drop_last), tolerance, pack_options
        self.meta_checksum = meta_checksum
        self.step_cost = _cost_model(step_cost_model, encoder, family)
        if self.tolerance is None:
            self.tolerance = DEFAULT_TOLERANCE if self.step_cost is None else 0.0
        self._fingerprint: dict | None = None
        self.epoch = 0
        self._next_step = 0  # batches of this epoch handed out: where __iter__ starts
        self._resumed = False  # a loaded state at the end of its epoch resumes with nothing left of it
        self._plan: tuple[int, EpochPlan] | None = None
        self.plan_epoch(0)  # bad settings fail here, not at the first step

    @classmethod
    def for_samples(
        cls,
        samples,
        capacity: int,
        num_replicas: int = 1,
        rank: int | None = 0,
        seed: int = 0,
        algorithm: str = RECOMMENDED_ALGORITHM,
        drop_last: bool = False,
        *,
        max_images_per_pack: int | None | str = FROM_META,
        max_image_tokens_per_pack: int | None | str = FROM_META,
        max_video_tokens_per_pack: int | None | str = FROM_META,
        **options,
    ) -> PackedBatchSampler:
        """A sampler over a ``dataset.PackedSamples``: its lengths, images and image tokens per sample.

        Each budget left at ``FROM_META`` is the one the output was packed under (its meta's; none
        if it had none); a number sets another, None lifts it. An image token budget needs the
        output's image tokens per sample, which outputs written before they were kept lack. A video token
        budget (the output's ``max_video_tokens_per_pack``) is refused in one line: outputs do not keep
        each sample's video tokens, so it cannot be held here; pass None to re-pack without it."""
        meta = samples.meta
        if max_images_per_pack == FROM_META:
            max_images_per_pack = getattr(meta, "max_images_per_pack", None)
        if max_image_tokens_per_pack == FROM_META:
            max_image_tokens_per_pack = getattr(meta, "max_image_tokens_per_pack", None)
        if max_video_tokens_per_pack == FROM_META:
            max_video_tokens_per_pack = getattr(meta, "max_video_tokens_per_pack", None)
        if max_video_tokens_per_pack is not None:
            raise ValueError(
                f"max_video_tokens_per_pack={max_video_tokens_per_pack!r}: an output does not keep the video tokens of "
                "each sample, so the sampler cannot hold that budget; pass max_video_tokens_per_pack=None to re-pack without it"
            )
        if max_image_tokens_per_pack is not None and samples.image_tokens is None:
            raise ValueError(
                f"max_image_tokens_per_pack={max_image_tokens_per_pack!r} needs the image tokens of every sample, "
                "which this output does not keep (written before they were): pack it again, or pass max_image_tokens_per_pack=None"
            )
        return cls(
            samples.lengths, capacity, num_replicas, rank, seed, algorithm, drop_last,
            num_images=samples.num_images, image_tokens=samples.image_tokens, vision_cost=samples.vision_cost,
            max_images_per_pack=max_images_per_pack, max_image_tokens_per_pack=max_image_tokens_per_pack,
            meta_checksum=meta_checksum_of(meta), encoder=getattr(meta, "encoder", None),
            family=(getattr(meta, "image_processor", None) or {}).get("family"), **options,
        )  # fmt: skip

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` next (a resumed position in that same epoch is kept)."""
        if epoch != self.epoch:
            self.epoch, self._next_step = int(epoch), 0

    def plan_epoch(self, epoch: int) -> EpochPlan:
        """Every rank's bins for ``epoch``: a pure function of the lengths, the settings and ``epoch``."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = np.random.default_rng([self.seed, int(epoch)])
        plan = pack(
            self.lengths, self.capacity, self.algorithm, seed=int(rng.integers(2**63)), **self._budget_options(), **self.pack_options
        )
        offsets, indices = plan.offsets, plan.indices
        loads = plan.bin_loads
        costs = PackCosts.of(self.lengths[indices], offsets, self.num_images[indices])
        extra = -len(loads) % self.num_replicas
        dropped = np.zeros(0, np.int64)
        if extra and self.drop_last:
            offsets, indices, dropped = _without_least_full(offsets, indices, loads, self.num_replicas - extra)
        elif extra:
            spread = _spread_over_steps(offsets, self.lengths[indices], extra, self.num_replicas, self._limits(indices))
            if spread is None:
                offsets = _cut_heaviest(offsets, self.lengths[indices], costs.attention, extra)
            else:
                offsets, positions = spread
                indices = indices[positions]
        sizes = self.lengths[indices]
        vision_cost = None if self.vision_cost is None else self.vision_cost[indices]
        if self.step_cost is None:
            costs = PackCosts.of(sizes, offsets, self.num_images[indices], vision_cost)
        else:
            image_tokens = None if self.image_tokens is None else self.image_tokens[indices]
            costs = modelled_costs(self.step_cost, sizes, offsets, self.num_images[indices], image_tokens, vision_cost)
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
        has handed fewer to training: store the trainer's own step count as ``step`` then), with the
        fingerprint of what the epochs are planned over (``sampler_state.py``)."""
        return state_of(self._settings(), self.epoch, self._next_step)

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s epoch and step, once its fingerprint is this sampler's and its epoch
        and step are in range; ValueError in one line naming the field otherwise."""
        def batches(epoch: int) -> int:
            return self.plan_epoch(epoch).num_steps * (self.num_replicas if self.rank is None else 1)

        self.epoch, self._next_step = check_state(state, self._settings(), batches)
        self._resumed = True

    def _budget_options(self) -> dict:
        """``pack()``'s visual budget arguments (nothing without a budget: the plan of old)."""
        if not self.budgets.active:
            return {}
        return {
            "images": self.num_images,
            "image_tokens": self.image_tokens,
            "max_images_per_pack": self.max_images_per_pack,
            "max_image_tokens_per_pack": self.max_image_tokens_per_pack,
        }

    def _limits(self, indices: np.ndarray) -> BinLimits:
        """What a bin of the plan must stay within, per position of the plan's ``indices``."""
        budgets = self.budgets
        return BinLimits(
            capacity=self.capacity,
            max_samples=int(self.pack_options.get("max_samples_per_pack") or 0),
            images=budgets.images[indices] if budgets.max_images else None,
            max_images=budgets.max_images,
            image_tokens=budgets.image_tokens[indices] if budgets.max_image_tokens else None,
            max_image_tokens=budgets.max_image_tokens,
        )

    def _settings(self) -> dict:
        """The fingerprint of the plan: every input and setting it is a function of (JSON-able)."""
        if self._fingerprint is None:
            self._fingerprint = {
                "seed": self.seed,
                "capacity": self.capacity,
                "num_replicas": self.num_replicas,
                "batches_of": "every rank" if self.rank is None else "one rank",
                "algorithm": self.algorithm,
                "drop_last": self.drop_last,
                "step_cost_model": None if self.step_cost is None else self.step_cost.fingerprint,
                "tolerance": float(self.tolerance),
                "pack_options": {name: repr(value) for name, value in sorted(self.pack_options.items())},
                "num_samples": len(self.lengths),
                "total_length": int(self.lengths.sum()),
                "max_images_per_pack": self.max_images_per_pack,
                "max_image_tokens_per_pack": self.max_image_tokens_per_pack,
                "vision_cost": None if self.vision_cost is None else int(self.vision_cost.sum()),
                "lengths_digest": lengths_digest(self.lengths, self.num_images, self.image_tokens, self.vision_cost),
                "meta_checksum": self.meta_checksum,
            }
        return self._fingerprint


def _cost_model(choice, encoder, family) -> StepCostModel | None:
    """The sampler's step cost model: one given, or ``packing.step_cost_model`` of a name (None: attention)."""
    if isinstance(choice, StepCostModel):
        return choice
    return step_cost_model(choice, encoder, family)


def _without_least_full(offsets, indices, loads, count):
    """Drop the ``count`` least full bins (of equal loads, those of fewest samples): (offsets, indices,
    dropped samples)."""
    drop = np.sort(np.lexsort((np.diff(offsets), loads))[:count])
    keep = np.ones(len(loads), bool)
    keep[drop] = False
    member = np.repeat(keep, np.diff(offsets))
    sizes = np.diff(offsets)[keep]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), indices[member], indices[~member]


def _spread_over_steps(offsets, sizes, extra, replicas, limits: BinLimits):
    """``extra`` more bins, as whole steps of light bins: the ``replicas - extra`` bins of most samples
    (or R more of them, while they hold fewer samples than bins to make) are taken apart and their
    samples dealt longest first, each to the least loaded of ``replicas`` new bins (LPT) that has
    room for it (``limits``: positions, samples, images, image tokens). Returns (offsets, positions
    into the plan's indices), or None when a sample finds no bin with room.

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
    piece_of = _deal(dealt, sizes, pieces, limits)
    if piece_of is None:
        return None
    positions = np.concatenate([np.flatnonzero(~member), dealt[np.argsort(piece_of, kind="stable")]])
    new_counts = np.concatenate([counts[~chosen], np.bincount(piece_of, minlength=pieces)])
    return np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int64), positions


def _deal(dealt, sizes, pieces, limits: BinLimits):
    """The piece of each of ``dealt`` (positions, in dealing order): the least loaded one with room
    for it, ties to the lowest piece; None when one has no room anywhere."""
    caps = [(limits.capacity, sizes)]  # a piece's load is always checked first: without caps, plain LPT
    for values, cap in ((None, limits.max_samples), (limits.images, limits.max_images), (limits.image_tokens, limits.max_image_tokens)):
        if cap:
            caps.append((cap, np.ones(len(sizes), np.int64) if values is None else values))
    used = np.zeros((len(caps), pieces), np.int64)  # load, then each capped quantity, of every piece
    heap = [(0, piece) for piece in range(pieces)]
    piece_of = np.empty(len(dealt), np.int64)
    for k, position in enumerate(dealt.tolist()):
        need = [int(values[position]) for _, values in caps]
        passed = []
        while heap:
            load, piece = heapq.heappop(heap)
            if all(used[d, piece] + need[d] <= cap for d, (cap, _) in enumerate(caps)):
                break
            passed.append((load, piece))
        else:
            return None
        for entry in passed:
            heapq.heappush(heap, entry)
        used[:, piece] += need
        piece_of[k] = piece
        heapq.heappush(heap, (load + need[0], piece))
    return piece_of


def _cut_heaviest(offsets, sizes, attention, count):
    """``count`` more bins when ``_spread_over_steps`` cannot: the bins of most attention work (two
    samples or more) cut in two where their load passes half; if too few such bins, further cuts
    between any two samples of a bin. Each part holds fewer of everything than its bin: every cap
    the bin kept, the parts keep."""
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
