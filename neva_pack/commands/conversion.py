"""``neva-pack convert SRC DEST --to FORMAT``: rewrite a packed output in another format.

Packs are read through the source's reader and written by the target's writer (formats/base.py),
so a conversion gives files byte-identical to a direct run of the same inputs and settings in the
target format: keep a small output, and pay NeMo's float32 bytes only on the machine that trains.
Images stored normalised are turned back into the exact uint8 pixels (the normalisation is a
one-to-one map of the 256 values); a target that uses the image pool stores each distinct image once.
A source whose files differ from its meta's checksums is refused before anything is written:
converted, its damage would be published under new checksums that verify.

    SRC/packed_seq_dataset[_<size>].*  --reader--> packs --writer--> DEST/packed_seq_dataset[_<size>].*
    (a target that uses the image pool: DEST/packed_seq_dataset/pool_<k>.images, one part per prefix)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack.files import paths
from neva_pack.assembly import AssembledPack
from neva_pack.core import ConfigError
from neva_pack.formats import FORMATS, WriteSpec, checked_meta, get_format, open_prefix, read_meta, resolve_prefixes
from neva_pack.sample_store import PoolWriter, pool_segment
from neva_pack.commands.report import read_report
from neva_pack.commands.stats import training_overrides


def convert(source: Path, dest: Path, to: str, progress: bool = True) -> list[Path]:
    """Convert every prefix of ``source`` into ``dest`` (new or empty); returns the prefixes written."""
    source, dest = Path(source), Path(dest)
    target = get_format(to)
    prefixes = resolve_prefixes(source)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest}: exists and is not an empty directory")
    if dest.resolve() == prefixes[0].parent.resolve():
        raise ConfigError(f"{dest}: the source's own directory; convert into another one")
    for prefix in prefixes:
        meta = read_meta(paths.meta_path(prefix))
        if meta.format == to:
            raise ConfigError(f"{prefix}: already in the {to} format")
        try:  # what the source holds must fit the target (its limits, formats/base.py)
            target.check_settings(max_seq_length=meta.packing.max_seq_length, ignore_index=meta.ignore_index, vocab_size=meta.vocab_size)
        except ConfigError as exc:
            raise ConfigError(f"{prefix}: cannot be converted to {to} ({exc})") from None
        if meta.dynamic and meta.counts.images and target.holds_images and not target.holds_dynamic_images:
            holding = " or ".join(name for name, fmt in FORMATS.items() if fmt.holds_dynamic_images and name != meta.format)
            raise ConfigError(f"{prefix}: holds dynamic-resolution images (each at its own size), which {to} cannot "
                              f"hold; {'convert to ' + holding if holding else 'keep it in ' + meta.format}")  # fmt: skip
        if meta.counts.images and not target.holds_images:
            holding = " or ".join(name for name, fmt in FORMATS.items() if fmt.holds_images and name != meta.format)
            raise ConfigError(f"{prefix}: holds {meta.counts.images:,} image(s), which {to} cannot hold (text only); "
                              f"convert to {holding}")  # fmt: skip
    metas = [checked_meta(prefix) for prefix in prefixes]  # every file as verify checks it, before anything is written
    dest.mkdir(parents=True, exist_ok=True)
    known: dict[bytes, int] = {}
    parts = []
    written = []
    for k, (prefix, meta) in enumerate(zip(prefixes, metas)):
        reader = open_prefix(prefix, meta)
        out = dest / prefix.name
        pool = None
        if target.uses_image_pool:
            directory = paths.store_dir(dest)
            directory.mkdir(exist_ok=True)
            pool = PoolWriter(pool_segment(directory, f"pool_{k:05d}", 0, dynamic=meta.dynamic), known, sum(p.count for p in parts))
        extra = _copy_extras(prefix, out, to)
        plan = reader.plan_table()
        packs = _packs(reader, plan, pool, progress, f"convert {prefix.name} to {to}")
        if pool is not None:
            packs = list(packs)  # text only (the pixels went to the pool): the part is complete before publish
            parts.append(pool_segment(pool.segment.images_file.parent, f"pool_{k:05d}", pool.close(), pool.checksums(), dynamic=meta.dynamic))
        spec = WriteSpec(
            image_shape=None if meta.dynamic else tuple(meta.image_shape),
            normalisation=meta.normalisation,
            pad_id=meta.pad_id,
            ignore_index=meta.ignore_index,
            pool=tuple(parts),
            plan_digest=f"convert:{meta.checksums}",
            image_run=meta.image_run,
            image_processor=meta.image_processor,
        )
        writer = target.writer(out, spec)
        for pack, images in packs:
            if meta.dynamic:  # StoredImages travel beside the pack (an assembled pack's pixels are one array)
                writer.add_prepared(target.prepare([pack], spec), [images])
            else:
                writer.add(pack)
        writer.publish(plan, extra, meta)
        reader.close()
        written.append(out)
    return written


def _packs(reader, plan, pool, progress: bool, description: str):
    """The source's packs as assembled packs (padding stripped, images as uint8 and pool indices),
    each with its images: uint8 (N, 3, H, W), or the StoredImages of dynamic-resolution images."""
    meta = reader.meta
    for p in tqdm(range(len(reader)), desc=description, unit="pack", disable=not progress):
        pack = reader.pack(p)
        first, last = plan.offsets[p], plan.offsets[p + 1]
        lengths = plan.length[first:last]
        starts = pack.cu_seqlens[:-1]
        real = np.concatenate([np.arange(start, start + length) for start, length in zip(starts, lengths)])
        if meta.dynamic:
            pixels = pack.stored_images
        else:
            pixels = pack.pixels if pack.pixels is not None else reader.meta.normalisation.invert(pack.images[: pack.num_images])
        tokens = pack.tokens[real]
        if meta.dynamic:
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            image_starts = find_dynamic_image_starts(tokens, meta.image_run, pack.image_lengths, bounds, plan.num_images[first:last])
        else:
            image_starts = find_image_starts(tokens, meta.image_run.ids(), len(pixels))
        if pool is not None:
            indices = np.array([pool.add(image)[1] for image in pixels], dtype=np.int64)
        else:
            indices = np.full(len(pixels), -1, dtype=np.int64)
        yield AssembledPack(
            lengths=lengths.astype(np.int64),
            padded_lengths=plan.padded_length[first:last].astype(np.int64),
            tokens=tokens.astype(np.int32),
            labels=pack.labels[real].astype(np.int32),
            record_indices=plan.record_index[first:last],
            num_images=plan.num_images[first:last],
            image_indices=indices,
            image_starts=image_starts,
            pixels=pixels if pool is None and not meta.dynamic else None,
            image_lengths=pack.image_lengths if meta.dynamic else None,
        ), pixels


def find_image_starts(tokens: np.ndarray, run: np.ndarray, count: int) -> np.ndarray:
    """Where each of the ``count`` image runs starts in ``tokens`` (left to right, runs never overlap).

    A run is recognised by its first len(run) - 1 ids: a sample cut right before an image that
    follows another one ends with that run's last id in its labels, not its tokens.
    """
    starts, position = [], 0
    head = run[:-1] if len(run) > 1 else run
    candidates = np.flatnonzero(tokens == run[0])
    for start in candidates.tolist():
        if start >= position and np.array_equal(tokens[start : start + len(head)], head):
            starts.append(start)
            position = start + len(run)
    if len(starts) < count:
        from neva_pack.core import InputError

        raise InputError(f"a pack holds {count} images but only {len(starts)} image runs")
    return np.asarray(starts[:count], dtype=np.int64)


def find_dynamic_image_starts(tokens: np.ndarray, image_run, run_lengths, bounds, sample_images) -> np.ndarray:
    """Where each dynamic-resolution image's run starts in ``tokens``: image k's run is
    ``image_run.ids`` of its own length ``run_lengths[k]``, the runs of each sample (``bounds``: the
    samples' token offsets; ``sample_images``: their image counts) in order within it. Searching
    sample by sample keeps a run that ends a cut sample (its last id in the labels) from running into
    the next sample's first one, and runs of patch ids only (LLaVA-NeXT) from merging."""
    from neva_pack.core import InputError

    starts, image = [], 0
    for low, high, count in zip(bounds[:-1].tolist(), bounds[1:].tolist(), np.asarray(sample_images).tolist()):
        position = low
        for length in np.asarray(run_lengths[image : image + count]).tolist():
            ids = image_run.ids(length - image_run.delimiters)
            head = ids[:-1] if len(ids) > 1 else ids
            for start in np.flatnonzero(tokens[position:high] == head[0]).tolist():
                start += position
                if np.array_equal(tokens[start : start + len(head)], head):
                    break
            else:
                raise InputError(f"a sample holds {count} images but not their image runs of lengths {run_lengths[image : image + count]}")
            starts.append(start)
            position = start + length
        image += count
    if image != len(run_lengths):
        raise InputError(f"a pack holds {len(run_lengths)} images, its samples {image}")
    return np.asarray(starts, dtype=np.int64)


def _copy_extras(prefix: Path, out: Path, to: str) -> list[Path]:
    """The prefix's skipped list as is; the stats file with the new prefix and format in it."""
    dest_dir = out.parent
    extras = []
    skipped = paths.skipped_path_of(prefix)
    if skipped.is_file():
        target = paths.skipped_path(dest_dir, paths.pack_size_of(out))
        shutil.copyfile(skipped, target)
        extras.append(target)
    stats = paths.stats_path_of(prefix)
    if stats.is_file():
        report = read_report(stats)
        overrides = training_overrides(str(out), report.crop_size, report.packed_global_batch_size, to)
        converted = report.replace(data_prefix=str(out), output_format=to, training_overrides=overrides)
        target = dest_dir / stats.name
        paths.write_json_atomic(target, converted.to_json())
        extras.append(target)
    return extras
