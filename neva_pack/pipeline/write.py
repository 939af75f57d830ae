"""The write stage of a pack size: the settings a prefix is written with (and a resume must match),
leftovers of another run's writer removed, packs assembled, checked and written with checkpoints."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack.files import paths
from neva_pack.config import meta_fields
from neva_pack.core import InputError, OutputError
from neva_pack.formats import Checkpoint, read_meta_json, temporary_files
from neva_pack.packing import PackingPlan
from neva_pack.assembly import PackJob, pack_batches
from neva_pack.commands import RunReport, read_report, verify
from neva_pack.sample_store import check_settings

__all__ = [
    "drop_store",
    "plan_digest",
    "remove_stale_tmp",
    "resumed_prefix",
    "write_packs",
]


def plan_digest(plan: PackingPlan, padded: np.ndarray, settings: dict) -> str:
    """Identifies what the writer writes: a resumed writer continues only for the same plan, padding
    and writing settings (``PreprocessConfig.write_settings``; kept readable so that a resume can name one that differs)."""
    digest = hashlib.sha256()
    for array in (plan.offsets, plan.indices, padded):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return json.dumps({"plan": digest.hexdigest(), "settings": settings}, sort_keys=True)


def resumed_prefix(prefix: Path, stats_file: Path, settings: dict, digest: str, data_path) -> RunReport | None:
    """--resume of one prefix: its report when it was published before the interruption (None when it
    was not), once its meta -- or, unfinished, the writer's checkpoint -- shows that it was written with
    these settings; otherwise ConfigError naming the setting (nothing is touched). A published prefix
    must also have been packed from this input's content (``digest``, where its report records one):
    InputError otherwise."""
    meta_file = paths.meta_path(prefix)
    if meta_file.is_file() and stats_file.is_file():
        report = read_report(stats_file)
        if report.input_digest is not None and report.input_digest != digest:  # None: a report from before it
            raise InputError(f"--resume: {prefix} was packed from other content than --data_path {data_path} holds "
                             "now (the input was edited); run with --overwrite to pack it again")  # fmt: skip
        meta = read_meta_json(meta_file)
        stored = {key: meta.get(field) for key, field in meta_fields().items()}  # a setting left unset is not written
        stored["global_batch_size"] = report.global_batch_size
        recorded = None if report.balance is None else report.balance.step_cost_model  # None: unbalanced, or a report from before it
        stored["step_cost_model"] = settings["step_cost_model"] if recorded is None else recorded
        check_settings(stored, {key: settings[key] for key in stored})
        return report
    saved = Checkpoint(prefix, "").saved_digest()
    try:
        saved = json.loads(saved) if saved is not None else None
    except ValueError:  # not a digest of this pipeline's: the writer will not continue it
        saved = None
    if isinstance(saved, dict) and isinstance(saved.get("settings"), dict):
        check_settings(saved["settings"], settings)
    return None


def remove_stale_tmp(prefix: Path, digest: str) -> None:
    """Before a writer starts: unless the checkpoint beside the prefix is this plan's (which the writer
    continues), every temporary file there is a leftover of another run -- maybe of the other format,
    whose writer would never touch it -- and goes, so that none outlives the publish."""
    checkpoint = Checkpoint(prefix, digest)
    if checkpoint.saved_digest() == digest:
        leftovers = [checkpoint.staging]
    else:
        leftovers = temporary_files(prefix)
    for path in leftovers:  # a format may write a directory under a temporary name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def write_packs(job: PackJob, writer, every: int, progress: bool, with_pixels: bool, workers: int) -> None:
    """Assemble the plan's packs from ``writer.num_packs`` on (in workers for large plans), check each,
    and hand them to the format's writer, a checkpoint every ``every`` packs."""
    first = writer.num_packs
    plan = job.plan
    bar = tqdm(total=plan.num_bins, initial=first, desc=f"write packs of {plan.capacity}", unit="pack", disable=not progress)
    batches = pack_batches(job, start=first, workers=workers)
    try:
        for batch in batches:
            for b, problem in enumerate(batch.problems, start=batch.start):
                if problem is not None:
                    raise OutputError(f"pack {b} of {plan.capacity}: {problem}; nothing was published (a bug: please report it)")
            pool = job.store.pool
            pixels = (pool.read_for_writer(indices) for indices in batch.image_indices) if with_pixels else [None] * len(batch)
            writer.add_prepared(batch.prepared, pixels)
            end = batch.start + len(batch)
            if end // every > batch.start // every and end < plan.num_bins:
                writer.checkpoint()
            bar.update(len(batch))
    finally:
        batches.close()  # stops the assembling workers at once when the loop ends early (an error, Ctrl-C)
    bar.close()


def drop_store(output_dir: Path, prefixes: list[Path]) -> None:
    """--drop_store: remove the sample store once every prefix verifies (what remains stands alone)."""
    for prefix in prefixes:
        result = verify(prefix, progress=False)
        if not result.ok:
            raise InputError(f"{prefix}: the output did not verify ({result.problems[0]}); the sample store is kept")
    shutil.rmtree(paths.store_dir(output_dir))
