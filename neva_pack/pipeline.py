"""preprocess(config): the stages wired together, each with a progress bar.

    records --DataLoader workers--> Sample | Skipped --> sample store + skipped.jsonl
    store lengths --pack()--> PackingPlan --writer--> packed_seq_dataset.{bin,idx} + meta + stats.json
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack import store as layout
from neva_pack.config import PreprocessConfig
from neva_pack.encoders import resolve_encoder
from neva_pack.errors import ConfigError, InputError
from neva_pack.images import ImagePreprocessor, ImageSource
from neva_pack.packing import RECOMMENDED_ALGORITHM, PackingPlan, pack
from neva_pack.records import count_records
from neva_pack.samples import SampleBuilder, SampleStream, Skipped, image_token_layout, passthrough
from neva_pack.stats import global_batch_size_advice, packing_stats, training_overrides
from neva_pack.templates import load_template
from neva_pack.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    report: dict
    """Everything stats.json holds: counts, skips by reason, packing figures, overrides."""
    exit_code: int
    """0, or 1 when --strict and a record was skipped."""


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


def preprocess(config: PreprocessConfig, progress: bool = True) -> RunResult:
    started = time.perf_counter()
    builder = build_sample_builder(config)
    output_dir = _prepare_output_dir(config)
    total = count_records(config.data_path)

    counts = _encode_samples(config, builder, output_dir, total, progress)
    store = layout.SampleStore(layout.store_dir(output_dir))
    if len(store) == 0:
        raise InputError(
            f"none of the {total} record(s) of {config.data_path} could be used; reasons in {output_dir / layout.SKIPPED_FILE}"
        )
    plan = pack(
        store.lengths,
        config.max_seq_length,
        algorithm=config.packing_algorithm,
        seed=config.seed,
        max_samples_per_pack=config.max_samples_per_pack,
    )
    prefix = layout.packed_prefix(output_dir)
    writer = layout.PackedWriter(prefix, builder.preprocessor.shape)
    _write_packs(store, plan, builder.preprocessor, writer, progress)

    report = _report(config, builder, store, plan, counts, prefix, time.perf_counter() - started)
    layout.write_json_atomic(output_dir / layout.STATS_FILE, report)
    writer.publish(_meta(config, builder, report))
    strict_failure = config.strict and report["records"]["skipped"] > 0
    return RunResult(report=report, exit_code=1 if strict_failure else 0)


def _prepare_output_dir(config: PreprocessConfig) -> Path:
    output_dir = Path(config.output_dir)
    ours = _our_paths(output_dir)
    existing = [p for p in ours if p.exists()]
    if existing and not config.overwrite:
        raise ConfigError(
            f"--output_dir {output_dir}: already holds a neva_pack output ({existing[0].name}); pass --overwrite to replace it"
        )
    for path in existing:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot create ({exc.strerror or exc})") from None
    return output_dir


def _our_paths(output_dir: Path) -> list[Path]:
    prefix = layout.packed_prefix(output_dir)
    names = [
        layout.meta_path(prefix),
        Path(str(prefix) + ".bin"),
        Path(str(prefix) + ".idx"),
        Path(str(prefix) + ".tmp.bin"),
        Path(str(prefix) + ".tmp.idx"),
        layout.store_dir(output_dir),
        output_dir / layout.STATS_FILE,
        output_dir / layout.SKIPPED_FILE,
    ]
    return names


def _encode_samples(config, builder, output_dir: Path, total: int, progress: bool) -> dict:
    """Stream samples from the DataLoader into the store; skipped records into skipped.jsonl."""
    from torch.utils.data import DataLoader

    writer = layout.SampleStoreWriter(layout.store_dir(output_dir), builder.preprocessor.shape)
    loader = DataLoader(
        SampleStream(config.data_path, builder),
        batch_size=None,
        num_workers=config.num_workers,
        collate_fn=passthrough,
        prefetch_factor=8 if config.num_workers else None,
    )
    skipped_by_reason: Counter = Counter()
    truncated = 0
    skipped_path = output_dir / layout.SKIPPED_FILE
    tmp_skipped = skipped_path.with_name(skipped_path.name + ".tmp")
    with open(tmp_skipped, "w", encoding="utf-8") as skipped_file:
        bar = tqdm(loader, total=total, desc="tokenize + images", unit="rec", disable=not progress)
        for item in bar:
            if isinstance(item, Skipped):
                skipped_by_reason[item.reason] += 1
                line = {"index": item.index, "id": item.record_id, "reason": item.reason, "detail": item.detail}
                skipped_file.write(json.dumps(line, ensure_ascii=False) + "\n")
                bar.set_postfix(skipped=sum(skipped_by_reason.values()), refresh=False)
                continue
            truncated += item.truncated
            writer.append(item)
    writer.close({"data_path": str(config.data_path), "records": total})
    tmp_skipped.replace(skipped_path)
    return {"total": total, "skipped_by_reason": dict(skipped_by_reason), "truncated": truncated}


def _write_packs(store, plan: PackingPlan, preprocessor: ImagePreprocessor, writer, progress: bool) -> None:
    for b in tqdm(range(plan.num_bins), desc="write packs", unit="pack", disable=not progress):
        members = plan.bin(b)
        tokens, labels, images = [], [], []
        for i in members:
            sample_tokens, sample_labels = store.tokens_labels(int(i))
            tokens.append(sample_tokens)
            labels.append(sample_labels)
            images.append(store.images(int(i)))
        pixels = np.concatenate(images) if images else np.zeros((0, *preprocessor.shape), np.uint8)
        writer.add_pack(
            lengths=np.array([len(t) for t in tokens]),
            tokens=np.concatenate(tokens),
            labels=np.concatenate(labels),
            images=preprocessor.normalize(pixels),
        )


SUGGEST_WHEN_SAVING = 0.01
"""Suggest the recommended algorithm when it would need at least this fraction fewer packs."""


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


def _report(config, builder, store, plan, counts, prefix: Path, seconds: float) -> dict:
    rows = store.rows
    stats = packing_stats(plan, rows["length"].astype(np.int64), rows["num_images"], builder.layout.positions)
    gbs = global_batch_size_advice(config.global_batch_size, stats["samples_per_pack"]["mean"])
    skipped = sum(counts["skipped_by_reason"].values())
    return {
        "records": {
            "total": counts["total"],
            "packed": int(len(rows)),
            "skipped": skipped,
            "truncated": counts["truncated"],
            "skipped_by_reason": counts["skipped_by_reason"],
        },
        "packing": stats,
        "algorithm": config.packing_algorithm,
        "seed": config.seed,
        "suggestion": _better_algorithm(config, store.lengths, plan),
        "max_seq_length": config.max_seq_length,
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
        "max_seq_length": config.max_seq_length,
        "algorithm": config.packing_algorithm,
        "seed": config.seed,
        "counts": {
            "records": report["records"]["total"],
            "samples": report["records"]["packed"],
            "skipped": report["records"]["skipped"],
            "truncated": report["records"]["truncated"],
            "packs": report["packing"]["packs"],
            "images": report["packing"]["images"],
        },
    }
