"""Statistics of a packed output: one dict (saved as stats.json) and its readable rendering.

The end-of-run summary and ``stats.json`` come from the same ``packing_stats`` dict, so
what a user reads and what a script parses never disagree.
"""

from __future__ import annotations

import importlib.resources
import string

import numpy as np
import yaml

from neva_pack.packing import PackingPlan

PERCENTILES = (50, 90, 99)


def packing_stats(plan: PackingPlan, lengths: np.ndarray, num_images: np.ndarray, image_positions: int) -> dict:
    """Numbers about a plan over the sample store (lengths and images per sample)."""
    per_pack = plan.samples_per_bin
    fill = plan.bin_loads / plan.capacity if plan.num_bins else np.zeros(0)
    text_positions = lengths - num_images * image_positions
    return {
        "packs": plan.num_bins,
        "lower_bound_packs": plan.lower_bound,
        "packs_over_lower_bound": (plan.num_bins / plan.lower_bound) if plan.lower_bound else 1.0,
        "efficiency": plan.efficiency,
        "samples": int(plan.num_samples),
        "images": int(num_images.sum()),
        "positions": int(lengths.sum()),
        "samples_per_pack": _summary(per_pack),
        "pack_fill": _percentiles(fill),
        "sample_length": _percentiles(lengths),
        "text_positions": _percentiles(text_positions),
        "samples_with_images": int((num_images > 0).sum()),
    }


def global_batch_size_advice(global_batch_size: int | None, samples_per_pack_mean: float) -> int | None:
    """NeMo's rule: packed GBS = unpacked GBS / n, n = mean samples per pack (at least 1)."""
    if global_batch_size is None or samples_per_pack_mean <= 0:
        return None
    return max(1, round(global_batch_size / samples_per_pack_mean))


def training_overrides(data_prefix: str, crop_size, global_batch_size: int | None) -> list[str]:
    """The templates/training_overrides.yaml lines, filled in."""
    text = (importlib.resources.files("neva_pack.yaml_templates") / "training_overrides.yaml").read_text()
    lines = yaml.safe_load(text)["overrides"]
    values = {
        "data_prefix": data_prefix,
        "crop_size": f"[{crop_size[0]},{crop_size[1]}]",
        "global_batch_size": "<your GBS / samples per pack>" if global_batch_size is None else global_batch_size,
    }
    return [string.Template(line).substitute(values) for line in lines]


def format_summary(report: dict) -> str:
    """The human-readable end-of-run summary of a report dict (as written to stats.json)."""
    records = report["records"]
    packing = report["packing"]
    spp = packing["samples_per_pack"]
    lines = [
        f"records        {records['total']:>10,}   packed {records['packed']:,}   skipped {records['skipped']:,}"
        f"   truncated {records['truncated']:,}",
    ]
    for reason, count in sorted(records["skipped_by_reason"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  skipped: {reason:<24} {count:>8,}")
    lines += [
        f"samples        {packing['samples']:>10,}   with images {packing['samples_with_images']:,}"
        f"   images {packing['images']:,}   positions {packing['positions']:,}",
        f"packs          {packing['packs']:>10,}   lower bound {packing['lower_bound_packs']:,}"
        f" (x{packing['packs_over_lower_bound']:.4f})   algorithm {report['algorithm']} (seed {report['seed']})",
        f"efficiency     {100 * packing['efficiency']:>9.2f}%   samples per pack n = {spp['mean']:.2f}"
        f" (min {spp['min']}, max {spp['max']})   capacity {report['max_seq_length']}",
        f"sample length  p50 {packing['sample_length']['p50']:.0f}  p90 {packing['sample_length']['p90']:.0f}"
        f"  p99 {packing['sample_length']['p99']:.0f}  max {packing['sample_length']['max']:.0f}",
        f"output         {report['data_prefix']}.{{bin,idx}}",
    ]
    suggestion = report.get("suggestion")
    if suggestion:
        lines.append(
            f"hint           --packing_algorithm {suggestion['algorithm']} would need {suggestion['packs']:,} packs"
            f" ({100 * suggestion['saving']:.1f}% fewer)"
        )
    lines.append("train with:")
    lines += [f"  {line}" for line in report["training_overrides"]]
    return "\n".join(lines)


def _summary(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": float(values.mean()), "min": int(values.min()), "max": int(values.max())}


def _percentiles(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {f"p{p}": 0.0 for p in PERCENTILES} | {"min": 0.0, "max": 0.0, "mean": 0.0}
    out = {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
    return out | {"min": float(values.min()), "max": float(values.max()), "mean": float(values.mean())}
