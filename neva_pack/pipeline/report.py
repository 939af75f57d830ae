"""The report and meta of a pack size: the run report (stats_<size>.json, the summary printed) and
the meta a reader needs (the writer adds the files, their checksums and the format's own fields)."""

from __future__ import annotations

from pathlib import Path

from neva_pack.config import PackConfig, SampleConfig
from neva_pack.formats import Counts, ImageTokenIds, META_VERSION, PackedMeta, PackingSettings, WriteSpec
from neva_pack.packing import budget_options
from neva_pack.pipeline.pack import better_algorithm
from neva_pack.commands import (
    ClipStats, RecordCounts, RunReport, arrays_from_plan, global_batch_size_advice, packing_stats, training_overrides
)
from neva_pack.samples import SampleBuilder

__all__ = ["packed_meta", "run_report"]


def run_report(
    settings: PackConfig, builder, store, rows, plan, padded, kept, size_skips: dict[str, int], balance, total: int,
    prefix: Path, seconds: float, *, data_path: Path,
) -> RunReport:  # fmt: skip
    """What a pack size's stats file holds: counts, skips by reason (the store's, and this size's own
    ``size_skips``: reason -> samples), packing figures, the algorithm hint, training overrides.
    ``settings``: how the packs were made; ``data_path``: the input, named by the report."""
    stats = packing_stats(arrays_from_plan(plan, rows, builder.image_run.positions, padded, settings.alignment,
                                           settings.max_images_per_pack, settings.max_image_tokens_per_pack,
                                           settings.max_video_tokens_per_pack))  # fmt: skip
    gbs = global_batch_size_advice(settings.global_batch_size, stats.samples_per_pack.mean)
    shape = builder.preprocessor.stored_shape  # None: no one crop size, and no NeMo 1 training overrides
    skipped_by_reason = dict(store.skipped_by_reason)
    for reason, count in size_skips.items():  # cut at this size before all of their answers, or over a visual budget
        if count:
            skipped_by_reason[reason] = skipped_by_reason.get(reason, 0) + count
    return RunReport(
        dataset=Path(data_path).name,
        records=RecordCounts(
            total=total,
            packed=plan.num_samples,
            skipped=sum(skipped_by_reason.values()),
            truncated=int(rows["truncated"][plan.indices].sum()),
            skipped_by_reason=skipped_by_reason,
        ),
        packing=stats,
        algorithm=settings.packing_algorithm,
        seed=settings.seed,
        suggestion=better_algorithm(
            padded[kept], plan, algorithm=settings.packing_algorithm, seed=settings.seed,
            max_samples_per_pack=settings.max_samples_per_pack,
            **budget_options(rows[kept], settings.max_images_per_pack, settings.max_image_tokens_per_pack, settings.max_video_tokens_per_pack),
        ),
        balance=balance,
        max_seq_length=plan.capacity,
        image_positions=builder.image_run.positions,
        output_format=settings.output_format,
        data_prefix=str(prefix),
        crop_size=[] if shape is None else list(shape[1:]),
        global_batch_size=settings.global_batch_size,
        packed_global_batch_size=gbs,
        training_overrides=[] if shape is None else training_overrides(str(prefix), shape[1:], gbs, settings.output_format),
        seconds=round(seconds, 3),
        clips=_clip_stats(store),
    )


def _clip_stats(store) -> ClipStats | None:
    """The video clips the store holds (None: none)."""
    clips, frames, size, stored = store.clip_totals()
    if not clips:
        return None
    return ClipStats(clips=clips, frames=frames, bytes=size, stored_bytes=stored, compression=store.frame_compression)


def packed_meta(sample: SampleConfig, written: dict, builder: SampleBuilder, spec: WriteSpec, report: RunReport) -> PackedMeta:
    """Everything a reader needs; the writer fills in format, pack count, its files' description and checksums.
    ``written``: the writing settings by the meta key recording each (``PreprocessConfig.meta_settings``):
    the packing settings, and the format, pad id and ignore index."""
    packing = PackingSettings.from_json(written)
    return PackedMeta(
        version=META_VERSION,
        num_packs=report.packing.packs,
        image_shape=spec.image_shape,
        normalisation=spec.normalisation,
        dataset=Path(sample.data_path).name,
        template=builder.template.name,
        tokenization=builder.tokenization.name,
        tokenizer=str(sample.tokenizer_path),
        vocab_size=builder.tokenizer.vocab_size,
        encoder=spec.image_processor["encoder"] if spec.image_processor else builder.preprocessor.encoder.name,
        image_aspect_ratio=sample.image_aspect_ratio,
        image_positions=builder.image_run.positions,
        image_token_ids=ImageTokenIds(patch=builder.image_run.patch_id, start=builder.image_run.start_id, end=builder.image_run.end_id),
        packing=packing,
        **{key: value for key, value in written.items() if key not in PackingSettings.keys()},  # format, pad id, ignore index
        counts=Counts(
            records=report.records.total,
            samples=report.records.packed,
            skipped=report.records.skipped,
            truncated=report.records.truncated,
            packs=report.packing.packs,
            images=report.packing.images,
        ),
    )
