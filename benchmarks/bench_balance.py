#!/usr/bin/env python
"""Data-parallel balance benchmark: straggler overhead of packs in random order vs balance_order.

    python benchmarks/bench_balance.py [--algorithms first_fit_shuffle near_optimal] [--seeds 3]

On the LLaVA-1.5 665K-like distribution (benchmarks/distributions.py), packed at 4096 and 8192,
for N = 8 and 64 data-parallel ranks (one pack per rank per micro-step), it prints the expected
straggler overhead  sum_steps(max - mean) / sum_steps(mean)  of three per-pack costs:

    attention  sum of squared sample lengths (causal attention work)   <- the goal: <= 1%
    tokens     positions in the pack (linear layers)
    images     images in the pack (vision encoder)

for a random order of the packs (averaged over --seeds seeds, in the same run) and for
balance_order at a few tolerances (0 = attention alone; the default re-balances images and tokens
inside blocks whose attention differs by at most that much), with the time balance_order takes. A last column measures how
much of a length curriculum the order has: Spearman correlation between a pack's position and
its attention cost (0 = none; a sorted epoch gives -1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributions import llava_like_with_images  # noqa: E402

from neva_pack.packing import pack  # noqa: E402
from neva_pack.packing import DEFAULT_TOLERANCE, PackCosts, balance_order, straggler_overhead  # noqa: E402

IMAGE_POSITIONS = 576


def spearman(values: np.ndarray) -> float:
    ranks = np.argsort(np.argsort(values, kind="stable"), kind="stable").astype(np.float64)
    position = np.arange(len(values), dtype=np.float64)
    return float(np.corrcoef(position, ranks)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["first_fit_shuffle", "near_optimal"])
    parser.add_argument("--capacities", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tolerances", type=float, nargs="+", default=[0.0, DEFAULT_TOLERANCE])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    header = f"{'capacity':>8} {'algorithm':<18} {'packs':>7} {'N':>3}  {'order':<14} {'attention':>9} {'tokens':>7} {'images':>7} {'spearman':>8} {'time':>8}"
    print("straggler overhead = sum_steps(max - mean) / sum_steps(mean); LLaVA-1.5 665K-like lengths")
    print(header)
    print("-" * len(header))
    for capacity in args.capacities:
        lengths, kinds = llava_like_with_images(capacity, image_positions=IMAGE_POSITIONS)
        for algorithm in args.algorithms:
            plan = pack(lengths, capacity, algorithm=algorithm, seed=0)
            costs = PackCosts.of(lengths[plan.indices], plan.offsets, kinds[plan.indices])
            for ranks in args.ranks:
                row = f"{capacity:>8} {algorithm:<18} {plan.num_bins:>7} {ranks:>3}"
                random = [np.random.default_rng(seed).permutation(plan.num_bins) for seed in range(args.seeds)]
                figures = [np.mean([straggler_overhead(c, ranks, order) for order in random]) for c in _costs(costs)]
                curriculum = np.mean([spearman(costs.attention[order]) for order in random])
                print(f"{row}  {'random':<14} " + _percent(figures) + f" {curriculum:>8.3f} {'':>8}")
                for tolerance in args.tolerances:
                    started = time.perf_counter()
                    order = balance_order(costs, ranks, np.random.default_rng(0), tolerance=tolerance)
                    seconds = time.perf_counter() - started
                    figures = [straggler_overhead(c, ranks, order) for c in _costs(costs)]
                    label = f"balanced {tolerance:g}"
                    print(f"{row}  {label:<14} " + _percent(figures) + f" {spearman(costs.attention[order]):>8.3f} {seconds * 1e3:>6.1f}ms")


def _costs(costs: PackCosts):
    return costs.attention, costs.tokens, costs.images


def _percent(values) -> str:
    return " ".join(f"{100 * v:>{w}.2f}%"[-(w + 1) :] for v, w in zip(values, (8, 6, 6)))


if __name__ == "__main__":
    main()
