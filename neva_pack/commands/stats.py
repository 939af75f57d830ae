"""Statistics of a packed output: one typed report (report.RunReport, saved as stats.json), its rendering, a plot.

The end-of-run summary, ``stats.json`` and ``neva-pack stats`` all come from
``packing_stats`` + ``format_summary``, so what a user reads and what a script parses never
disagree. The per-sample numbers come from ``PackingArrays``, which a run builds from its plan
and ``neva-pack stats`` reads back from the output's plan table (or, for a prefix written
without one, from the cu_seqlens and image items of the .idx/.bin).
"""

from __future__ import annotations

import importlib.resources
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from neva_pack.commands.report import (
    CountSummary, PackingStats, PaddingStats, Percentiles, RecordCounts, RunReport, VisualStats
)
from neva_pack.commands.balance import step_line

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingArrays:
    capacity: int
    """The pack size the plan was made for (max_seq_length)."""
    offsets: np.ndarray
    """int64, pack p holds samples offsets[p]:offsets[p + 1] of the arrays below."""
    lengths: np.ndarray
    """int64 positions of each sample, in pack order."""
    num_images: np.ndarray | None
    """Images of each sample; None when only per-pack image counts are known."""
    image_positions: int | None
    """Positions one image occupies; None when unknown."""
    pack_images: np.ndarray
    """Images carried by each pack (the zero image of an image-less pack not counted)."""
    padded_lengths: np.ndarray | None = None
    """int64 positions each sample occupies in its pack with its alignment padding; None: no padding."""
    pad_to_multiple_of: int = 1
    """M the samples were padded to a multiple of (1: none)."""
    image_tokens: np.ndarray | None = None
    """int64 image positions of each sample; None when unknown."""
    vision_cost: np.ndarray | None = None
    """int64 vision encoder cost of each sample's images; None when unknown."""
    max_images_per_pack: int | None = None
    """The visual budgets the packs were made under (None: none)."""
    max_image_tokens_per_pack: int | None = None
    video_tokens: np.ndarray | None = None
    """int64 video positions (its clips' runs) of each sample; None when not counted (no video budget)."""
    max_video_tokens_per_pack: int | None = None
    encoder: str | None = None
    """The vision encoder the output was made for (its meta's), which ``--step_cost_model auto`` goes by."""
    family: str | None = None
    """Its model family (the meta's image processor's), likewise; None for a fixed crop."""

    @property
    def num_packs(self) -> int:
        return len(self.offsets) - 1

    @property
    def pack_loads(self) -> np.ndarray:
        """Positions used in each pack, padding included."""
        return per_pack_sum(self.lengths if self.padded_lengths is None else self.padded_lengths, self.offsets)

    @property
    def samples_per_pack(self) -> np.ndarray:
        return np.diff(self.offsets)


def per_pack_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values`` over each pack's slice offsets[p]:offsets[p + 1] (no pack is empty)."""
    if len(offsets) < 2:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(np.asarray(values, dtype=np.int64), offsets[:-1])


def arrays_from_plan(
    plan, rows, image_positions: int, padded=None, pad_to_multiple_of: int = 1, max_images_per_pack: int | None = None,
    max_image_tokens_per_pack: int | None = None, max_video_tokens_per_pack: int | None = None,
) -> PackingArrays:  # fmt: skip
    """The arrays of a run: its plan over the sample store's rows (and their padded lengths), and the
    visual budgets it was made under."""
    chosen = rows[plan.indices]
    num_images = chosen["num_images"].astype(np.int64)
    return PackingArrays(
        padded_lengths=None if padded is None or pad_to_multiple_of == 1 else np.asarray(padded)[plan.indices],
        pad_to_multiple_of=pad_to_multiple_of,
        capacity=plan.capacity,
        offsets=plan.offsets,
        lengths=chosen["length"].astype(np.int64),
        num_images=num_images,
        image_positions=image_positions,
        pack_images=per_pack_sum(num_images, plan.offsets),
        image_tokens=chosen["image_tokens"].astype(np.int64),
        vision_cost=chosen["vision_cost"].astype(np.int64),
        max_images_per_pack=max_images_per_pack,
        max_image_tokens_per_pack=max_image_tokens_per_pack,
        video_tokens=chosen["video_tokens"].astype(np.int64) if max_video_tokens_per_pack is not None else None,
        max_video_tokens_per_pack=max_video_tokens_per_pack,
    )


