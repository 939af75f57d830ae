#!/usr/bin/env python
"""PackedBatchSampler benchmark: packing efficiency against multipack_sampler, and re-plan time.

    python benchmarks/bench_sampler.py [--lengths openchat_v1_lengths.json] [--peer path/to/multipack_sampler.py]

1. Efficiency on the OpenChat V1 lengths (6,144 real SFT lengths, multipack_sampler's testdata.json,
   bundled as shared/data/openchat_v1_lengths.json), in multipack_sampler's own setting: a rank's
   step holds at most 16 x 2048 = 32,768 positions, 8 ranks, 10 epochs. Figures as its notebook
   computes them:

       efficiency   positions holding data / (rank-steps x 32,768)
       utilization  positions holding data / (sum over steps of the fullest rank's load x 8)
       L^2 lag      sqrt(max - min over the ranks of a step's sum of squared lengths), mean over steps
       dropped      samples an epoch leaves out (multipack V2 leaves out the tail that cannot fill
                    a step on every rank; ours only with drop_last)

   against multipack_sampler's published figures (README at 71f0dd5, "Multipack V2": quadratic
   98.16% efficiency, 99.70% utilization, L^2 lag 438; linear 99.64%), and against the peer run here
   when ``--peer`` names its module (its code is never part of this repository: fetch
   github.com/imoneoi/multipack_sampler into a scratch directory).
2. Re-plan time: one epoch's plan for all ranks over LLaVA-1.5 665K-like lengths (665,298 samples,
   benchmarks/distributions.py) at 4,096 positions per rank-step, 8 ranks (numba compiled first),
   the best of --repeats epochs; and the peer's on the same lengths, in the same run.
3. Visual budgets: a native-resolution (Qwen2-VL) mix (benchmarks/distributions.py
   ``dynamic_resolution_like``, --dynamic_samples samples) at 16,384 positions per rank-step, 8 ranks,
   without a budget, under binding and under tight --max_images_per_pack / --max_image_tokens_per_pack:
   efficiency, steps and their lower bound (the largest of the positions', images' and image tokens'
   ceil(sum / budget), over the ranks), the most images and image tokens of any rank-step (checked
   within the budgets), and the re-plan time (best of --repeats epochs) as a ratio to the same sampler without
   budgets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributions import OPENCHAT_LENGTHS, dynamic_resolution_like, llava_like  # noqa: E402

from neva_pack.training import PackedBatchSampler  # noqa: E402

STEP_CAPACITY = 16 * 2048
"""multipack_sampler's benchmark: batch size 16 x context 2048 per rank."""
RANKS = 8
EPOCHS = 10
PUBLISHED = {"quadratic": {"efficiency": 0.9816, "utilization": 0.9970, "lag": 438}, "linear": {"efficiency": 0.9964}}
"""multipack_sampler README (commit 71f0dd5), OpenChat V1, 8 ranks, 16 x 2048."""


def epoch_figures(batches_per_rank: list[list[list[int]]], lengths: np.ndarray, capacity: int) -> dict:
    """The notebook's figures for one epoch of per-rank batches (every rank the same step count)."""
    loads = np.array([[lengths[b].sum() for b in rank] for rank in batches_per_rank], dtype=np.int64)
    squares = np.array([[(lengths[b] ** 2).sum() for b in rank] for rank in batches_per_rank], dtype=np.int64)
    used = int(loads.sum())
    seen = sum(len(b) for rank in batches_per_rank for b in rank)
    assert loads.max(initial=0) <= capacity
    return {
        "used": used,
        "slots": loads.size * capacity,
        "fullest": int(loads.max(axis=0).sum()) * len(batches_per_rank),
        "lag": float(np.sqrt(np.mean(squares.max(axis=0) - squares.min(axis=0)))) if loads.size else 0.0,
        "dropped": len(lengths) - seen,
        "steps": loads.shape[1],
    }


