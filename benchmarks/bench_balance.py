#!/usr/bin/env python
"""Data-parallel balance benchmark: straggler overhead of the modelled step time, three orders of the packs.

    python benchmarks/bench_balance.py [--scale 1.0] [--qwen_samples 200000] [--capacities 4096 16384 65536]

Two synthetic length mixes (benchmarks/distributions.py), each packed with first_fit_shuffle at 4K,
16K and 64K, for N = 8 and 64 data-parallel ranks (one pack per rank per micro-step):

    llava     LLaVA-1.5 mix665k-like: 665K samples, 576 image positions (CLIP-L/14-336, one pass of
              576 patches), modelled with the llava-1.5-7b preset
    native    a native-resolution SFT mix (0-4 images of phone photos, screenshots, web images; the
              Qwen2.5-VL-7B processor's token counts), modelled with that model's preset

For each, the straggler overhead  sum_steps(max - mean) / sum_steps(mean)  of the modelled step time
(packing.step_cost: LM linear + attention, projector, vision encoder) of

    random     a random order of the packs (mean of 5 seeds)
    attention  the order of old: balanced by Σ s² + Σ patches², unweighted (tolerance 1%)
    modelled   balanced by the modelled step time itself (tolerance 0)

and the ratios random / modelled and attention / modelled, with the share of the step each part takes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributions import dynamic_resolution_like, llava_like_with_images  # noqa: E402

from neva_pack.packing import modelled_costs, pack, step_cost_model, step_overheads  # noqa: E402

CLIP_POSITIONS = 576
MIXES = {"llava": "llava-1.5-7b", "native": "qwen2.5-vl-7b"}
"""Mix -> the preset it is modelled with."""
NATIVE_ENCODER = "Qwen/Qwen2.5-VL-7B-Instruct"


def mix(name: str, capacity: int, scale: float = 1.0, native_samples: int = 200_000, seed: int = 0):
    """(lengths, images, image tokens, vision cost) per sample of mix ``name`` cut to ``capacity``."""
    if name == "llava":
        lengths, images = llava_like_with_images(capacity, seed=seed, image_positions=CLIP_POSITIONS, scale=scale)
        return lengths, images, images * CLIP_POSITIONS, images * CLIP_POSITIONS**2
    if name == "native":
        return dynamic_resolution_like(native_samples, capacity, seed=seed, encoder=NATIVE_ENCODER)
    raise ValueError(f"unknown mix {name!r}; choose one of {sorted(MIXES)}")


def mix_costs(name: str, capacity: int, **options):
    """The mix packed at ``capacity`` (first_fit_shuffle, seed 0): its PackCosts with the modelled step
    time of the mix's preset, the model, and the samples in pack order (lengths, image tokens, vision cost)."""
    lengths, images, tokens, vision = mix(name, capacity, **options)
    plan = pack(lengths, capacity, algorithm="first_fit_shuffle", seed=0)
    model = step_cost_model(MIXES[name])
    at = plan.indices
    costs = modelled_costs(model, lengths[at], plan.offsets, images[at], tokens[at], vision[at])
    return costs, model, (lengths[at], tokens[at], vision[at])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixes", nargs="+", default=sorted(MIXES), choices=sorted(MIXES))
    parser.add_argument("--capacities", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the 665K LLaVA-like samples")
    parser.add_argument("--native_samples", type=int, default=200_000)
    args = parser.parse_args()
    header = (f"{'mix':<7} {'capacity':>8} {'packs':>7} {'N':>3}  {'random':>8} {'attention':>9} {'modelled':>8}"
              f"  {'rnd/mod':>8} {'att/mod':>8}  {'time':>7}")  # fmt: skip
    print("straggler overhead of the modelled step time = sum_steps(max - mean) / sum_steps(mean)")
    for name in args.mixes:
        print(f"\n{name}: modelled with {MIXES[name]}")
        print(header)
        print("-" * len(header))
        for capacity in args.capacities:
            costs, model, samples = mix_costs(name, capacity, scale=args.scale, native_samples=args.native_samples)
            shares = model.shares(*samples)
            for ranks in args.ranks:
                started = time.perf_counter()
                overheads, _ = step_overheads(costs, ranks)
                seconds = time.perf_counter() - started
                print(
                    f"{name:<7} {capacity:>8} {len(costs.tokens):>7} {ranks:>3}  {100 * overheads.random:>7.3f}%"
                    f" {100 * overheads.today:>8.3f}% {100 * overheads.modelled:>7.3f}%"
                    f"  {_ratio(overheads.random, overheads.modelled):>8} {_ratio(overheads.today, overheads.modelled):>8}"
                    f"  {seconds:>6.2f}s"
                )
            print("  step shares: " + ", ".join(f"{part} {100 * share:.1f}%" for part, share in shares.items()))


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.1f}x" if base > 0 else "inf"


if __name__ == "__main__":
    main()