def visual_stats(arrays: PackingArrays) -> VisualStats:
    """Images, image tokens and vision cost per pack (a figure not known stays None), with the budgets."""

    def per_pack(values):
        return None if values is None else _summary(per_pack_sum(values, arrays.offsets))

    return VisualStats(
        images_per_pack=_summary(arrays.pack_images),
        image_tokens_per_pack=per_pack(arrays.image_tokens),
        vision_cost_per_pack=per_pack(arrays.vision_cost),
        max_images_per_pack=arrays.max_images_per_pack,
        max_image_tokens_per_pack=arrays.max_image_tokens_per_pack,
        video_tokens_per_pack=per_pack(arrays.video_tokens),
        max_video_tokens_per_pack=arrays.max_video_tokens_per_pack,
    )


def packing_stats(arrays: PackingArrays) -> PackingStats:
    """Numbers about the packs: counts, efficiency, lower bound, fill and length percentiles."""
    lengths = arrays.lengths
    loads = arrays.pack_loads
    total = int(lengths.sum())
    lower_bound = -(-int(loads.sum()) // arrays.capacity)  # of what was packed: padded lengths
    num_packs = arrays.num_packs
    with_images = text = image = None
    if arrays.num_images is not None and arrays.image_positions is not None:
        image_part = arrays.num_images * arrays.image_positions
        with_images = int((arrays.num_images > 0).sum())
        text = _percentiles(lengths - image_part)
        image = _percentiles(image_part)
    return PackingStats(
        packs=num_packs,
        lower_bound_packs=lower_bound,
        packs_over_lower_bound=num_packs / lower_bound if lower_bound else 1.0,
        efficiency=total / (num_packs * arrays.capacity) if num_packs else 1.0,
        capacity=arrays.capacity,
        samples=int(len(lengths)),
        images=int(arrays.pack_images.sum()),
        positions=total,
        samples_per_pack=_summary(arrays.samples_per_pack),
        pack_fill=_percentiles(loads / arrays.capacity if num_packs else np.zeros(0)),
        sample_length=_percentiles(lengths),
        samples_with_images=with_images,
        text_positions=text,
        image_positions_per_sample=image,
        padding=padding_stats(arrays),
        visual=visual_stats(arrays),
    )


def padding_stats(arrays: PackingArrays) -> PaddingStats:
    """Alignment padding: its positions and their overhead over the real positions (0 without padding)."""
    real = int(arrays.lengths.sum())
    pad = 0 if arrays.padded_lengths is None else int(arrays.padded_lengths.sum()) - real
    return PaddingStats(pad_to_multiple_of=arrays.pad_to_multiple_of, positions=pad, overhead=pad / real if real else 0.0)


def global_batch_size_advice(global_batch_size: int | None, samples_per_pack_mean: float) -> int | None:
    """NeMo's rule: packed GBS = unpacked GBS / n, n = mean samples per pack (at least 1)."""
    if global_batch_size is None or samples_per_pack_mean <= 0:
        return None
    return max(1, round(global_batch_size / samples_per_pack_mean))


def nemo_data_prefix(data_prefix: str, output_format: str | None) -> str:
    """The prefix NeMo's data_prefix names: the output's own in the format NeMo reads
    (``formats.NEMO_FORMAT``, or a prefix without meta); for another format, the one
    ``neva-pack convert OUT OUT_<that format> --to <that format>`` writes beside the output."""
    from neva_pack.formats import NEMO_FORMAT

    if output_format in (None, NEMO_FORMAT):
        return data_prefix
    prefix = Path(data_prefix)
    return str(prefix.parent.with_name(f"{prefix.parent.name}_{NEMO_FORMAT}") / prefix.name)


def training_overrides(data_prefix: str, crop_size, global_batch_size: int | None, output_format: str | None = None) -> list[str]:
    """The templates/training_overrides.yaml lines, filled in (for the NeMo-layout prefix of the output);
    none without a crop size (dynamic-resolution images, which NeMo 1's NeVA does not read)."""
    if not len(crop_size):
        return []
    text = (importlib.resources.files("neva_pack.yaml_templates") / "training_overrides.yaml").read_text()
    lines = yaml.safe_load(text)["overrides"]
    values = {
        "data_prefix": nemo_data_prefix(data_prefix, output_format),
        "crop_size": f"[{crop_size[0]},{crop_size[1]}]",
        "global_batch_size": "<your GBS / samples per pack>" if global_batch_size is None else global_batch_size,
    }
    return [string.Template(line).substitute(values) for line in lines]


def with_batch_size(report: RunReport, global_batch_size: int | None) -> RunReport:
    """The report with its GBS advice and overrides recomputed for another unpacked GBS."""
    if global_batch_size is None:
        return report
    gbs = global_batch_size_advice(global_batch_size, report.packing.samples_per_pack.mean)
    overrides = training_overrides(report.data_prefix, report.crop_size, gbs, report.output_format)
    return report.replace(global_batch_size=global_batch_size, packed_global_batch_size=gbs, training_overrides=overrides)


def format_summary(report: RunReport) -> str:
    """The human-readable summary of a report (what stats.json holds)."""
    packing = report.packing
    spp = packing.samples_per_pack
    lines = []
    records = report.records
    if records:
        lines.append(
            f"records        {records.total:>10,}   packed {records.packed:,}   skipped {records.skipped:,}"
            f"   truncated {records.truncated:,}"
        )
        for reason, count in sorted(records.skipped_by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  skipped: {reason:<24} {count:>8,}")
    with_images = packing.samples_with_images
    lines += [
        f"samples        {packing.samples:>10,}"
        + (f"   with images {with_images:,}" if with_images is not None else "")
        + f"   images {packing.images:,}   positions {packing.positions:,}",
        f"packs          {packing.packs:>10,}   lower bound {packing.lower_bound_packs:,}"
        f" (x{packing.packs_over_lower_bound:.4f})   algorithm {report.algorithm}"
        f" (seed {report.seed})",
        f"efficiency     {100 * packing.efficiency:>9.2f}%   samples per pack n = {spp.mean:.2f}"
        f" (min {spp.min}, max {spp.max})   capacity {packing.capacity}",
        "pack fill      " + _format_percentiles(packing.pack_fill, percent=True),
        "sample length  " + _format_percentiles(packing.sample_length),
    ]
    padding = packing.padding
    if padding.pad_to_multiple_of > 1:
        lines.append(
            f"padding        {padding.positions:>10,}   positions to align samples to a multiple of "
            f"{padding.pad_to_multiple_of} (+{100 * padding.overhead:.2f}% over the real positions)"
        )
    if packing.text_positions is not None and packing.image_positions_per_sample is not None:
        lines.append("  text         " + _format_percentiles(packing.text_positions))
        lines.append("  image        " + _format_percentiles(packing.image_positions_per_sample))
    if packing.visual is not None:
        lines += _visual_lines(packing.visual)
    if report.clips is not None:
        clips = report.clips
        lines.append(f"video clips    {clips.clips:,} stored once each, {clips.frames:,} frames, {clips.bytes / 1e6:,.1f} MB uint8 "
                     f"({clips.bytes_per_clip / 1e6:,.2f} MB per clip)")  # fmt: skip
        if clips.compression is not None:
            lines.append(f"  {clips.compression:<12} {clips.stored_bytes / 1e6:,.1f} MB stored ({clips.stored_bytes_per_clip / 1e6:,.2f} MB "
                         f"per clip, {clips.bytes / max(clips.stored_bytes, 1):.2f}x smaller than uint8)")  # fmt: skip
    balance = report.balance
    if balance:
        lines.append(
            f"balance        N = {balance.data_parallel} ranks: straggler overhead (sum of max - mean per step) "
            f"attention {100 * balance.attention_overhead_before:.2f}% -> {100 * balance.attention_overhead_after:.2f}%"
            f", tokens {100 * balance.tokens_overhead_before:.2f}% -> {100 * balance.tokens_overhead_after:.2f}%"
            f", images {100 * balance.images_overhead_before:.2f}% -> {100 * balance.images_overhead_after:.2f}%"
            + (f", vision {100 * balance.vision_overhead_before:.2f}% -> {100 * balance.vision_overhead_after:.2f}%"
               if balance.vision_overhead_before is not None and balance.vision_overhead_after is not None else "")
        )  # fmt: skip
        if balance.step_overhead_after is not None:
            lines.append(step_line(balance))
    from neva_pack.formats import NEMO_FORMAT, get_format

    output_format = report.output_format or NEMO_FORMAT  # None: a prefix without meta, in NeMo's layout
    lines.append(f"output         {get_format(output_format).summary_line(report.data_prefix)}")
    suggestion = report.suggestion
    if suggestion:
        lines.append(
            f"hint           --packing_algorithm {suggestion.algorithm} would need {suggestion.packs:,} packs"
            f" ({100 * suggestion.saving:.1f}% fewer)"
        )
    if output_format == NEMO_FORMAT:
        lines.append("train with:")
    elif report.training_overrides:  # none for dynamic-resolution images, which NeMo 1's NeVA cannot read
        source = Path(report.data_prefix).parent
        target = Path(nemo_data_prefix(report.data_prefix, output_format)).parent
        lines.append(f"train with NeMo after: neva-pack convert {source} {target} --to {NEMO_FORMAT}")
    lines += [f"  {line}" for line in report.training_overrides]
    return "\n".join(lines)


def _visual_lines(visual: VisualStats) -> list[str]:
    """Per pack: images, image tokens, vision cost (mean, max, and the max against its budget)."""

    def line(label, summary, budget=None):
        if summary is None:
            return f"  {label:<13}unknown (an output written before the plan table kept it)"
        text = f"  {label:<13}mean {summary.mean:,.1f}   max {summary.max:,}"
        if budget is not None:
            text += f"   budget {budget:,} (max at {100 * summary.max / budget:.1f}%, mean at {100 * summary.mean / budget:.1f}%)"
        return text

    return [
        "per pack",
        line("images", visual.images_per_pack, visual.max_images_per_pack),
        line("image tokens", visual.image_tokens_per_pack, visual.max_image_tokens_per_pack),
        *([line("video tokens", visual.video_tokens_per_pack, visual.max_video_tokens_per_pack)]
          if visual.max_video_tokens_per_pack is not None else []),
        line("vision cost", visual.vision_cost_per_pack),
    ]


LOG_SCALE_FROM = 100
"""The lengths panel counts on a log scale only when its tallest bar reaches this many samples: below
it every count is a small integer, read best on a linear axis with integer ticks."""


def plot(arrays: PackingArrays, path: Path, title: str) -> None:
    """One figure, three panels: sample lengths, pack fill (capacity marked), samples per pack."""
    import matplotlib.pyplot as plt

    fig = stats_figure(arrays, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stats_figure(arrays: PackingArrays, title: str):
    """The figure ``plot`` saves. Readable at any count: a log axis only where counts span decades
    (LOG_SCALE_FROM), then with every bar of one sample still drawn (the axis starts below 1) and
    plain numbers as tick labels; integer ticks wherever a count is shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    fig, (lengths_ax, fill_ax, count_ax) = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    fig.suptitle(title)
    counts, _, _ = lengths_ax.hist(arrays.lengths, bins=min(100, max(10, len(np.unique(arrays.lengths)))), color="#4c72b0")
    if counts.max(initial=0) >= LOG_SCALE_FROM:
        lengths_ax.set_yscale("log")
        lengths_ax.set_ylim(bottom=0.7)
        lengths_ax.yaxis.set_major_formatter(ScalarFormatter())
        lengths_ax.set_ylabel("samples (log scale)")
    else:
        lengths_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        lengths_ax.set_ylabel("samples")
    lengths_ax.set_xlabel("sample length (positions: text + image)")
    lengths_ax.set_title(f"{len(arrays.lengths):,} samples")
    fill_ax.hist(arrays.pack_loads, bins=60, color="#55a868", range=(0, arrays.capacity))
    fill_ax.axvline(arrays.capacity, color="#c44e52", linestyle="--", label=f"capacity {arrays.capacity:,}")
    fill_ax.set_xlabel("positions used per pack")
    fill_ax.set_ylabel("packs")
    efficiency = arrays.lengths.sum() / max(1, arrays.num_packs * arrays.capacity)
    fill_ax.set_title(f"{arrays.num_packs:,} packs, {100 * efficiency:.2f}% full")
    fill_ax.legend(loc="upper left")
    per_pack = arrays.samples_per_pack
    low, high = (int(per_pack.min()), int(per_pack.max())) if len(per_pack) else (0, 0)
    edges = np.arange(low, high + 2) - 0.5
    count_ax.hist(per_pack, bins=edges, color="#8172b2", edgecolor="white")
    count_ax.set_xlabel("samples per pack (n)")
    count_ax.set_ylabel("packs")
    count_ax.set_title(f"n = {per_pack.mean() if len(per_pack) else 0:.2f} on average")
    for axis in (fill_ax.yaxis, count_ax.yaxis, count_ax.xaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _format_percentiles(values: Percentiles, percent: bool = False) -> str:
    def show(v):
        return f"{100 * v:.1f}%" if percent else f"{v:,.0f}"

    return "  ".join(f"{key} {show(getattr(values, key))}" for key in ("min", "p50", "p90", "p99", "max"))


def _summary(values: np.ndarray) -> CountSummary:
    if len(values) == 0:
        return CountSummary(mean=0.0, min=0, max=0)
    return CountSummary(mean=float(values.mean()), min=int(values.min()), max=int(values.max()))


def _percentiles(values: np.ndarray) -> Percentiles:
    if len(values) == 0:
        return Percentiles(p50=0.0, p90=0.0, p99=0.0, min=0.0, max=0.0, mean=0.0)
    p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
    return Percentiles(
        p50=p50, p90=p90, p99=p99, min=float(values.min()), max=float(values.max()), mean=float(values.mean())
    )


def load_outputs(path: Path, crop_size=None, max_seq_length: int | None = None) -> list[tuple[RunReport, PackingArrays]]:
    """Report and arrays of every prefix of an output directory (one per --pack_sizes size), or of a prefix.

    A neva_pack output (any format) gives them from its meta, stats file and plan table; any other
    prefix in NeMo's layout (no meta) from its .idx and cu_seqlens, given ``crop_size`` (a report
    with no records, algorithm, seed or format: they are unknown).
    """
    from neva_pack.core import InputError
    from neva_pack.formats import prefix_without_meta, resolve_prefixes

    path = Path(path)
    try:
        prefixes = resolve_prefixes(path)
    except InputError:
        return [_load_foreign(prefix_without_meta(path), crop_size, max_seq_length)]
    return [_load_prefix(prefix) for prefix in prefixes]


def _load_prefix(prefix: Path) -> tuple[RunReport, PackingArrays]:
    """What stats reads of an output (meta, plan table, stats file) is checked against the meta's
    checksums first (small files): a damaged one is refused, never summarised (the .bin is not read)."""
    from neva_pack.files import paths
    from neva_pack.formats import checked_meta, get_format, open_prefix
    from neva_pack.formats import read_meta
    from neva_pack.commands.report import read_report

    stats_file = paths.stats_path_of(prefix)
    said = read_meta(paths.meta_path(prefix))  # what it says: checked_meta checks it below
    read = list(get_format(said.format).trusted_files(prefix, said))  # the plan table, and what its reader opens it by
    read += [stats_file] if stats_file.is_file() else []  # without it, the report is rebuilt from the meta and plan
    meta = checked_meta(prefix, [paths.relative_name(prefix.parent, f) for f in read])
    reader = open_prefix(prefix, meta)
    table = reader.plan_table()
    reader.close()
    packing = meta.packing
    multiple = int(packing.pad_to_multiple_of)
    arrays = PackingArrays(
        padded_lengths=table.padded_length if multiple > 1 else None,
        pad_to_multiple_of=multiple,
        capacity=int(packing.max_seq_length),
        offsets=table.offsets,
        lengths=table.length,
        num_images=table.num_images,
        image_positions=None if meta.image_positions is None else int(meta.image_positions),  # None: dynamic images
        pack_images=per_pack_sum(table.num_images, table.offsets),
        image_tokens=table.image_tokens,
        vision_cost=table.vision_cost,
        max_images_per_pack=packing.max_images_per_pack,
        max_image_tokens_per_pack=packing.max_image_tokens_per_pack,
        max_video_tokens_per_pack=packing.max_video_tokens_per_pack,
        encoder=meta.encoder,
        family=(meta.image_processor or {}).get("family"),
    )
    if stats_file.is_file():
        return _moved_to(read_report(stats_file), prefix), arrays
    report = _report_of(
        arrays, prefix, list(meta.crop_size or ()), dataset=meta.dataset, records=_records_from_meta(meta),
        algorithm=packing.algorithm, seed=packing.seed, image_positions=arrays.image_positions, output_format=meta.format,
    )  # fmt: skip
    return report, arrays


def _moved_to(report: RunReport, prefix: Path) -> RunReport:
    """The report with the prefix where the output is now (copied or moved since the run wrote it)."""
    if Path(report.data_prefix).resolve() == prefix.resolve():
        return report
    overrides = training_overrides(str(prefix), report.crop_size, report.packed_global_batch_size, report.output_format)
    return report.replace(data_prefix=str(prefix), training_overrides=overrides)


def _load_foreign(prefix: Path, crop_size, max_seq_length) -> tuple[RunReport, PackingArrays]:
    from neva_pack.files import paths
    from neva_pack.core import InputError
    from neva_pack.formats import read_without_meta

    if crop_size is None:
        raise InputError(f"{prefix}: no {prefix.name}{paths.META_SUFFIX}; pass --crop_size H W to read it")
    crop = list(crop_size)
    table = read_without_meta(prefix, 3 * crop[0] * crop[1])
    loads = per_pack_sum(table["length"], table["offsets"])
    arrays = PackingArrays(
        capacity=int(max_seq_length or loads.max(initial=1)),
        offsets=table["offsets"],
        lengths=table["length"],
        num_images=None,
        image_positions=None,
        pack_images=table["pack_images"],
    )
    return _report_of(arrays, prefix, crop, records=None, algorithm=None, seed=None), arrays


def _report_of(arrays: PackingArrays, prefix: Path, crop, **known) -> RunReport:
    """The report of a prefix without a stats file: what its packs show plus what is ``known``."""
    output_format = known.get("output_format")
    return RunReport(
        packing=packing_stats(arrays),
        data_prefix=str(prefix),
        crop_size=list(crop),
        max_seq_length=arrays.capacity,
        suggestion=None,
        training_overrides=training_overrides(str(prefix), crop, None, output_format),
        **known,
    )


def _records_from_meta(meta) -> RecordCounts:
    counts = meta.counts
    return RecordCounts(
        total=counts.records, packed=counts.samples, skipped=counts.skipped, truncated=counts.truncated, skipped_by_reason={}
    )