def summary(name: str, epochs: list[dict], plan_seconds: float) -> dict:
    used, slots, fullest = (sum(e[k] for e in epochs) for k in ("used", "slots", "fullest"))
    row = {
        "name": name,
        "efficiency": used / slots,
        "utilization": used / fullest,
        "lag": float(np.mean([e["lag"] for e in epochs])),
        "dropped": float(np.mean([e["dropped"] for e in epochs])),
        "steps": epochs[0]["steps"],
        "ms": plan_seconds * 1e3,
    }
    print(
        f"{name:<42} {row['efficiency']:>9.2%} {row['utilization']:>11.2%} {row['lag']:>8.0f} "
        f"{row['dropped']:>8.1f} {row['steps']:>6} {row['ms']:>9.1f}"
    )
    return row


def ours(lengths, capacity, ranks, algorithm, drop_last, epochs=EPOCHS):
    samplers = [PackedBatchSampler(lengths, capacity, ranks, rank, 0, algorithm, drop_last) for rank in range(ranks)]
    figures, seconds = [], []
    for epoch in range(epochs):
        start = time.perf_counter()
        plan = samplers[0].plan_epoch(epoch + 1)  # epoch 0 was planned (and compiled) at construction
        seconds.append(time.perf_counter() - start)
        batches = [[plan.batch(step, rank) for step in range(plan.num_steps)] for rank in range(ranks)]
        figures.append(epoch_figures(batches, lengths, capacity))
    return figures, min(seconds)


def load_peer(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_run(cls, lengths, capacity, ranks, epochs=EPOCHS):
    samplers = [cls(batch_max_length=capacity, lengths=lengths, num_replicas=ranks, rank=rank, seed=0) for rank in range(ranks)]
    samplers[0].set_epoch(0)
    samplers[0].generate_batches()  # numba compiles
    figures, seconds = [], []
    for epoch in range(epochs):
        batches = []
        for rank, sampler in enumerate(samplers):
            sampler.set_epoch(epoch + 1)
            start = time.perf_counter()
            batches.append([np.asarray(b).tolist() for b in sampler.generate_batches()])
            if rank == 0:
                seconds.append(time.perf_counter() - start)
        figures.append(epoch_figures(batches, lengths, capacity))
    return figures, min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=Path, default=OPENCHAT_LENGTHS, help="the OpenChat V1 lengths (JSON list)")
    parser.add_argument("--peer", type=Path, help="multipack_sampler.py (multipack_sampler_linear.py beside it is run too)")
    parser.add_argument("--algorithms", nargs="+", default=["near_optimal", "first_fit_shuffle"])
    parser.add_argument("--repeats", type=int, default=3, help="epochs re-planned for the 665K and budget timings")
    parser.add_argument("--dynamic_samples", type=int, default=100_000, help="samples of the budget section's mix")
    args = parser.parse_args()
    peers = {}
    if args.peer is not None:
        peers["multipack V2 quadratic (measured)"] = load_peer(args.peer).MultipackDistributedBatchSampler
        linear = args.peer.with_name("multipack_sampler_linear.py")
        if linear.is_file():
            peers["multipack V2 linear (measured)"] = load_peer(linear).MultipackDistributedBatchSampler_LinearAttention

    print(f"1. OpenChat V1 lengths, {RANKS} ranks, {STEP_CAPACITY} positions per rank-step, {EPOCHS} epochs")
    if not args.lengths.is_file():
        print(f"   {args.lengths} is not reachable here: pass --lengths PATH (shared/data/openchat_v1_lengths.json); skipped")
        rows = {}
    else:
        lengths = np.asarray(json.loads(args.lengths.read_text()), dtype=np.int64)
        print(f"   {len(lengths)} samples, {int(lengths.sum())} positions, longest {int(lengths.max())}")
        header = f"{'sampler':<42} {'efficiency':>9} {'utilization':>11} {'L^2 lag':>8} {'dropped':>8} {'steps':>6} {'plan ms':>9}"
        print(header + "\n" + "-" * len(header))
        for name, figures in PUBLISHED.items():
            print(f"{'multipack V2 ' + name + ' (published)':<42} {figures['efficiency']:>9.2%} "
                  f"{figures.get('utilization', float('nan')):>11.2%} {figures.get('lag', float('nan')):>8.0f}")  # fmt: skip
        rows = {}
        for name, cls in peers.items():
            rows[name] = summary(name, *peer_run(cls, lengths, STEP_CAPACITY, RANKS))
        for algorithm in args.algorithms:
            for drop_last in (False, True):
                name = f"ours {algorithm}{' drop_last' if drop_last else ''}"
                rows[name] = summary(name, *ours(lengths, STEP_CAPACITY, RANKS, algorithm, drop_last))
        best = max((r for n, r in rows.items() if n.startswith("ours") and "drop_last" not in n), key=lambda r: r["efficiency"])
        print(f"\n   ours (every sample, {best['name'][5:]}) / published quadratic: "
              f"{best['efficiency'] / PUBLISHED['quadratic']['efficiency']:.4f}x efficiency")  # fmt: skip
        for name, row in rows.items():
            if name.startswith("multipack"):
                print(f"   ours / {name}: {best['efficiency'] / row['efficiency']:.4f}x efficiency")

    capacity = 4096
    big = llava_like(capacity)
    print(f"\n2. Re-plan time, {len(big)} LLaVA-1.5-like lengths, {capacity} positions per rank-step, {RANKS} ranks "
          f"(best of {args.repeats} epochs)")  # fmt: skip
    timings = {}
    for algorithm in args.algorithms:
        figures, seconds = ours(big, capacity, RANKS, algorithm, False, epochs=args.repeats)
        timings[algorithm] = seconds
        print(f"   ours {algorithm:<28} {seconds * 1e3:>8.0f} ms   efficiency {figures[0]['used'] / figures[0]['slots']:.2%}")
    for name, cls in peers.items():
        figures, seconds = peer_run(cls, big, capacity, RANKS, epochs=1)
        print(f"   {name:<33} {seconds * 1e3:>8.0f} ms   efficiency {figures[0]['used'] / figures[0]['slots']:.2%} "
              f"(one rank's batches)")  # fmt: skip
        for algorithm, ours_seconds in timings.items():
            print(f"   {name} / ours {algorithm}: {seconds / ours_seconds:.2f}x time")

    budgets_section(args.dynamic_samples, args.repeats)


