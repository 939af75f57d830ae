"""preprocess(config): the stages wired together, each with a progress bar.

    ownership.py   the output directory locked, what is in it checked (--resume / --overwrite)
    inputs.py      each input's content digest: compared by --resume, and again before each publish
    encode.py      records --DataLoader workers--> StoredBatch messages --> sample store segments
                   (committed at checkpoints), the skip fraction checked as records are read
    parts.py       a sharded run: one shard's part encoded, or the final step joining every part
                   (run_shard / finish_shards below: what each engine's task and final job call)
    shard_status.py  each shard done, running, stale, missing or made with other settings, and the
                   lines that resubmit the ones left (``neva-pack shards status``)
    staging.py     an s3:// input or output: the run on a local staging directory, mirrored to the
                   bucket at each store commit and at the end (completion markers last)
    pack.py        per pack size: the store's lengths --pack()--> PackingPlan, balanced over ranks
    write.py       packs assembled and checked (in workers for large plans) --format writer
                   (checkpointed)--> packed_seq_dataset[_<size>].*; resume checks of a prefix
    skipped.py     skipped.jsonl, and skipped_<size>.jsonl with a size's own skips
    report.py      stats[_<size>].json (RunReport) and the meta the writer publishes, last

A run killed at any point resumes with --resume: committed segments are kept, packing is
recomputed (it is a pure function of the lengths), and the writer continues after its last
checkpoint; the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.packing import PlanTable, aligned_capacity, invariants, over_image_budget, padded_lengths
from neva_pack.files import paths
from neva_pack.assembly import PackJob, rows_at
from neva_pack.config import PreprocessConfig, SampleConfig
from neva_pack.core import ConfigError, InputError, OutputError
from neva_pack.formats import WriteSpec, output_format
from neva_pack.pipeline.builder import build_sample_builder, pack_spec, sample_builder_for
from neva_pack.pipeline.doomed import images_not_held_error, refuse_doomed_run
from neva_pack.pipeline.encode import encode_samples, record_stops, records_per_message, store_images
from neva_pack.pipeline.ownership import LOCK_FILE, OutputLock, entries, owned_outputs, prepare_output_dir, remove
from neva_pack.pipeline.pack import balance, better_algorithm, pack_kept
from neva_pack.pipeline.inputs import INPUTS_KEY, check_resumed_inputs, check_unchanged, input_digests
from neva_pack.pipeline.parts import content_fingerprint, encode_part, join_parts
from neva_pack.pipeline.report import packed_meta, run_report
from neva_pack.pipeline.skipped import size_skip_details, too_many_skipped, write_run_skipped, write_size_skipped
from neva_pack.pipeline.write import drop_store, plan_digest, remove_stale_tmp, resumed_prefix, write_packs
from neva_pack.records import IMAGES_NOT_HELD, OVER_IMAGE_BUDGET, RecordIndex, index_records, record_ids
from neva_pack.commands import RunReport
from neva_pack.sample_store import PROGRESS_FILE, SampleStore, read_progress
from neva_pack.samples import SampleBuilder

from neva_pack.pipeline.plan_input import DECODE_SKIPS_NOTE, laid_out_lengths, lengths_from_input
from neva_pack.pipeline.shard_status import ShardState, ShardsStatus, shards_status
from neva_pack.pipeline.staging import needs_staging, staged, staged_output



@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    reports: dict[int, RunReport]
    """Pack size -> everything its stats file holds: counts, skips by reason, packing figures, overrides."""
    exit_code: int
    """0, or 1 when --strict and a record was skipped."""
    notes: tuple[str, ...] = ()
    """Lines for the user beyond the reports (what a shard's run did, and what comes next)."""

    @property
    def report(self) -> RunReport:
        """The report of the largest pack size (the only one, unless --pack_sizes)."""
        return self.reports[max(self.reports)]


def preprocess(config: PreprocessConfig, progress: bool = True) -> RunResult:
    """The whole run: the only place, with the stage wiring below, that sees the whole config; each
    stage is handed its part (``config.sample`` / ``config.pack`` / ``config.run``) or less."""
    if needs_staging(config):  # an s3:// input or output: the same run on a local staging directory
        with staged(config) as local:
            return preprocess(local, progress)
    started = time.perf_counter()
    builder = build_sample_builder(config)
    refuse_doomed_run(config.sample.data_path, builder, config.pack.output_format, config.sample.hf_vision_encoder)
    run = config.run
    inputs = input_digests(config.sample, exclude=run.output_dir)  # what a resume, and the check before each publish, compare
    if run.num_shards is not None and run.shard_index is not None:
        note = encode_part(config.sample, run, builder, progress, resume_fingerprint=config.sample_fingerprint(), inputs=inputs)
        return RunResult(reports={}, exit_code=0, notes=(note,))
    with prepare_output_dir(run, _inputs(config.sample), keep_store=run.num_shards is not None) as lock:
        return _run(config, builder, lock.path.parent, progress, started, inputs)


def run_shard(config: PreprocessConfig, index: int, num_shards: int, progress: bool = True) -> RunResult:
    """Encode shard ``index`` of ``num_shards`` into its own part of ``config.run.output_dir``'s sample
    store: what a SLURM array task, a Kubernetes Indexed Job's pod or a Ray task runs (``preprocess``
    with --num_shards and --shard_index; the config's own are replaced). Give the config
    ``resume=True`` where an engine restarts a failed shard with the same arguments (a Kubernetes pod,
    a Ray task retried): the restart continues from the part's last committed segment, and a shard
    never started starts. Then ``finish_shards`` joins the parts."""
    return preprocess(_sharded(config, num_shards, index), progress)


def finish_shards(config: PreprocessConfig, num_shards: int | None = None, progress: bool = True) -> RunResult:
    """The final step of a sharded run, once every shard is done: check the parts, join them, pack and
    write (``preprocess`` with --num_shards and no --shard_index; ``num_shards`` defaults to the
    config's). The output is byte-identical to a run without shards; a shard not done is refused,
    naming it, with the lines that resubmit the missing ones."""
    num_shards = config.run.num_shards if num_shards is None else num_shards
    if num_shards is None:
        raise ConfigError("finish_shards: give num_shards (the run's --num_shards)")
    return preprocess(_sharded(config, num_shards, None), progress)


def _sharded(config: PreprocessConfig, num_shards: int, index: int | None) -> PreprocessConfig:
    """The config with this shard's split (validated by RunConfig as the flags are)."""
    run = dataclasses.replace(config.run, num_shards=num_shards, shard_index=index)
    return PreprocessConfig(sample=config.sample, pack=config.pack, run=run)


def _inputs(sample: SampleConfig) -> dict[str, Path | None]:
    """The run's inputs by flag: what --overwrite must refuse to delete (``ownership.owned_outputs``)."""
    return {"data_path": sample.data_path, "image_folder": sample.image_folder, "tokenizer_path": sample.tokenizer_path}


def _run(
    config: PreprocessConfig, builder: SampleBuilder, output_dir: Path, progress: bool, started, inputs: dict
) -> RunResult:  # fmt: skip
    """Every stage, while the output directory's lock is held. With --num_shards (and no
    --shard_index) this is the final step of a sharded run: the parts are checked and joined
    into the sample store instead of encoding, and the rest is the same. ``inputs``: the digests
    of the inputs when the run started (``pipeline/inputs.py``)."""
    sample, run, sizes = config.sample, config.run, config.pack.sizes
    digest = inputs["data_path"]
    store_directory = paths.store_dir(output_dir)
    if run.resume and not store_directory.exists():
        published = _published({size: config.write_settings(size) for size in sizes}, output_dir, digest, sample.data_path)
        if published is not None:  # every prefix was published (and the store dropped) before: nothing to redo
            return _result(published, run.strict)
    index = index_records(sample.data_path, every=records_per_message(sample), progress=progress)
    total = index.count
    resume_fingerprint = config.sample_fingerprint()
    if run.num_shards is None:
        if run.resume and (store_directory / PROGRESS_FILE).is_file():
            check_resumed_inputs(store_directory, read_progress(store_directory), inputs)
        encode_samples(sample, run, builder, store_directory, output_dir, index, progress, input_digest=digest,
                       fingerprint=resume_fingerprint, extra={INPUTS_KEY: inputs})  # fmt: skip
    else:
        fingerprint = content_fingerprint(sample, builder, total, resume_fingerprint, inputs)
        images = store_images(sample, builder)
        join_parts(
            store_directory, run.num_shards, total, fingerprint, images.image_shape, resume_fingerprint,
            image_run=images.image_run, ignore_index=sample.ignore_index, data_path=sample.data_path,
            image_processor=images.image_processor, frame_compression=images.frame_compression,
        )  # fmt: skip
    store = SampleStore(store_directory)
    write_run_skipped(store.skipped_files(), output_dir)
    skipped = sum(store.skipped_by_reason.values())
    if run.num_shards is not None and skipped > run.max_skip_fraction * total:  # each part checked only its own
        raise too_many_skipped(run.max_skip_fraction, skipped, f"the {total}", output_dir)
    if total == 0:
        raise InputError(f"--data_path {sample.data_path}: holds no records (an empty file, an empty list [] or only blank lines)")
    if len(store) == 0 and store.skipped_by_reason.get(IMAGES_NOT_HELD) == total:
        raise images_not_held_error(sample.data_path, config.pack.output_format)
    if len(store) == 0:
        raise InputError(
            f"none of the {total} record(s) of {sample.data_path} could be used; reasons in {output_dir / paths.SKIPPED_FILE}"
        )
    reports = {}
    for size in sizes:
        reports[size] = _write_prefix(config, builder, store, index, size, output_dir, progress, started, inputs)
    if run.drop_store:
        drop_store(output_dir, [paths.packed_prefix(output_dir, size if len(sizes) > 1 else None) for size in sizes])
    return _result(reports, run.strict)


def _result(reports: dict[int, RunReport], strict: bool) -> RunResult:
    """The run's result: with --strict, exit 1 when any pack size skipped a record."""
    strict_failure = strict and any(report.records.skipped > 0 for report in reports.values())
    return RunResult(reports=reports, exit_code=1 if strict_failure else 0)


def _published(settings: dict[int, dict], output_dir: Path, digest: str, data_path: Path) -> dict[int, RunReport] | None:
    """--resume where the sample store is gone (--drop_store after a complete run): the reports of the
    published prefixes when every pack size (``settings``: size -> its writing settings,
    ``PreprocessConfig.write_settings``) was published from this very input with these settings;
    None when one is missing (the run starts the store again)."""
    reports = {}
    for size, written in settings.items():
        named_size = size if len(settings) > 1 else None
        prefix = paths.packed_prefix(output_dir, named_size)
        report = resumed_prefix(prefix, paths.stats_path(output_dir, named_size), written, digest, data_path)
        if report is None:
            return None
        reports[size] = report
    return reports


def _write_prefix(
    config: PreprocessConfig, builder, store, index: RecordIndex, size: int, output_dir: Path, progress: bool, started,
    inputs: dict,
) -> RunReport:  # fmt: skip
    """Pack the store for one pack size and publish its prefix (skipped when --resume finds it complete):
    the wiring of one size's stages (pack, assemble and write, report, meta), each given its part of
    the config. Right before publishing, every input must still hold what it held when the run
    started (``inputs``): one that changed while the run read it is refused, nothing published."""
    sample, settings, run = config.sample, config.pack, config.run
    digest = inputs["data_path"]
    total = index.count
    named_size = size if len(settings.sizes) > 1 else None
    prefix = paths.packed_prefix(output_dir, named_size)
    stats_file = paths.stats_path(output_dir, named_size)
    written = config.write_settings(size)
    if run.resume:
        published = resumed_prefix(prefix, stats_file, written, digest, sample.data_path)
        if published is not None:
            return published  # published before the interruption, with these settings
    multiple = settings.alignment
    rows, cuts, unsupervised = rows_at(store, aligned_capacity(size, multiple), sample.ignore_index)
    padded = padded_lengths(rows["length"], multiple)  # what is packed (== length when multiple is 1)
    over_budget = np.setdiff1d(over_image_budget(rows, settings.max_images_per_pack, settings.max_image_tokens_per_pack, settings.max_video_tokens_per_pack), unsupervised)
    size_skips = {"no_supervised_tokens": unsupervised, OVER_IMAGE_BUDGET: over_budget}  # this size's own skips, by reason
    kept = np.setdiff1d(np.arange(len(rows), dtype=np.int64), np.concatenate([unsupervised, over_budget]))
    if len(kept) == 0:
        raise InputError(f"pack size {size}: the cut leaves none of the {len(rows)} sample(s) a trained label"
                         + (" within the visual budgets (--max_images_per_pack / --max_image_tokens_per_pack / --max_video_tokens_per_pack)" if len(over_budget) else ""))  # fmt: skip
    plan = pack_kept(settings, padded, rows, kept, size)
    family = builder.preprocessor
    encoder = store.image_processor["encoder"] if store.image_processor else family.encoder.name  # as the meta records it
    plan, balance_report = balance(settings, plan, rows, encoder=encoder, family=family.family)
    fmt = output_format(settings.output_format)
    spec = WriteSpec(
        image_shape=family.stored_shape,
        normalisation=family.model_normalisation,
        pad_id=settings.pad_id,
        ignore_index=sample.ignore_index,
        pool=tuple(store.pool_segments),
        plan_digest=plan_digest(plan, padded, written),
        image_run=builder.image_run,
        image_processor=store.image_processor,
    )
    remove_stale_tmp(prefix, spec.plan_digest)
    writer = fmt.writer(prefix, spec, resume=run.resume)
    checks = pack_spec(settings, builder, size)
    every = max(1, run.checkpoint_every // 10)
    job = PackJob(store=store, plan=plan, cuts=cuts, pad_to_multiple_of=multiple, checks=checks,
                  prepare=functools.partial(fmt.prepare, spec=spec))  # fmt: skip
    write_packs(job, writer, every, progress, fmt.needs_pixels, run.num_workers)
    report = run_report(
        settings, builder, store, rows, plan, padded, kept, {reason: len(skips) for reason, skips in size_skips.items()},
        balance_report, total, prefix, time.perf_counter() - started, data_path=sample.data_path,
    ).replace(input_digest=digest)  # fmt: skip
    problem = invariants.accounting_problem(total, report.records.packed, report.records.skipped)
    if problem is not None:
        raise OutputError(f"{prefix}: {problem}; nothing was published (run again with --overwrite)")
    skipped_file = paths.skipped_path(output_dir, named_size)
    own_records = {reason: np.sort(store.rows["record_index"][skips]).astype(np.int64) for reason, skips in size_skips.items()}
    every_own = np.sort(np.concatenate(list(own_records.values())))
    ids = record_ids(sample.data_path, every_own, builder.record_limits, index) if len(every_own) else {}
    details = size_skip_details(size, settings.max_images_per_pack, settings.max_image_tokens_per_pack, settings.max_video_tokens_per_pack)
    write_size_skipped(output_dir / paths.SKIPPED_FILE, skipped_file, own_records, ids, details)
    check_unchanged(sample, inputs, prefix.name, exclude=output_dir)
    paths.write_json_atomic(stats_file, report.to_json())
    writer.publish(
        PlanTable.of(rows, plan, multiple),
        extra_files=[stats_file, skipped_file],
        meta=packed_meta(sample, config.meta_settings(report.max_seq_length), builder, spec, report),
    )
    return report

__all__ = [
    "DECODE_SKIPS_NOTE",
    "LOCK_FILE",
    "OutputLock",
    "RunResult",
    "ShardState",
    "ShardsStatus",
    "better_algorithm",
    "build_sample_builder",
    "entries",
    "finish_shards",
    "laid_out_lengths",
    "lengths_from_input",
    "owned_outputs",
    "preprocess",
    "record_stops",
    "remove",
    "run_shard",
    "sample_builder_for",
    "shards_status",
    "staged_output",
    "size_skip_details",
    "write_size_skipped",
]
