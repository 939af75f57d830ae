"""The pack-size explorer behind ``neva-pack plan``: candidate sizes x algorithms, from lengths alone.

Choosing max_seq_length before a multi-hour run (too long: out of memory; too short: poor
packing) needs only the sample lengths, which the sample store keeps: no re-tokenization, no
image work, seconds for 665K samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack import store as layout
from neva_pack.formats import sample_store
from neva_pack.errors import InputError
from neva_pack.packing import pack
from neva_pack.stats import global_batch_size_advice


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
    """Samples longer than this pack size (they would be truncated to it)."""
    packed_global_batch_size: int | None
    seconds: float


def load_lengths(path: Path) -> SampleLengths:
    """From an output directory's sample store, a store directory, or else an output's plan table (any format)."""
    path = Path(path)
    for directory in (layout.store_dir(path), path):
        if (directory / layout.STORE_PROGRESS).is_file():
            store = sample_store.SampleStore(directory)
            return SampleLengths(
                lengths=store.lengths,
                truncated=int(store.rows["truncated"].sum()),
                cut_at=store.fingerprint.get("max_seq_length"),
                source=str(directory),
            )
    from neva_pack.formats import open_packed

    try:
        reader = open_packed(path)
    except InputError:
        reader = None
    if reader is not None:
        table, meta = reader.plan_table(), reader.meta
        reader.close()
        return SampleLengths(
            lengths=table.length.astype(np.int64),
            truncated=int(meta.counts.truncated),
            cut_at=int(meta.max_seq_length),
            source=str(reader.prefix),
        )
    raise InputError(f"{path}: no sample store ({layout.STORE_DIR}/{layout.STORE_PROGRESS}) nor plan table here")


def explore(
    sample_lengths: SampleLengths,
    pack_sizes: list[int],
    algorithms: list[str],
    seed: int = 0,
    global_batch_size: int | None = None,
) -> list[Candidate]:
    for algorithm in algorithms:  # load (or compile) the numba kernels before timing anything
        pack(np.array([1, 2, 3]), 4, algorithm=algorithm, seed=seed)
    rows = []
    for size in pack_sizes:
        if size < 1:
            raise InputError(f"--pack_sizes {size}: must be >= 1")
        clipped = np.minimum(sample_lengths.lengths, size)
        for algorithm in algorithms:
            started = time.perf_counter()
            plan = pack(clipped, size, algorithm=algorithm, seed=seed)
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
                    clipped=int((sample_lengths.lengths > size).sum()),
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
        f"{'size':>7}  {'algorithm':<21}{'packs':>10}{'LB':>10}{'eff %':>8}{'n mean':>8}{'n max':>7}"
        f"{'truncated':>10}{'GBS':>6}{'time s':>8}",
    ]
    for row in rows:
        gbs = "-" if row.packed_global_batch_size is None else str(row.packed_global_batch_size)
        lines.append(
            f"{row.pack_size:>7}  {row.algorithm:<21}{row.packs:>10,}{row.lower_bound:>10,}{100 * row.efficiency:>8.2f}"
            f"{row.samples_per_pack_mean:>8.2f}{row.samples_per_pack_max:>7}{row.clipped:>10,}{gbs:>6}{row.seconds:>8.3f}"
        )
    if sample_lengths.truncated and sample_lengths.cut_at:
        larger = [r.pack_size for r in rows if r.pack_size > sample_lengths.cut_at]
        if larger:
            lines.append(
                f"note: {sample_lengths.truncated:,} samples were cut at {sample_lengths.cut_at} when the store was built; "
                f"for sizes above it their lengths are underestimated"
            )
    lines.append("GBS: the packed global batch size for --global_batch_size (unpacked GBS / n)")
    return "\n".join(lines)
