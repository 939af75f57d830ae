"""``neva-pack plan``, the pack-size explorer: candidate sizes x algorithms, from lengths alone.

Choosing max_seq_length before a multi-hour run (too long: out of memory; too short: poor
packing) needs only the sample lengths, which the sample store keeps: no re-tokenization, no
image work. Samples are packed as a run would pack them: cut to the
size (its aligned capacity) and padded to the alignment multiple (``neva_pack.packing.alignment``),
whose cost is the padding overhead column.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.files import paths
from neva_pack.core import IGNORE_INDEX, InputError
from neva_pack.packing import aligned_capacity, budget_options, over_image_budget, pack, padded_lengths
from neva_pack.sample_store import PROGRESS_FILE, SampleStore
from neva_pack.commands.stats import global_batch_size_advice

__all__ = ["CUT_ROW", "Candidate", "SampleLengths", "explore", "format_table", "load_lengths"]

CUT_ROW = np.dtype([("length", "<i8"), ("num_images", "<i8"), ("image_tokens", "<i8")])
"""A sample as a run at one pack size packs it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleLengths:
    lengths: np.ndarray
    """int64 positions of every sample."""
    truncated: int
    """Samples already cut at ``cut_at`` when the store was built (their true length is unknown)."""
    cut_at: int | None
    """The max_seq_length the samples were built with."""
    source: str
    """Where the lengths were read from."""
    pad_to_multiple_of: int = 1
    """The alignment multiple the output was written with (its meta's; 1: none, or no meta to say)."""
    store: object | None = None
    """The sample store, when the lengths come from it: samples are then cut as a run cuts them."""
    image_positions: int | None = None
    """Positions of one image run (the output's meta's), for that cut; None for a dynamic store (each
    image its own run length, which the store keeps)."""
    ignore_index: int = IGNORE_INDEX
    """Label of untrained positions (the output's meta's), to find samples a cut leaves untrained."""
    num_images: np.ndarray | None = None
    """int64 images of every sample (for visual budgets); None when unknown."""
    image_tokens: np.ndarray | None = None
    """int64 image positions of every sample (for visual budgets); None when unknown."""
    vision_cost: np.ndarray | None = None
    """int64 vision encoder cost of every sample (patches² per encoder pass); None when unknown."""
    laid_out: object | None = None
    """The samples laid out from the input (``plan_input.LaidOutSamples``): cut as a run cuts them."""
    skipped_records: dict[str, int] | None = None
    """Records a run would skip whatever the size, by reason (known when planned from the input)."""
    note: str | None = None
    """What the lengths cannot tell (printed under the table)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    pack_size: int
    algorithm: str
    packs: int
    lower_bound: int
    efficiency: float
    samples_per_pack_mean: float
    samples_per_pack_max: int
    clipped: int
    """Samples a run at this size would truncate (and keep), as its report counts them."""
    skipped: int
    """Samples a run at this size would skip: its cut leaves them no trained label (known from the store
    only), or they are over a visual budget on their own."""
    pad_to_multiple_of: int
    """Every sample was padded to a multiple of this before packing (1: no padding)."""
    padding_overhead: float
    """Padding positions over real positions (0.0 without padding)."""
    packed_global_batch_size: int | None
    seconds: float


def load_lengths(path: Path) -> SampleLengths:
    """From an output directory's sample store, a store directory, or else an output's plan table (any format)."""
    path = Path(path)
    for directory in (paths.store_dir(path), path):
        if (directory / PROGRESS_FILE).is_file():
            store = SampleStore(directory)
            meta = _output_meta(directory.parent)
            return SampleLengths(
                lengths=store.lengths,
                truncated=int(store.rows["truncated"].sum()),
                cut_at=store.fingerprint.get("max_seq_length"),
                source=str(directory),
                pad_to_multiple_of=int(meta.get("pad_to_multiple_of") or 1),
                store=store,
                image_positions=meta.get("image_positions"),
                ignore_index=int(meta.get("ignore_index", IGNORE_INDEX)),
                num_images=store.rows["num_images"].astype(np.int64),
                image_tokens=store.rows["image_tokens"].astype(np.int64),
            )
    from neva_pack.formats import open_packed, resolve_prefixes

    try:
        resolve_prefixes(path)
    except InputError:  # no complete output here
        reader = None
    else:
        reader = open_packed(path)  # a damaged one is refused as every reader refuses it, naming the file
    if reader is not None:
        table, meta = reader.plan_table(), reader.meta
        reader.close()
        # the table lists samples in pack order; a run packs them in input order (a seeded algorithm's
        # result depends on it)
        input_order = np.argsort(table.record_index, kind="stable")
        return SampleLengths(
            lengths=table.length[input_order].astype(np.int64),
            truncated=int(meta.counts.truncated),
            cut_at=int(meta.packing.max_seq_length),
            source=str(reader.prefix),
            pad_to_multiple_of=int(meta.packing.pad_to_multiple_of),
            num_images=table.num_images[input_order],
            image_tokens=None if table.image_tokens is None else table.image_tokens[input_order],
        )
    raise InputError(f"{path}: no sample store ({paths.STORE_DIR}/{PROGRESS_FILE}) nor plan table here")


def _output_meta(output_dir: Path) -> dict:
    """The meta of an output's prefixes as JSON (every size of a run records the same alignment,
    image positions and ignore value); empty when there is none of ours to read."""
    from neva_pack.formats import read_meta_json

    for prefix in paths.packed_prefixes(output_dir):
        try:
            meta = read_meta_json(paths.meta_path(prefix))
        except InputError:
            continue
        if isinstance(meta, dict):
            return meta
    return {}


def _cut_rows(sample_lengths: SampleLengths, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples as a run at this capacity packs them (length, num_images, image_tokens), and which
    of them it skips: from the store, cut before the first image run that does not fit whole (a
    dynamic store's runs each at its own length, ``assemble.rows_at``), the samples the cut leaves
    untrained skipped (a run skips those at this size); from the input's laid-out samples, the same
    way; from a plan table alone (no image positions to go by), cut at the capacity."""
    if sample_lengths.laid_out is not None:
        return sample_lengths.laid_out.rows_at(capacity)
    lengths = sample_lengths.lengths
    unknown = np.zeros(len(lengths), dtype=np.int64)
    rows = np.empty(len(lengths), dtype=CUT_ROW)
    rows["length"] = np.minimum(lengths, capacity)
    rows["num_images"] = unknown if sample_lengths.num_images is None else sample_lengths.num_images
    rows["image_tokens"] = unknown if sample_lengths.image_tokens is None else sample_lengths.image_tokens
    skip = np.zeros(len(rows), dtype=bool)
    store = sample_lengths.store
    if store is None or not (sample_lengths.image_positions or store.dynamic) or not np.any(lengths > capacity):
        return rows, skip
    from neva_pack.assembly import rows_at

    cut, _, untrained = rows_at(sample_lengths.store, capacity, sample_lengths.ignore_index)
    for name in rows.dtype.names:
        rows[name] = cut[name]
    skip[untrained] = True
    return rows, skip