def budgets_section(samples: int, repeats: int, capacity: int = 16_384, algorithm: str = "near_optimal") -> None:
    lengths, images, tokens, _ = dynamic_resolution_like(samples, capacity)
    fits = (images <= 8) & (tokens <= 8_000)  # a run skips a sample over a budget alone: left out of every setting
    lengths, images, tokens = lengths[fits], images[fits], tokens[fits]
    print(f"\n3. Visual budgets, {len(lengths):,} Qwen2-VL-like samples ({images.sum():,} images), {capacity} positions "
          f"per rank-step, {RANKS} ranks, {algorithm} (best of {repeats} epochs)")  # fmt: skip
    settings = {
        "no budget": {},
        "binding (24 img, 12k tok)": {"max_images_per_pack": 24, "max_image_tokens_per_pack": 12_000},
        "tight (8 img, 8k tok)": {"max_images_per_pack": 8, "max_image_tokens_per_pack": 8_000},
    }
    print(f"   {'budgets':<28}{'efficiency':>11}{'steps':>7}{'LB':>7}{'img max':>8}{'tok max':>8}{'plan ms':>9}{'x no budget':>12}")
    baseline = None
    for name, limits in settings.items():
        sampler = PackedBatchSampler(lengths, capacity, RANKS, 0, 0, algorithm, num_images=images, image_tokens=tokens, **limits)
        seconds = []
        for epoch in range(1, repeats + 1):
            start = time.perf_counter()
            plan = sampler.plan_epoch(epoch)
            seconds.append(time.perf_counter() - start)
        bins = [plan.batch(step, rank) for step in range(plan.num_steps) for rank in range(RANKS)]
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        most_images, most_tokens = max(int(images[b].sum()) for b in bins), max(int(tokens[b].sum()) for b in bins)
        assert most_images <= limits.get("max_images_per_pack", most_images)
        assert most_tokens <= limits.get("max_image_tokens_per_pack", most_tokens)
        baseline = min(seconds) if baseline is None else baseline
        bins_needed = max(-(-int(lengths.sum()) // capacity), sampler.budgets.bins_needed())
        print(f"   {name:<28}{plan.efficiency:>11.2%}{plan.num_steps:>7}{-(-bins_needed // RANKS):>7}{most_images:>8}{most_tokens:>8,}"
              f"{min(seconds) * 1e3:>9.0f}{min(seconds) / baseline:>11.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
