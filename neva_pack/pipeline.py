"""preprocess(config): the stages wired together, each with a progress bar.

    records --DataLoader workers--> Sample | Skipped --> sample store shards (committed at checkpoints)
    store lengths --pack()--> PackingPlan --writer (checkpointed)--> packed_seq_dataset.{bin,idx}
    --> plan table, stats.json, skipped.jsonl --> meta.json with checksums, last

A run killed at any point resumes with --resume: committed shards are kept, packing is
recomputed (it is a pure function of the lengths), and the writer continues after its last
checkpoint; the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack import __version__
from neva_pack import shards
from neva_pack import store as layout
from neva_pack.config import PreprocessConfig
from neva_pack.encoders import resolve_encoder
from neva_pack.errors import ConfigError, InputError
from neva_pack.images import ImagePreprocessor, ImageSource
from neva_pack.packing import RECOMMENDED_ALGORITHM, PackingPlan, pack
from neva_pack.records import count_records
from neva_pack.samples import SampleBuilder, SampleStream, Skipped, image_token_layout, passthrough, truncation
from neva_pack.stats import arrays_from_plan, global_batch_size_advice, packing_stats, training_overrides
from neva_pack.templates import load_template
from neva_pack.tokenizer import load_tokenizer

SKIP_CHECK_AFTER = 1_000
"""--max_skip_fraction is checked once this many records were read (and at the end)."""
SUGGEST_WHEN_SAVING = 0.01
"""Suggest the recommended algorithm when it would need at least this fraction fewer packs."""
RECORDS_PER_MESSAGE = 32
"""Records a DataLoader worker encodes and sends as one message (a round trip per record costs more
than tokenizing a short one)."""
MESSAGES_IN_FLIGHT = 2
"""Messages each worker may have queued ahead (x RECORDS_PER_MESSAGE x ~0.35 MB per 336 px image:
what bounds the main process's memory)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    reports: dict[int, dict]
    """Pack size -> everything its stats file holds: counts, skips by reason, packing figures, overrides."""
    exit_code: int
    """0, or 1 when --strict and a record was skipped."""
    notes: tuple[str, ...] = ()
    """Lines for the user beyond the reports (what a shard's run did, and what comes next)."""

    @property
    def report(self) -> dict:
        """The report of the largest pack size (the only one, unless --pack_sizes)."""
        return self.reports[max(self.reports)]


def build_sample_builder(config: PreprocessConfig) -> SampleBuilder:
    """Load tokenizer, template, encoder settings and image source: every ConfigError surfaces here."""
    tokenizer = load_tokenizer(config.tokenizer_path)
    template = load_template(config.conv_template)
    encoder = resolve_encoder(config.hf_vision_encoder, config.patch_dim)
    if config.crop_size is not None and tuple(config.crop_size) != encoder.crop_size:
        raise ConfigError(
            f"crop_size {list(config.crop_size)} disagrees with {encoder.name}'s processor ({list(encoder.crop_size)})"
        )
    preprocessor = ImagePreprocessor(encoder, config.image_aspect_ratio)
    layout_ = image_token_layout(
        tokenizer,
        encoder.image_tokens,
        use_im_start_end=config.use_im_start_end,
        patch_id=config.image_patch_id,
        start_id=config.image_start_id,
        end_id=config.image_end_id,
    )
    return SampleBuilder(
        tokenizer=tokenizer,
        template=template,
        image_source=ImageSource(config.image_folder),
        preprocessor=preprocessor,
        layout=layout_,
        max_seq_length=config.max_seq_length,
        truncate=config.truncate,
        ignore_index=config.ignore_index,
        system_prompt=config.system_prompt,
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
        "max_seq_length": config.max_seq_length,
        "truncate": config.truncate,
        "ignore_index": config.ignore_index,
        "use_im_start_end": config.use_im_start_end,
        "patch_dim": config.patch_dim,
        "image_ids": [config.image_patch_id, config.image_start_id, config.image_end_id],
        "system_prompt": config.system_prompt,
        "neva_pack": __version__,
    }


def preprocess(config: PreprocessConfig, progress: bool = True) -> RunResult:
    started = time.perf_counter()
    builder = build_sample_builder(config)
    if config.num_shards is not None:
        return _preprocess_sharded(config, builder, progress, started)
    output_dir = _prepare_output_dir(config)
    total = count_records(config.data_path, progress=progress)

    _encode_samples(config, builder, layout.store_dir(output_dir), output_dir, total, progress)
    return _pack_and_write(config, builder, output_dir, total, progress, started)


def _preprocess_sharded(config: PreprocessConfig, builder: SampleBuilder, progress: bool, started: float) -> RunResult:
    """A shard's part (--shard_index given), or the final step: join the parts, pack, write."""
    output_dir = Path(config.output_dir)
    total = count_records(config.data_path, progress=progress)
    fingerprint = shards.content_fingerprint(config, builder, total)
    store_directory = layout.store_dir(output_dir)
    if config.shard_index is None:
        _prepare_final_dir(config, output_dir)
        shards.join_parts(
            store_directory, config.num_shards, total, fingerprint, builder.preprocessor.shape, sample_fingerprint(config)
        )
        return _pack_and_write(config, builder, output_dir, total, progress, started)
    first, end = shards.shard_range(total, config.num_shards, config.shard_index)
    part = shards.part_dir(store_directory, config.num_shards, config.shard_index)
    _prepare_part_dir(config, part)
    partition = shards.Partition(
        num_shards=config.num_shards,
        shard_index=config.shard_index,
        total_records=total,
        first_record=first,
        end_record=end,
        fingerprint=fingerprint,
    )
    _encode_samples(config, builder, part, part, total, progress, first=first, end=end, extra={"partition": partition.to_json()})
    note = (
        f"shard {config.shard_index} of {config.num_shards}: records {first}..{end - 1} encoded into {part}; "
        f"once every shard is done, run the same command without --shard_index to pack"
    )
    return RunResult(reports={}, exit_code=0, notes=(note,))


def _prepare_part_dir(config: PreprocessConfig, part: Path) -> None:
    """A part's directory is its own output: non-empty needs --resume or --overwrite (which removes only it)."""
    if part.is_dir() and any(part.iterdir()):
        if config.overwrite:
            shutil.rmtree(part)
        elif not config.resume:
            raise ConfigError(f"{part}: this shard was started before; pass --resume to continue it or --overwrite to redo it")
    try:
        part.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output_dir {config.output_dir}: cannot write ({exc.strerror or exc})") from None


def _prepare_final_dir(config: PreprocessConfig, output_dir: Path) -> None:
    """The final step finds the parts in the sample store; any other output needs --resume or --overwrite."""
    store_name = layout.store_dir(output_dir).name
    others = sorted(p.name for p in output_dir.iterdir() if p.name != store_name) if output_dir.is_dir() else []
    if others and not (config.resume or config.overwrite):
        raise ConfigError(
            f"--output_dir {output_dir}: already holds {others[0]}; pass --resume to continue the final step "
            "or --overwrite to write it again (the shards' parts are kept)"
        )
    if config.overwrite:
        for path in layout.output_paths(output_dir):
            if path.name == store_name:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def _pack_and_write(config, builder, output_dir: Path, total: int, progress: bool, started: float) -> RunResult:
    """Pack the complete sample store at each size and publish the prefixes."""
    store = layout.SampleStore(layout.store_dir(output_dir))
    _write_skipped(store.skipped_files(), output_dir)
    if len(store) == 0:
        raise InputError(
            f"none of the {total} record(s) of {config.data_path} could be used; reasons in {output_dir / layout.SKIPPED_FILE}"
        )
    reports = {}
    for size in config.sizes:
        reports[size] = _write_prefix(config, builder, store, total, size, output_dir, progress, started)
    strict_failure = config.strict and reports[max(reports)]["records"]["skipped"] > 0
    return RunResult(reports=reports, exit_code=1 if strict_failure else 0)


def _write_prefix(config, builder, store, total: int, size: int, output_dir: Path, progress: bool, started) -> dict:
    """Pack the store for one pack size and publish its prefix (skipped when --resume finds it complete)."""
    named_size = size if len(config.sizes) > 1 else None
    prefix = layout.packed_prefix(output_dir, named_size)
    stats_file = layout.stats_path(output_dir, named_size)
    if config.resume and layout.meta_path(prefix).is_file() and stats_file.is_file():
        return json.loads(stats_file.read_text(encoding="utf-8"))  # published before the interruption
    rows, cuts = _rows_at(store, size, builder.layout.positions)
    lengths = rows["length"].astype(np.int64)
    plan = pack(
        lengths, size, algorithm=config.packing_algorithm, seed=config.seed, max_samples_per_pack=config.max_samples_per_pack
    )
    writer = layout.PackedWriter(prefix, builder.preprocessor.shape, _plan_digest(plan), resume=config.resume)
    _write_packs(store, plan, cuts, builder.preprocessor, writer, max(1, config.checkpoint_every // 10), progress)
    report = _report(config, builder, store, rows, plan, total, prefix, time.perf_counter() - started)
    layout.write_json_atomic(stats_file, report)
    packed = rows[plan.indices]
    writer.publish(
        plan_table={
            "offsets": plan.offsets,
            "record_index": packed["record_index"],
            "length": packed["length"],
            "num_images": packed["num_images"],
        },
        extra_files=[stats_file, output_dir / layout.SKIPPED_FILE],
        meta=_meta(config, builder, report),
    )
    return report


def _rows_at(store, size: int, run_length: int) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """The store's rows as they are for a pack size, and for each sample that must be cut for it:
    (tokens kept, images kept)."""
    rows = store.rows.copy()
    cuts = {}
    for i in np.flatnonzero(rows["length"] > size):
        cut, kept = truncation(store.image_starts(int(i)), run_length, size)
        cuts[int(i)] = (cut - 1, kept)
        rows[i] = (rows["record_index"][i], cut - 1, kept, 1)
    return rows, cuts


def _prepare_output_dir(config: PreprocessConfig) -> Path:
    """Refuse a non-empty directory unless --resume or --overwrite; touch nothing when refusing."""
    output_dir = Path(config.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    entries = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() else []
    if entries and not (config.resume or config.overwrite):
        raise ConfigError(
            f"--output_dir {output_dir}: not empty ({entries[0]}{', ...' if len(entries) > 1 else ''}); "
            "pass --resume to continue an interrupted run or --overwrite to replace it"
        )
    if config.overwrite:
        for path in layout.output_paths(output_dir):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".neva_pack_write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write ({exc.strerror or exc})") from None
    return output_dir


def _encode_samples(
    config, builder, store_directory: Path, report_dir: Path, total: int, progress: bool, first: int = 0,
    end: int | None = None, extra: dict | None = None,
) -> None:
    """Stream samples of records [first, end) from the DataLoader into the store at ``store_directory``,
    committing a store shard every checkpoint."""
    from torch.utils.data import DataLoader

    end = total if end is None else end
    writer = layout.SampleStoreWriter(
        store_directory, builder.preprocessor.shape, sample_fingerprint(config), resume=config.resume,
        first_record=first, extra=extra,
    )  # fmt: skip
    start = writer.next_record
    skipped = sum(sum(s.skipped_by_reason.values()) for s in writer.shards)
    if start < end:
        loader = DataLoader(
            SampleStream(config.data_path, builder, start=start, end=end, batch_size=RECORDS_PER_MESSAGE),
            batch_size=None,
            num_workers=config.num_workers,
            collate_fn=passthrough,
            prefetch_factor=MESSAGES_IN_FLIGHT if config.num_workers else None,
        )
        bar = tqdm(total=end - first, initial=start - first, desc="tokenize + images", unit="rec", disable=not progress)
        for position, item in enumerate(itertools.chain.from_iterable(loader), start=start):
            if isinstance(item, Skipped):
                writer.skip(item)
                skipped += 1
                bar.set_postfix(skipped=skipped, refresh=False)
            else:
                writer.append(item)
            bar.update()
            done = position + 1
            if done % config.checkpoint_every == 0 and done < end:
                writer.commit(done)
            if done - first >= SKIP_CHECK_AFTER or done == end:
                _check_skip_fraction(config, writer, skipped, done - first, report_dir)
        bar.close()
    writer.finish(end)


def _check_skip_fraction(config, writer, skipped: int, done: int, output_dir: Path) -> None:
    if skipped <= config.max_skip_fraction * done:
        return
    writer.commit(writer.first_record + done)  # done counts from the first record of the run (or shard)
    _write_skipped(writer.skipped_files(), output_dir)
    raise InputError(
        f"{skipped} of the first {done} records were skipped (> --max_skip_fraction {config.max_skip_fraction}); "
        f"reasons in {output_dir / layout.SKIPPED_FILE}"
    )


def _write_skipped(parts: list[Path], output_dir: Path) -> None:
    """Concatenate the shards' skipped lines into skipped.jsonl (atomically)."""
    target = output_dir / layout.SKIPPED_FILE
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    tmp.replace(target)


def _plan_digest(plan: PackingPlan) -> str:
    digest = hashlib.sha256()
    for array in (plan.offsets, plan.indices):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.hexdigest()


def _write_packs(store, plan: PackingPlan, cuts: dict, preprocessor: ImagePreprocessor, writer, every: int, progress: bool) -> None:
    first = writer.num_packs
    bar = tqdm(total=plan.num_bins, initial=first, desc=f"write packs of {plan.capacity}", unit="pack", disable=not progress)
    for b in range(first, plan.num_bins):
        tokens, labels, images = [], [], []
        for i in plan.bin(b):
            sample_tokens, sample_labels = store.tokens_labels(int(i))
            sample_images = store.images(int(i))
            if int(i) in cuts:  # longer than this pack size: cut as the builder would have
                keep, kept_images = cuts[int(i)]
                sample_tokens, sample_labels, sample_images = sample_tokens[:keep], sample_labels[:keep], sample_images[:kept_images]
            tokens.append(sample_tokens)
            labels.append(sample_labels)
            images.append(sample_images)
        writer.add_pack(
            lengths=np.array([len(t) for t in tokens]),
            tokens=np.concatenate(tokens),
            labels=np.concatenate(labels),
            images=preprocessor.normalize(np.concatenate(images)),
        )
        if (b + 1) % every == 0 and b + 1 < plan.num_bins:
            writer.checkpoint()
        bar.update()
    bar.close()


def _better_algorithm(config: PreprocessConfig, lengths: np.ndarray, plan: PackingPlan) -> dict | None:
    """What the recommended algorithm would give (it runs in well under a second)."""
    if config.packing_algorithm == RECOMMENDED_ALGORITHM:
        return None
    alternative = pack(
        lengths, plan.capacity, RECOMMENDED_ALGORITHM, seed=config.seed, max_samples_per_pack=config.max_samples_per_pack
    )
    if alternative.num_bins > plan.num_bins * (1 - SUGGEST_WHEN_SAVING):
        return None
    return {
        "algorithm": RECOMMENDED_ALGORITHM,
        "packs": alternative.num_bins,
        "saving": 1 - alternative.num_bins / plan.num_bins,
    }


def _report(config, builder, store, rows, plan, total: int, prefix: Path, seconds: float) -> dict:
    stats = packing_stats(arrays_from_plan(plan, rows, builder.layout.positions))
    gbs = global_batch_size_advice(config.global_batch_size, stats["samples_per_pack"]["mean"])
    skipped_by_reason = store.skipped_by_reason
    return {
        "dataset": Path(config.data_path).name,
        "records": {
            "total": total,
            "packed": int(len(rows)),
            "skipped": sum(skipped_by_reason.values()),
            "truncated": int(rows["truncated"].sum()),
            "skipped_by_reason": skipped_by_reason,
        },
        "packing": stats,
        "algorithm": config.packing_algorithm,
        "seed": config.seed,
        "suggestion": _better_algorithm(config, rows["length"].astype(np.int64), plan),
        "max_seq_length": plan.capacity,
        "image_positions": builder.layout.positions,
        "data_prefix": str(prefix),
        "crop_size": list(builder.preprocessor.shape[1:]),
        "global_batch_size": config.global_batch_size,
        "packed_global_batch_size": gbs,
        "training_overrides": training_overrides(str(prefix), builder.preprocessor.shape[1:], gbs),
        "seconds": round(seconds, 3),
    }


def _meta(config: PreprocessConfig, builder: SampleBuilder, report: dict) -> dict:
    return {
        "dataset": Path(config.data_path).name,
        "template": builder.template.name,
        "tokenizer": str(config.tokenizer_path),
        "vocab_size": builder.tokenizer.vocab_size,
        "encoder": builder.preprocessor.encoder.name,
        "image_aspect_ratio": config.image_aspect_ratio,
        "image_positions": builder.layout.positions,
        "image_token_ids": {
            "patch": builder.layout.patch_id,
            "start": builder.layout.start_id,
            "end": builder.layout.end_id,
        },
        "ignore_index": config.ignore_index,
        "max_seq_length": report["max_seq_length"],
        "algorithm": config.packing_algorithm,
        "seed": config.seed,
        "max_samples_per_pack": config.max_samples_per_pack,
        "counts": {
            "records": report["records"]["total"],
            "samples": report["records"]["packed"],
            "skipped": report["records"]["skipped"],
            "truncated": report["records"]["truncated"],
            "packs": report["packing"]["packs"],
            "images": report["packing"]["images"],
        },
    }