def explore(
    sample_lengths: SampleLengths,
    pack_sizes: list[int],
    algorithms: list[str],
    seed: int = 0,
    global_batch_size: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_images_per_pack: int | None = None,
    max_image_tokens_per_pack: int | None = None,
) -> list[Candidate]:
    """Every size x algorithm. Samples are cut to each size's aligned capacity and padded to
    ``pad_to_multiple_of`` (None: the output's own multiple), as a run with that alignment would,
    and packed within the visual budgets (a sample over one skipped, as a run skips it)."""
    multiple = sample_lengths.pad_to_multiple_of if pad_to_multiple_of is None else int(pad_to_multiple_of)
    if multiple < 1:
        raise InputError(f"alignment multiple {multiple}: must be >= 1")
    for flag, value in (("--max_images_per_pack", max_images_per_pack), ("--max_image_tokens_per_pack", max_image_tokens_per_pack)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value}: must be >= 1")
    if max_image_tokens_per_pack is not None and sample_lengths.image_tokens is None:
        raise InputError(f"{sample_lengths.source}: its samples' image tokens are not known (an output written before "
                         "they were kept); --max_image_tokens_per_pack needs them")  # fmt: skip
    for algorithm in algorithms:  # load (or compile) the numba kernels before timing anything
        pack(np.array([1, 2, 3]), 4, algorithm=algorithm, seed=seed)
    rows = []
    for size in pack_sizes:
        if size < 1:
            raise InputError(f"--pack_sizes {size}: must be >= 1")
        if multiple > size:
            raise InputError(
                f"--pack_sizes {size}: samples padded to a multiple of {multiple} cannot fit packs of {size} positions"
            )
        capacity = aligned_capacity(size, multiple)
        cut, skip = _cut_rows(sample_lengths, capacity)
        skip[over_image_budget(cut, max_images_per_pack, max_image_tokens_per_pack)] = True
        skipped = int(np.count_nonzero(skip))
        kept = cut[~skip]
        clipped = kept["length"]
        budgets = budget_options(kept, max_images_per_pack, max_image_tokens_per_pack)
        padded = padded_lengths(clipped, multiple)
        real = int(clipped.sum())
        for algorithm in algorithms:
            started = time.perf_counter()
            plan = pack(padded, size, algorithm=algorithm, seed=seed, **budgets)
            seconds = time.perf_counter() - started
            per_pack = plan.samples_per_bin
            rows.append(
                Candidate(
                    pack_size=size,
                    algorithm=algorithm,
                    packs=plan.num_bins,
                    lower_bound=plan.lower_bound,
                    efficiency=plan.efficiency,
                    samples_per_pack_mean=float(per_pack.mean()) if plan.num_bins else 0.0,
                    samples_per_pack_max=int(per_pack.max(initial=0)),
                    clipped=int((sample_lengths.lengths[~skip] > capacity).sum()),
                    skipped=skipped,
                    pad_to_multiple_of=multiple,
                    padding_overhead=(int(padded.sum()) - real) / real if real else 0.0,
                    packed_global_batch_size=global_batch_size_advice(
                        global_batch_size, float(per_pack.mean()) if plan.num_bins else 0.0
                    ),
                    seconds=seconds,
                )
            )
    return rows


