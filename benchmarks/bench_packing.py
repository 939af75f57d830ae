#!/usr/bin/env python
"""Packing benchmark: every registered algorithm against a pure-Python port of NeMo's
first_fit_shuffle, on LLaVA-like and SFT-like length distributions, in one run.

    python benchmarks/bench_packing.py [--reference-chunks 1] [--repeats 3]

For each distribution and capacity it prints: packs, the lower bound ceil(sum / capacity),
packs / lower bound, efficiency, mean and max samples per pack, a mixing measure, the time
(median of --repeats runs after a warm-up; the first call's compile / cache-load time is
printed separately) and the speed-up over the reference.

The reference (NeMo's first_fit_shuffle: shuffle, then first fit with completed-bin pruning
over chunks of 20,000, in Python) takes minutes on 665K samples, so it runs on the first
--reference-chunks chunks only and its time is extrapolated linearly to all chunks (chunks
are independent and NeMo's threads do not run Python in parallel). Its packs are those of our
first_fit_shuffle, which is checked to give exactly the same bins on the chunks it ran.

Mixing: Spearman correlation between a pack's position in the output and the mean sample
length in it (0 = packs in no length order; FFD is strongly negative: longest first), and
the share of packs holding samples both longer and shorter than the mean length.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributions import llava_like, sft_like  # noqa: E402

from neva_pack.packing import ALGORITHMS, kernels, pack  # noqa: E402
from neva_pack.packing import DEFAULT_CHUNK_SIZE  # noqa: E402
from neva_pack.packing import NO_BUDGETS  # noqa: E402


def reference_first_fit(seq_lens: list[int], capacity: int) -> list[list[int]]:
    """NeMo's first fit with completed-bin pruning, kept operation for operation (bins hold
    lengths and their sums are recomputed at every look, the scan walks a copy of the list and
    marks pruned bins for removal), except that bins hold (index, length) pairs so the result
    can be compared bin by bin."""
    shortest = min(seq_lens)
    completed_bins = []
    bins = []
    for i, length in enumerate(seq_lens):
        found = False
        for k, members in enumerate(bins[:]):
            load = sum(m[1] for m in members)
            if load + shortest > capacity:
                completed_bins.append(members)
                bins[k] = "TO_REMOVE"
                continue
            if load + length <= capacity:
                bins[k].append((i, length))
                found = True
                break
        if not found:
            bins.append([(i, length)])
        bins = [b for b in bins if b != "TO_REMOVE"]
    return [[i for i, _ in members] for members in completed_bins + bins]


def run_reference(lengths: np.ndarray, capacity: int, seed: int, chunks: int) -> dict:
    order = np.random.default_rng(seed).permutation(len(lengths))
    total_chunks = -(-len(lengths) // DEFAULT_CHUNK_SIZE)
    ran = min(chunks, total_chunks)
    seconds = 0.0
    identical = True
    for c in range(ran):
        chunk = order[c * DEFAULT_CHUNK_SIZE : (c + 1) * DEFAULT_CHUNK_SIZE]
        chunk_lengths = lengths[chunk].tolist()
        start = time.perf_counter()
        bins = reference_first_fit(chunk_lengths, capacity)
        seconds += time.perf_counter() - start
        # our kernel on the same chunk order must give the very same bins
        ranks, num_bins = kernels.first_fit_ranks(lengths, chunk.astype(np.int64), capacity, 0, *NO_BUDGETS.kernel_args())
        positions = np.arange(len(chunk), dtype=np.int64)
        offsets, ours, _ = kernels.group_by_bin(lengths[chunk], positions, ranks, num_bins)
        mine = sorted(tuple(sorted(ours[offsets[b] : offsets[b + 1]].tolist())) for b in range(num_bins))
        identical &= mine == sorted(tuple(sorted(b)) for b in bins)
    return {"seconds": seconds * total_chunks / ran, "chunks_run": ran, "chunks": total_chunks, "identical": identical}


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks with ties sharing their mean rank (full packs share a mean length often)."""
    unique, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts
    return (first + (counts - 1) / 2)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(average_ranks(x), average_ranks(y))[0, 1])


def mixing(plan, lengths: np.ndarray) -> tuple[float, float]:
    per_pack = plan.samples_per_bin
    members = lengths[plan.indices]
    means = np.add.reduceat(members, plan.offsets[:-1]) / per_pack
    correlation = spearman(np.arange(plan.num_bins), means) if plan.num_bins > 2 else 0.0
    mean = lengths.mean()
    above = np.add.reduceat((members > mean).astype(np.int64), plan.offsets[:-1])
    below = np.add.reduceat((members < mean).astype(np.int64), plan.offsets[:-1])
    return correlation, float(np.mean((above > 0) & (below > 0)))


def bench(name: str, lengths: np.ndarray, capacity: int, args) -> None:
    print(f"\n## {name}: {len(lengths):,} samples, capacity {capacity}, mean length {lengths.mean():.0f}")
    reference = run_reference(lengths, capacity, args.seed, args.reference_chunks)
    print(
        f"reference (NeMo first_fit_shuffle, pure Python): {reference['seconds']:.1f} s"
        f" (extrapolated from {reference['chunks_run']} of {reference['chunks']} chunks; "
        f"same bins as ours on those chunks: {'yes' if reference['identical'] else 'NO'})"
    )
    header = f"{'algorithm':<22}{'packs':>9}{'LB':>9}{'ratio':>9}{'eff %':>8}{'n mean':>8}{'n max':>7}"
    header += f"{'order r':>9}{'mixed %':>9}{'time s':>9}{'speed-up':>10}"
    print(header)
    for algorithm in sorted(ALGORITHMS):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = pack(lengths, capacity, algorithm, seed=args.seed)
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        correlation, mixed = mixing(plan, lengths)
        spp = plan.samples_per_bin
        print(
            f"{algorithm:<22}{plan.num_bins:>9,}{plan.lower_bound:>9,}{plan.num_bins / plan.lower_bound:>9.4f}"
            f"{100 * plan.efficiency:>8.2f}{spp.mean():>8.2f}{spp.max():>7}{correlation:>9.3f}{100 * mixed:>9.1f}"
            f"{seconds:>9.3f}{reference['seconds'] / seconds:>9.0f}x"
        )


def warm_up() -> None:
    print("first call per algorithm (numba compile, or load from its on-disk cache):")
    tiny = np.array([5, 3, 4, 2, 7, 1], dtype=np.int64)
    for algorithm in sorted(ALGORITHMS):
        start = time.perf_counter()
        pack(tiny, 8, algorithm)
        print(f"  {algorithm:<22}{time.perf_counter() - start:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-chunks", type=int, default=1, help="reference chunks to run (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per algorithm (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacities", type=int, nargs="+", default=[4096, 8192])
    args = parser.parse_args()
    warm_up()
    for capacity in args.capacities:
        bench("LLaVA-1.5-mix665k-like", llava_like(capacity, seed=args.seed), capacity, args)
    for capacity in args.capacities:
        lengths, source = sft_like(capacity, seed=args.seed)
        bench(f"SFT-like, {source}", lengths, capacity, args)


if __name__ == "__main__":
    main()
