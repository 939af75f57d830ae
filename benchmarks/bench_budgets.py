#!/usr/bin/env python
"""Packing under visual budgets: every algorithm with and without --max_images_per_pack /
--max_image_tokens_per_pack, on a native-resolution (Qwen2-VL) dynamic-resolution mix, in one run.

    python benchmarks/bench_budgets.py [--samples 200000] [--capacity 16384] [--repeats 3]

The workload (benchmarks/distributions.py ``dynamic_resolution_like``) takes each image's tokens from
the Qwen2-VL processor's own arithmetic on a spread of photo, screenshot and web-image sizes. For each
algorithm and budget setting it prints packs, the lower bound (the largest of the positions', the
images' and the image tokens' ceil(sum / budget)), packs / lower bound, the mean and max images and
image tokens per pack, the largest vision cost of a pack (sum of patches squared), and the time
(median of --repeats after a warm-up) with its ratio to the same algorithm without budgets.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributions import dynamic_resolution_like  # noqa: E402

from neva_pack.packing import ALGORITHMS, pack  # noqa: E402
from neva_pack.packing import visual_budgets  # noqa: E402


def timed(lengths, capacity, algorithm, repeats, **budgets):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = pack(lengths, capacity, algorithm, seed=0, **budgets)
        times.append(time.perf_counter() - start)
    return plan, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths, images, tokens, vision = dynamic_resolution_like(args.samples, args.capacity)
    settings = {
        "no budget": {},
        "non-binding (64 img, 16k tok)": {"max_images_per_pack": 64, "max_image_tokens_per_pack": 16_000},
        "binding (24 img, 12k tok)": {"max_images_per_pack": 24, "max_image_tokens_per_pack": 12_000},
        "tight (8 img, 8k tok)": {"max_images_per_pack": 8, "max_image_tokens_per_pack": 8_000},
    }
    fits = (images <= 8) & (tokens <= 8_000)  # a run skips a sample over a budget alone: left out of every setting
    print(f"{int((~fits).sum()):,} samples over the tight budget alone are left out of every setting")
    lengths, images, tokens, vision = lengths[fits], images[fits], tokens[fits], vision[fits]
    print(f"{len(lengths):,} samples, capacity {args.capacity}: mean length {lengths.mean():.0f}, images {images.sum():,} "
          f"(max {images.max()} a sample), image tokens mean {tokens.mean():.0f} (max {tokens.max():,} a sample)")  # fmt: skip
    for algorithm in sorted(ALGORITHMS):  # warm-up: numba compile or cache load, both kernel variants
        pack(lengths[:50], args.capacity, algorithm, images=images[:50], image_tokens=tokens[:50], max_images_per_pack=24)
        pack(lengths[:50], args.capacity, algorithm)
    header = (f"{'algorithm':<22}{'budgets':<31}{'packs':>8}{'LB':>8}{'ratio':>8}{'img mean':>9}{'img max':>8}"
              f"{'tok mean':>9}{'tok max':>8}{'max vision':>12}{'time s':>8}{'x no budget':>12}")  # fmt: skip
    print(header)
    for algorithm in sorted(ALGORITHMS):
        baseline = None
        for name, limits in settings.items():
            options = {"images": images, "image_tokens": tokens, **limits} if limits else {}
            plan, seconds = timed(lengths, args.capacity, algorithm, args.repeats, **options)
            baseline = seconds if baseline is None else baseline
            bound = max(plan.lower_bound, visual_budgets(len(lengths), images, tokens, limits.get("max_images_per_pack"),
                                                         limits.get("max_image_tokens_per_pack")).bins_needed())  # fmt: skip
            per_pack = lambda values: np.add.reduceat(values[plan.indices], plan.offsets[:-1])  # noqa: E731
            img, tok, cost = per_pack(images), per_pack(tokens), per_pack(vision)
            print(f"{algorithm:<22}{name:<31}{plan.num_bins:>8,}{bound:>8,}{plan.num_bins / bound:>8.4f}{img.mean():>9.2f}"
                  f"{img.max():>8}{tok.mean():>9.0f}{tok.max():>8,}{cost.max():>12.3g}{seconds:>8.3f}{seconds / baseline:>11.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