def format_table(sample_lengths: SampleLengths, rows: list[Candidate]) -> str:
    lines = [
        f"{len(sample_lengths.lengths):,} samples from {sample_lengths.source}",
        f"{'size':>7}  {'algorithm':<21}{'packs':>10}{'LB':>10}{'eff %':>8}{'pad %':>7}{'n mean':>8}{'n max':>7}"
        f"{'truncated':>10}{'skipped':>8}{'GBS':>6}{'time s':>8}",
    ]
    for row in rows:
        gbs = "-" if row.packed_global_batch_size is None else str(row.packed_global_batch_size)
        lines.append(
            f"{row.pack_size:>7}  {row.algorithm:<21}{row.packs:>10,}{row.lower_bound:>10,}{100 * row.efficiency:>8.2f}"
            f"{100 * row.padding_overhead:>7.2f}{row.samples_per_pack_mean:>8.2f}{row.samples_per_pack_max:>7}"
            f"{row.clipped:>10,}{row.skipped:>8,}{gbs:>6}{row.seconds:>8.3f}"
        )
    if sample_lengths.truncated and sample_lengths.cut_at:
        larger = [r.pack_size for r in rows if r.pack_size > sample_lengths.cut_at]
        if larger:
            lines.append(
                f"note: {sample_lengths.truncated:,} samples were cut at {sample_lengths.cut_at} when the store was built; "
                f"for sizes above it their lengths are underestimated"
            )
    multiples = sorted({row.pad_to_multiple_of for row in rows})
    if multiples != [1]:
        lines.append(
            f"samples padded to a multiple of {', '.join(map(str, multiples))} before packing; eff counts padding as "
            "used, pad % is the padding over the real positions"
        )
    if sample_lengths.skipped_records is not None:
        skips = ", ".join(f"{reason} {n:,}" for reason, n in sorted(sample_lengths.skipped_records.items()))
        lines.append(f"records skipped at every size: {skips or 'none'}")
    if sample_lengths.note:
        lines.append(sample_lengths.note)
    lines.append("GBS: the packed global batch size for --global_batch_size (unpacked GBS / n)")
    return "\n".join(lines)
