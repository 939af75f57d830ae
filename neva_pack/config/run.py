"""How to run: where the output goes, how many workers, resume or overwrite, how many skips are too
many, checkpoints, sharding. None of these changes a byte of the output."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from neva_pack.config.options import NEMO, check_fields, option
from neva_pack.core import ConfigError
from neva_pack.records import resolve_shards


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    return min(8, usable_cpus())


def max_workers() -> int:
    """More workers than this is refused: each holds a tokenizer, an image processor and a queue of
    samples, and hundreds of them exhaust memory long before they add speed."""
    return max(16, 4 * usable_cpus())


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    output_dir: Path = option(help="output directory, or an s3:// prefix (required)", group=NEMO, remote=True)
    """Where packed_seq_dataset.{bin,idx}, its meta, stats.json and skipped.jsonl go."""
    num_workers: int = option(default_factory=default_workers, help="DataLoader workers (default min(8, CPUs))")
    """DataLoader worker processes for tokenization and image preprocessing (0 = in process)."""
    strict: bool = option(
        False, help="exit 1 if any record was skipped; fail at start when the NeMo convention lacks NeMo's image tokens"
    )
    """Fail the run (exit 1) when any record was skipped, after writing the report."""
    max_skip_fraction: float = option(
        0.5, help="abort when more than this fraction of records is skipped (default {default})", minimum=0, maximum=1
    )
    """Abort (after writing the report so far) when more than this fraction of the records is
    skipped, checked from 1,000 records on and at the end; 1 disables it."""
    overwrite: bool = option(False, help="replace an existing output")
    """Replace an existing output in output_dir (only the files a run writes are removed)."""
    resume: bool = option(False, help="continue an interrupted run in --output_dir")
    """Continue an interrupted run in output_dir; the result is byte-identical to an uninterrupted run."""
    checkpoint_every: int = option(
        10_000, help="records per durable checkpoint (default {default}; packs: a tenth of it)", minimum=1
    )
    """Records per committed store shard (and every tenth of that, packs per writer checkpoint):
    at most this much work is redone after a crash."""
    drop_store: bool = option(
        False, help="nemo: remove the sample store after a verified publish (re-packing then needs a new run)"
    )
    """Remove the sample store once every prefix is published and verified (plan/stats then read the
    plan tables; re-packing needs a new run). Not for a format whose files are the store's images."""
    num_shards: int | None = option(
        None, help="split the records over N runs (default: SLURM_ARRAY_TASK_COUNT in a job array)"
    )
    """Split the records into this many contiguous ranges, one per node (e.g. a SLURM job array)."""
    shard_index: int | None = option(
        None,
        help="encode only shard i into its own part (default: SLURM_ARRAY_TASK_ID); "
        "without it, --num_shards runs the final step: join the parts, pack, write",
    )
    """Encode only this shard's range into its own store part; None with num_shards: the final step
    that joins the parts, packs and writes (the same bytes as a run without shards)."""

    def __post_init__(self):
        check_fields(self)
        if not 0 <= self.num_workers <= max_workers():
            raise ConfigError(
                f"--num_workers {self.num_workers}: must be between 0 and {max_workers()} "
                f"(4 per CPU, at least 16; this machine has {usable_cpus()} CPU(s))"
            )
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")
        if self.num_shards is not None or self.shard_index is not None:
            resolve_shards(self.num_shards, self.shard_index, environ={})  # validates, no defaults here


__all__ = ["RunConfig", "default_workers", "max_workers", "usable_cpus"]
