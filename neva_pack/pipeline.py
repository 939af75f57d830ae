"""preprocess(config): the stages wired together, each with a progress bar.

    records --DataLoader workers--> StoredBatch (the store bytes of 32 records, 256 text-only; their skips) --> sample store shards (committed at checkpoints)
    store lengths --pack()--> PackingPlan --assembled and checked (in workers for large plans)--> typed packs --format writer (checkpointed)-->
    packed_seq_dataset.* (nemo: .bin/.idx/.plan.npz; compact: .tokens/.labels/.index.bin + the store's pool)
    --> stats.json, skipped.jsonl (skipped_<size>.jsonl: with the size's own skips) --> meta.json with checksums, last

A run killed at any point resumes with --resume: committed shards are kept, packing is
recomputed (it is a pure function of the lengths), and the writer continues after its last
checkpoint; the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack import __version__, invariants, shards
from neva_pack import paths
from neva_pack import output_dir as ownership
from neva_pack.assemble import rows_at
from neva_pack.formats import output_format, sample_store, temporary_files
from neva_pack.formats.base import Checkpoint, WriteSpec
from neva_pack.formats.meta import META_VERSION, Counts, ImageTokenIds, PackedMeta, read_meta_json
from neva_pack.formats.sample_store import check_settings
from neva_pack.config import PreprocessConfig
from neva_pack.encoders import resolve_encoder
from neva_pack.errors import ConfigError, InputError, OutputError
from neva_pack.images import ImagePreprocessor, ImageSource
from neva_pack.packing import RECOMMENDED_ALGORITHM, PackingPlan, pack
from neva_pack.packing.alignment import aligned_capacity, padded_lengths
from neva_pack.packing.balance import PackCosts, balance_order, reorder_plan, straggler_overhead
from neva_pack.parallel_assembly import PackJob, pack_batches
from neva_pack.plan_table import PlanTable
from neva_pack.records import RecordIndex, RecordLimits, index_records, record_ids
from neva_pack.samples import (
    SampleBuilder,
    SampleStream,
    check_token_ids,
    image_token_layout,
    missing_nemo_specials,
    received,
)
from neva_pack.report import AlgorithmSuggestion, BalanceReport, RecordCounts, RunReport, read_report
from neva_pack.stats import arrays_from_plan, global_batch_size_advice, packing_stats, training_overrides
from neva_pack.templates import load_template
from neva_pack.tokenizer import load_tokenizer
from neva_pack.workers import worker_messages

SKIP_CHECK_AFTER = 1_000
"""--max_skip_fraction is checked once this many records were read (and at the end)."""
SUGGEST_WHEN_SAVING = 0.01
"""Suggest the recommended algorithm when it would need at least this fraction fewer packs."""
RECORDS_PER_MESSAGE = 32
"""Records a DataLoader worker encodes and sends as one message (a round trip per record costs more
than tokenizing a short one)."""
TEXT_RECORDS_PER_MESSAGE = 256
"""Records per message of a run without an image folder: a text-only message is a few hundred KB,
and each message costs the main process a round trip (~1.3 ms: 5 us a record at this size)."""
FIRST_RECORDS_PER_MESSAGE = 1
"""Records of each worker's first message: the first sample reaches the main process after one
record's work (~20 ms with an image), not a whole message's."""
MESSAGES_IN_FLIGHT = 2
"""Messages each worker may have queued ahead (x RECORDS_PER_MESSAGE x ~0.35 MB per 336 px image:
what bounds the main process's memory)."""


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


def build_sample_builder(config: PreprocessConfig) -> SampleBuilder:
    """Load tokenizer, template, encoder settings and image source: every ConfigError surfaces here."""
    tokenizer = load_tokenizer(config.tokenizer_path)
    template = load_template(config.conv_template, config.tokenization)
    encoder = resolve_encoder(config.hf_vision_encoder, config.patch_dim)
    if config.crop_size is not None and tuple(config.crop_size) != encoder.crop_size:
        raise ConfigError(
            f"crop_size {list(config.crop_size)} disagrees with {encoder.name}'s processor ({list(encoder.crop_size)})"
        )
    preprocessor = ImagePreprocessor(encoder, config.image_aspect_ratio, max_pixels=config.max_image_pixels)
    layout_ = image_token_layout(
        tokenizer,
        encoder.image_tokens,
        use_im_start_end=config.use_im_start_end,
        patch_id=config.image_patch_id,
        start_id=config.image_start_id,
        end_id=config.image_end_id,
        tokenization=config.tokenization,
        patch_token=template.image_patch_token,
    )
    problem = missing_nemo_specials(tokenizer, config.tokenization, layout_)
    if problem is not None:
        if config.strict:
            raise ConfigError(f"--strict: {problem}")
        print(f"warning: {problem}", file=sys.stderr)
    if len(config.sizes) > 1 and config.sizes[0] < layout_.positions + 2:
        raise ConfigError(
            f"--pack_sizes {list(config.sizes)}: every size must hold an image run ({layout_.positions} positions) "
            "and a token more, or a sample cut for it could be left empty"
        )
    output_format(config.output_format).check_settings(vocab_size=tokenizer.vocab_size)
    check_token_ids(layout_, tokenizer.vocab_size, pad_id=config.pad_id, ignore_index=config.ignore_index)
    image_source = ImageSource(
        config.image_folder, max_bytes=config.max_image_bytes, allow_outside=config.allow_outside_image_folder
    )
    return SampleBuilder(
        tokenizer=tokenizer,
        template=template,
        image_source=image_source,
        preprocessor=preprocessor,
        layout=layout_,
        max_seq_length=aligned_capacity(config.max_seq_length, config.alignment),
        truncate=config.truncate,
        ignore_index=config.ignore_index,
        system_prompt=config.system_prompt,
        tokenization=config.tokenization,
        record_limits=RecordLimits(max_bytes=config.max_record_bytes, max_depth=config.max_record_depth),
        max_conversation_chars=config.max_conversation_chars,
        max_image_pixels=config.max_image_pixels,
    )


def pack_spec(config: PreprocessConfig, builder: SampleBuilder, size: int) -> invariants.PackSpec:
    """What every pack of this run must satisfy (checked before each is written)."""
    return invariants.PackSpec(
        max_seq_length=size,
        ignore_index=config.ignore_index,
        image_positions=builder.layout.positions,
        patch_id=builder.layout.patch_id,
        start_id=builder.layout.start_id,
        end_id=builder.layout.end_id,
        pad_id=config.pad_id,
    )


def sample_fingerprint(config: PreprocessConfig) -> dict:
    """Everything that decides the samples: a resumed run must match it exactly."""
    data = Path(config.data_path).resolve()
    stat = data.stat()
    return {
        "data_path": str(data),
        "data_size": stat.st_size,
        "data_mtime_ns": stat.st_mtime_ns,
        "image_folder": None if config.image_folder is None else str(Path(config.image_folder).resolve()),
        "tokenizer_path": str(Path(config.tokenizer_path).resolve()),
        "conv_template": config.conv_template,
        "hf_vision_encoder": config.hf_vision_encoder,
        "image_aspect_ratio": config.image_aspect_ratio,
        "max_seq_length": aligned_capacity(config.max_seq_length, config.alignment),
        "truncate": config.truncate,
        "ignore_index": config.ignore_index,
        "use_im_start_end": config.use_im_start_end,
        "patch_dim": config.patch_dim,
        "image_ids": [config.image_patch_id, config.image_start_id, config.image_end_id],
        "system_prompt": config.system_prompt,
        "tokenization": config.tokenization,
        "budgets": [config.max_record_bytes, config.max_record_depth, config.max_conversation_chars,
                    config.max_image_bytes, config.max_image_pixels, config.allow_outside_image_folder],
        "neva_pack": __version__,
    }


def preprocess(config: PreprocessConfig, progress: bool = True) -> RunResult:
    started = time.perf_counter()
    builder = build_sample_builder(config)
    if config.num_shards is not None and config.shard_index is not None:
        return _encode_part(config, builder, progress)
    with _prepare_output_dir(config, keep_store=config.num_shards is not None) as lock:
        return _run(config, builder, lock.path.parent, progress, started)


def _run(config: PreprocessConfig, builder: SampleBuilder, output_dir: Path, progress: bool, started) -> RunResult:
    """Every stage, while the output directory's lock is held. With --num_shards (and no
    --shard_index) this is the final step of a sharded run: the parts are checked and joined
    into the sample store instead of encoding, and the rest is the same."""
    index = index_records(config.data_path, every=records_per_message(config), progress=progress)
    total = index.count
    store_directory = paths.store_dir(output_dir)
    if config.num_shards is None:
        _encode_samples(config, builder, store_directory, output_dir, index, progress)
    else:
        resume_fingerprint = sample_fingerprint(config)
        fingerprint = shards.content_fingerprint(config, builder, total, resume_fingerprint)
        shards.join_parts(
            store_directory, config.num_shards, total, fingerprint, builder.preprocessor.shape, resume_fingerprint,
            image_run=builder.layout.run(), ignore_index=config.ignore_index,
        )  # fmt: skip
    store = sample_store.SampleStore(store_directory)
    _write_skipped(store.skipped_files(), output_dir)
    skipped = sum(store.skipped_by_reason.values())
    if config.num_shards is not None and skipped > config.max_skip_fraction * total:  # each part checked only its own
        raise _too_many_skipped(config, skipped, f"the {total}", output_dir)
    if len(store) == 0:
        raise InputError(
            f"none of the {total} record(s) of {config.data_path} could be used; reasons in {output_dir / paths.SKIPPED_FILE}"
        )
    reports = {}
    for size in config.sizes:
        reports[size] = _write_prefix(config, builder, store, index, size, output_dir, progress, started)
    if config.drop_store:
        _drop_store(output_dir, [paths.packed_prefix(output_dir, size if len(config.sizes) > 1 else None) for size in config.sizes])
    strict_failure = config.strict and any(report.records.skipped > 0 for report in reports.values())
    return RunResult(reports=reports, exit_code=1 if strict_failure else 0)


def _write_prefix(
    config, builder, store, index: RecordIndex, size: int, output_dir: Path, progress: bool, started
) -> RunReport:
    """Pack the store for one pack size and publish its prefix (skipped when --resume finds it complete)."""
    total = index.count
    named_size = size if len(config.sizes) > 1 else None
    prefix = paths.packed_prefix(output_dir, named_size)
    stats_file = paths.stats_path(output_dir, named_size)
    settings = write_settings(config, size)
    if config.resume:
        published = _resumed_prefix(prefix, stats_file, settings)
        if published is not None:
            return published  # published before the interruption, with these settings
    multiple = config.alignment
    rows, cuts, unsupervised = rows_at(store, aligned_capacity(size, multiple), builder.layout.positions, config.ignore_index)
    padded = padded_lengths(rows["length"], multiple)  # what is packed (== length when multiple is 1)
    kept = np.setdiff1d(np.arange(len(rows), dtype=np.int64), unsupervised)
    if len(kept) == 0:
        raise InputError(f"pack size {size}: the cut leaves none of the {len(rows)} sample(s) a trained label")
    plan = _pack_kept(config, padded, kept, size)
    plan, balance = _balance(config, plan, rows)
    fmt = output_format(config.output_format)
    spec = WriteSpec(
        image_shape=tuple(builder.preprocessor.shape),
        normalisation=builder.preprocessor.normalisation(),
        pad_id=config.pad_id,
        ignore_index=config.ignore_index,
        pool=tuple(store.pool_parts),
        plan_digest=_plan_digest(plan, padded, settings),
        image_run=tuple(int(v) for v in builder.layout.run()),
    )
    _remove_stale_tmp(prefix, spec.plan_digest)
    writer = fmt.writer(prefix, spec, resume=config.resume)
    checks = pack_spec(config, builder, size)
    every = max(1, config.checkpoint_every // 10)
    job = PackJob(store=store, plan=plan, cuts=cuts, pad_to_multiple_of=multiple, checks=checks,
                  prepare=functools.partial(fmt.prepare, spec=spec))
    _write_packs(job, writer, every, progress, fmt.needs_pixels, config.num_workers)
    report = _report(
        config, builder, store, rows, plan, padded, kept, len(unsupervised), balance, total, prefix, time.perf_counter() - started
    )
    problem = invariants.accounting_problem(total, report.records.packed, report.records.skipped)
    if problem is not None:
        raise OutputError(f"{prefix}: {problem}; nothing was published (run again with --overwrite)")
    skipped_file = paths.skipped_path(output_dir, named_size)
    cut_records = np.sort(store.rows["record_index"][unsupervised]).astype(np.int64)
    ids = record_ids(config.data_path, cut_records, builder.record_limits, index) if len(cut_records) else {}
    _write_size_skipped(output_dir / paths.SKIPPED_FILE, skipped_file, cut_records, ids, size)
    paths.write_json_atomic(stats_file, report.to_json())
    writer.publish(
        PlanTable.of(rows, plan, multiple),
        extra_files=[stats_file, skipped_file],
        meta=_meta(config, builder, spec, report),
    )
    return report


BALANCE_STREAM = 1
"""Second number of the balance generator's seed, (seed, 1): independent of the packer's stream."""


def _balance(config: PreprocessConfig, plan: PackingPlan, rows: np.ndarray) -> tuple[PackingPlan, BalanceReport | None]:
    """With --balance_data_parallel N: the plan's packs reordered so that every N consecutive packs
    cost alike, and the straggler overheads before (the packer's order) and after."""
    group = config.balance_data_parallel
    if not group:
        return plan, None
    chosen = rows[plan.indices]
    costs = PackCosts.of(chosen["length"], plan.offsets, chosen["num_images"])
    order = balance_order(costs, group, np.random.default_rng((config.seed, BALANCE_STREAM)))
    overheads = {
        f"{name}_overhead_{when}": straggler_overhead(getattr(costs, name), group, arrangement)
        for name in ("attention", "tokens", "images")
        for when, arrangement in (("before", None), ("after", order))
    }
    return reorder_plan(plan, order), BalanceReport(data_parallel=group, **overheads)


def _drop_store(output_dir: Path, prefixes: list[Path]) -> None:
    """--drop_store: remove the sample store once every prefix verifies (what remains stands alone)."""
    from neva_pack.verify import verify

    for prefix in prefixes:
        result = verify(prefix, progress=False)
        if not result.ok:
            raise InputError(f"{prefix}: the output did not verify ({result.problems[0]}); the sample store is kept")
    shutil.rmtree(paths.store_dir(output_dir))


def _pack_kept(config: PreprocessConfig, padded: np.ndarray, kept: np.ndarray, size: int) -> PackingPlan:
    """The plan of the samples ``kept`` at this size, its indices into the store's rows (all of
    them when none is left out: the same plan as packing every row)."""
    plan = pack(
        padded[kept], size, algorithm=config.packing_algorithm, seed=config.seed, max_samples_per_pack=config.max_samples_per_pack
    )
    return replace(plan, indices=kept[plan.indices])


def _write_size_skipped(
    run_file: Path, target: Path, records: np.ndarray, ids: dict[int, str | None], size: int
) -> None:
    """One prefix's skipped list (atomically): the run's lines and this size's own (the
    ``records``, increasing, that its cut leaves without a trained label; ``ids``: their ids),
    by record index. Without own skips at the run's own size (a single-size run), the run's list
    is already it."""
    if target == run_file and len(records) == 0:
        return
    detail = f"no trained label after truncation to pack size {size}"
    skips = (
        {"index": int(index), "id": ids.get(int(index)), "reason": "no_supervised_tokens", "detail": detail}
        for index in records
    )
    own = [(skip["index"], json.dumps(skip) + "\n") for skip in skips]
    tmp = target.with_name(target.name + ".tmp")
    with open(run_file, encoding="utf-8") as run, open(tmp, "w", encoding="utf-8") as out:
        lines = ((json.loads(line)["index"], line) for line in run if line.strip())
        for _, line in heapq.merge(lines, own, key=lambda pair: pair[0]):
            out.write(line)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(target)


def _prepare_output_dir(config: PreprocessConfig, keep_store: bool = False) -> ownership.OutputLock:
    """Lock the output directory for this run (returned, held) after checking what is in it:
    a non-empty directory is refused (untouched) unless --resume or --overwrite, and these touch
    only what neva-pack recognises as its own output (see ``neva_pack.output_dir``). With
    ``keep_store`` (the final step of a sharded run) the sample store, where the parts are, is
    expected and never removed."""
    output_dir = Path(config.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    store = paths.store_dir(output_dir)

    def refuse_if_not_empty():
        entries = [name for name in ownership.entries(output_dir) if not (keep_store and name == store.name)]
        if entries and not (config.resume or config.overwrite):
            raise ConfigError(
                f"--output_dir {output_dir}: not empty ({entries[0]}{', ...' if len(entries) > 1 else ''}); "
                "pass --resume to continue an interrupted run or --overwrite to replace it"
            )

    refuse_if_not_empty()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = ownership.OutputLock(output_dir).acquire()
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write ({exc.strerror or exc})") from None
    try:
        refuse_if_not_empty()  # another run may have written here before this one got the lock
        inputs = {"data_path": config.data_path, "image_folder": config.image_folder, "tokenizer_path": config.tokenizer_path}
        owned = ownership.owned_outputs(output_dir, inputs if config.overwrite else {})
        if keep_store:
            owned = [path for path in owned if path != store]
        if config.overwrite:
            ownership.remove(owned)
    except BaseException:
        lock.release()
        raise
    return lock


def _encode_part(config: PreprocessConfig, builder: SampleBuilder, progress: bool) -> RunResult:
    """--num_shards N --shard_index i: encode shard i's record range into its own part of the sample
    store (neva_pack.shards). The parts of a run are written at the same time by several nodes, so
    each locks only its own part directory, and --resume / --overwrite touch only that part."""
    output_dir = Path(config.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    index = index_records(config.data_path, every=records_per_message(config), progress=progress)
    total = index.count
    first, end = shards.shard_range(total, config.num_shards, config.shard_index)
    part = paths.part_dir(paths.store_dir(output_dir), config.num_shards, config.shard_index)
    try:
        part.mkdir(parents=True, exist_ok=True)
        lock = ownership.OutputLock(part).acquire()
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write ({exc.strerror or exc})") from None
    with lock:
        _prepare_part_dir(config, part)
        resume_fingerprint = sample_fingerprint(config)
        partition = shards.Partition(
            num_shards=config.num_shards,
            shard_index=config.shard_index,
            total_records=total,
            first_record=first,
            end_record=end,
            fingerprint=shards.content_fingerprint(config, builder, total, resume_fingerprint),
        )
        extra = {"partition": partition.to_json()}
        _encode_samples(config, builder, part, part, index, progress, first=first, end=end, extra=extra)
    note = (
        f"shard {config.shard_index} of {config.num_shards}: records {first}..{end - 1} encoded into {part}; "
        f"once every shard is done, run the same command without --shard_index to pack"
    )
    return RunResult(reports={}, exit_code=0, notes=(note,))


def _prepare_part_dir(config: PreprocessConfig, part: Path) -> None:
    """A part's directory is its own output: non-empty needs --resume, or --overwrite (which
    removes what a part holds, and refuses anything else)."""
    entries = ownership.entries(part)
    if not entries:
        return
    if not (config.resume or config.overwrite):
        raise ConfigError(f"{part}: this shard was started before; pass --resume to continue it or --overwrite to redo it")
    if config.overwrite:
        strangers = [name for name in entries if not shards.is_part_file(name)]
        if strangers:
            raise ConfigError(f"{part}: holds {strangers[0]}, which a store part does not; move it away (nothing was deleted)")
        ownership.remove([part / name for name in entries])


def _encode_samples(
    config, builder, store_directory: Path, report_dir: Path, index: RecordIndex, progress: bool, first: int = 0,
    end: int | None = None, extra: dict | None = None,
) -> None:
    """Stream samples of records [first, end) from the DataLoader into the store at ``store_directory``,
    committing a store shard every checkpoint. The workers seek to their records by ``index``."""
    end = index.count if end is None else end
    writer = sample_store.SampleStoreWriter(
        store_directory, builder.preprocessor.shape, sample_fingerprint(config), resume=config.resume,
        first_record=first, extra=extra, image_run=builder.layout.run(), ignore_index=config.ignore_index,
    )  # fmt: skip
    start = writer.next_record
    skipped = sum(sum(s.skipped_by_reason.values()) for s in writer.shards)
    if start < end:
        stream = SampleStream(
            config.data_path, builder, start=start, end=end, batch_size=records_per_message(config),
            first_batch_size=FIRST_RECORDS_PER_MESSAGE, index=index,
            share_images=images_in_shared_memory(config, builder.preprocessor.shape),
        )  # fmt: skip
        bar = tqdm(total=end - first, initial=start - first, desc="tokenize + images", unit="rec", disable=not progress)
        messages = worker_messages(stream, config.num_workers, MESSAGES_IN_FLIGHT)
        checked = None  # skipped records when the skip fraction was last checked (it grows only with a skip)
        done = start
        try:
            for batch in map(received, messages):
                if batch.first_record != done:
                    raise RuntimeError(f"a message starts at record {batch.first_record}, expected {done} (a bug)")
                for stop in _record_stops(batch, config.checkpoint_every, first + SKIP_CHECK_AFTER):
                    writer.append_stored(batch, done, stop)
                    skipped += sum(done <= item.index < stop for item in batch.skipped)
                    done = stop
                    if done % config.checkpoint_every == 0 and done < end:
                        writer.commit(done)
                    if (done - first >= SKIP_CHECK_AFTER and skipped != checked) or done == end:
                        _check_skip_fraction(config, writer, skipped, done - first, report_dir)
                        checked = skipped
                if batch.skipped:
                    bar.set_postfix(skipped=skipped, refresh=False)
                bar.update(batch.records)
        finally:  # kills the workers at once when the run stops early (an error, Ctrl-C, SIGTERM)
            messages.close()
        bar.close()
    writer.finish(end)


def records_per_message(config: PreprocessConfig) -> int:
    """Messages of an image run stay small (they bound the main process's memory); text-only runs,
    whose samples are a few KB, send larger ones."""
    return RECORDS_PER_MESSAGE if config.image_folder is not None else TEXT_RECORDS_PER_MESSAGE


SHARED_IMAGES_PER_RECORD = 4
"""Images a record is taken to carry when sizing the shared memory that messages in flight need."""
SHARED_MEMORY = Path("/dev/shm")


def images_in_shared_memory(config: PreprocessConfig, image_shape) -> bool:
    """Whether the workers' images may cross in shared memory (torch puts a tensor in /dev/shm):
    only where /dev/shm holds twice what the messages in flight could take (a container's is
    often 64 MB, where torch's workers die of a bus error); otherwise they go through the pipe."""
    if config.image_folder is None or config.num_workers == 0:
        return False
    in_flight = config.num_workers * (MESSAGES_IN_FLIGHT + 1) * RECORDS_PER_MESSAGE * SHARED_IMAGES_PER_RECORD
    try:
        free = shutil.disk_usage(SHARED_MEMORY).free
    except OSError:  # no /dev/shm (not Linux)
        return False
    return free >= 2 * in_flight * int(np.prod(image_shape))


def _record_stops(batch, checkpoint_every: int, skip_check_from: int) -> list[int]:
    """Where to cut a message's records so that each checkpoint and skip-fraction check falls on
    the same record as when records are written one by one: after each checkpoint's last record,
    each skipped record, the record where checking starts, and the message's last record."""
    end = batch.first_record + batch.records
    stops = {end}
    stops.update(range(-(-(batch.first_record + 1) // checkpoint_every) * checkpoint_every, end, checkpoint_every))
    stops.update(item.index + 1 for item in batch.skipped)
    if batch.first_record < skip_check_from < end:
        stops.add(skip_check_from)
    return sorted(stops)


def _check_skip_fraction(config, writer, skipped: int, done: int, output_dir: Path) -> None:
    if skipped <= config.max_skip_fraction * done:
        return
    writer.commit(writer.first_record + done)  # done counts from the first record of the run (or shard)
    _write_skipped(writer.skipped_files(), output_dir)
    raise _too_many_skipped(config, skipped, f"the first {done}", output_dir)


def _too_many_skipped(config: PreprocessConfig, skipped: int, of_records: str, output_dir: Path) -> InputError:
    return InputError(
        f"{skipped} of {of_records} records were skipped (> --max_skip_fraction {config.max_skip_fraction}); "
        f"reasons in {output_dir / paths.SKIPPED_FILE}"
    )


def _write_skipped(parts: list[Path], output_dir: Path) -> None:
    """Concatenate the shards' skipped lines into skipped.jsonl (atomically)."""
    target = output_dir / paths.SKIPPED_FILE
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    tmp.replace(target)


def _plan_digest(plan: PackingPlan, padded: np.ndarray, settings: dict) -> str:
    """Identifies what the writer writes: a resumed writer continues only for the same plan, padding
    and writing settings (``write_settings``; kept readable so that a resume can name one that differs)."""
    digest = hashlib.sha256()
    for array in (plan.offsets, plan.indices, padded):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return json.dumps({"plan": digest.hexdigest(), "settings": settings}, sort_keys=True)


def write_settings(config: PreprocessConfig, size: int) -> dict:
    """Every setting that decides the bytes of a pack size's published files beyond the samples
    (``sample_fingerprint``, checked by the sample store): a resumed prefix, finished or not, must
    have been written with exactly these (the sizes are in the prefix's name, its size is here)."""
    return {
        "output_format": config.output_format,
        "max_seq_length": size,
        "packing_algorithm": config.packing_algorithm,
        "seed": config.seed,
        "max_samples_per_pack": config.max_samples_per_pack,
        "pad_to_multiple_of": config.alignment,  # the lcm with the parallel sizes' multiples
        "pad_id": config.pad_id,
        "ignore_index": config.ignore_index,
        "balance_data_parallel": config.balance_data_parallel,
        "global_batch_size": config.global_batch_size,  # stats.json's advice and training overrides
    }


META_SETTINGS = {"output_format": "format", "max_seq_length": "max_seq_length", "packing_algorithm": "algorithm",
                 "seed": "seed", "max_samples_per_pack": "max_samples_per_pack",
                 "pad_to_multiple_of": "pad_to_multiple_of", "pad_id": "pad_id", "ignore_index": "ignore_index",
                 "balance_data_parallel": "balance_data_parallel"}  # fmt: skip
"""write_settings key -> the meta field that records it (global_batch_size is in the stats file)."""


def _resumed_prefix(prefix: Path, stats_file: Path, settings: dict) -> RunReport | None:
    """--resume of one prefix: its report when it was published before the interruption (None when it
    was not), once its meta -- or, unfinished, the writer's checkpoint -- shows that it was written with
    these settings; otherwise ConfigError naming the setting (nothing is touched)."""
    meta_file = paths.meta_path(prefix)
    if meta_file.is_file() and stats_file.is_file():
        report = read_report(stats_file)
        meta = read_meta_json(meta_file)
        stored = {key: meta[field] for key, field in META_SETTINGS.items() if field in meta}
        stored["global_batch_size"] = report.global_batch_size
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


def _remove_stale_tmp(prefix: Path, digest: str) -> None:
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


def _write_packs(job: PackJob, writer, every: int, progress: bool, with_pixels: bool, workers: int) -> None:
    first = writer.num_packs
    plan = job.plan
    bar = tqdm(total=plan.num_bins, initial=first, desc=f"write packs of {plan.capacity}", unit="pack", disable=not progress)
    batches = pack_batches(job, start=first, workers=workers)
    try:
        for batch in batches:
            for b, problem in enumerate(batch.problems, start=batch.start):
                if problem is not None:
                    raise OutputError(f"pack {b} of {plan.capacity}: {problem}; nothing was published (a bug: please report it)")
            pixels = (job.store.pool.read(indices) for indices in batch.image_indices) if with_pixels else [None] * len(batch)
            writer.add_prepared(batch.prepared, pixels)
            end = batch.start + len(batch)
            if end // every > batch.start // every and end < plan.num_bins:
                writer.checkpoint()
            bar.update(len(batch))
    finally:
        batches.close()  # stops the assembling workers at once when the loop ends early (an error, Ctrl-C)
    bar.close()


def _better_algorithm(config: PreprocessConfig, lengths: np.ndarray, plan: PackingPlan) -> AlgorithmSuggestion | None:
    """What the recommended algorithm would give (it runs in well under a second)."""
    if config.packing_algorithm == RECOMMENDED_ALGORITHM:
        return None
    alternative = pack(
        lengths, plan.capacity, RECOMMENDED_ALGORITHM, seed=config.seed, max_samples_per_pack=config.max_samples_per_pack
    )
    if alternative.num_bins > plan.num_bins * (1 - SUGGEST_WHEN_SAVING):
        return None
    return AlgorithmSuggestion(
        algorithm=RECOMMENDED_ALGORITHM, packs=alternative.num_bins, saving=1 - alternative.num_bins / plan.num_bins
    )


def _report(
    config, builder, store, rows, plan, padded, kept, unsupervised: int, balance, total: int, prefix: Path, seconds: float
) -> RunReport:  # fmt: skip
    stats = packing_stats(arrays_from_plan(plan, rows, builder.layout.positions, padded, config.alignment))
    gbs = global_batch_size_advice(config.global_batch_size, stats.samples_per_pack.mean)
    skipped_by_reason = dict(store.skipped_by_reason)
    if unsupervised:  # cut at this size before all of their answers
        skipped_by_reason["no_supervised_tokens"] = skipped_by_reason.get("no_supervised_tokens", 0) + unsupervised
    return RunReport(
        dataset=Path(config.data_path).name,
        records=RecordCounts(
            total=total,
            packed=plan.num_samples,
            skipped=sum(skipped_by_reason.values()),
            truncated=int(rows["truncated"][plan.indices].sum()),
            skipped_by_reason=skipped_by_reason,
        ),
        packing=stats,
        algorithm=config.packing_algorithm,
        seed=config.seed,
        suggestion=_better_algorithm(config, padded[kept], plan),
        balance=balance,
        max_seq_length=plan.capacity,
        image_positions=builder.layout.positions,
        output_format=config.output_format,
        data_prefix=str(prefix),
        crop_size=list(builder.preprocessor.shape[1:]),
        global_batch_size=config.global_batch_size,
        packed_global_batch_size=gbs,
        training_overrides=training_overrides(str(prefix), builder.preprocessor.shape[1:], gbs, config.output_format),
        seconds=round(seconds, 3),
    )


def _meta(config: PreprocessConfig, builder: SampleBuilder, spec: WriteSpec, report: RunReport) -> PackedMeta:
    """Everything a reader needs; the writer fills in format, pack count, layout and checksums."""
    return PackedMeta(
        format=config.output_format,
        version=META_VERSION,
        num_packs=report.packing.packs,
        image_shape=spec.image_shape,
        normalisation=spec.normalisation,
        dataset=Path(config.data_path).name,
        template=builder.template.name,
        tokenization=builder.tokenization.name,
        tokenizer=str(config.tokenizer_path),
        vocab_size=builder.tokenizer.vocab_size,
        encoder=builder.preprocessor.encoder.name,
        image_aspect_ratio=config.image_aspect_ratio,
        image_positions=builder.layout.positions,
        image_token_ids=ImageTokenIds(patch=builder.layout.patch_id, start=builder.layout.start_id, end=builder.layout.end_id),
        ignore_index=config.ignore_index,
        pad_id=spec.pad_id,
        pad_to_multiple_of=config.alignment,
        balance_data_parallel=config.balance_data_parallel,
        max_seq_length=report.max_seq_length,
        algorithm=config.packing_algorithm,
        seed=config.seed,
        max_samples_per_pack=config.max_samples_per_pack,
        counts=Counts(
            records=report.records.total,
            samples=report.records.packed,
            skipped=report.records.skipped,
            truncated=report.records.truncated,
            packs=report.packing.packs,
            images=report.packing.images,
        ),
    )
