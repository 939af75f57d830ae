"""What a store's progress file says, and whether the store's files and this run agree with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from neva_pack.core import ConfigError, InputError
from neva_pack.files import bin_path, file_checksum, idx_path, read_index, read_json
from neva_pack.sample_store.files import (
    PROGRESS_FILE,
    SAMPLE_ROW,
    STORE_FORMAT,
    STORE_FORMAT_VERSION,
    POOL_IMAGE_ROW,
    STORE_TEXT_DTYPE,
    TEXT_ITEMS,
    SegmentInfo,
    segment_files,
    segment_image_refs_path,
    segment_rows_path,
    segment_skipped_path,
    segment_text_prefix,
)
from neva_pack.sample_store.frame_codec import FRAME_CODECS
from neva_pack.sample_store.image_pool import KEY_BYTES, pool_segment, read_shapes, stored_offsets

__all__ = [
    "MAX_PROGRESS_BYTES",
    "StoreDamage",
    "check_input",
    "check_settings",
    "is_dynamic",
    "pool_codec",
    "read_progress",
    "segment_checksums",
    "store_checksums_problem",
    "store_files_problem",
]

MAX_PROGRESS_BYTES = 256 << 20
"""Budget of a progress file: a segment's entry is a few hundred bytes, a store has thousands."""


class StoreDamage(ValueError):
    """A store's files disagree with what its progress file records (``store_files_problem``, ``join_part``)."""


def read_progress(directory: Path) -> dict:
    """The store's progress file, once it is a sample store's of this version (InputError otherwise)."""
    path = Path(directory) / PROGRESS_FILE
    if not path.exists() and not path.is_symlink():
        raise InputError(f"{path}: missing (the output is incomplete or not a neva_pack output)")
    progress = read_json(path, what="", max_bytes=MAX_PROGRESS_BYTES, error=InputError)
    if not isinstance(progress, dict):
        raise InputError(f"{path}: not a JSON object")
    if progress.get("format") != STORE_FORMAT:
        raise InputError(f"{path}: format {progress.get('format')!r}, expected {STORE_FORMAT!r}")
    if not isinstance(progress.get("version"), int) or progress["version"] > STORE_FORMAT_VERSION:
        raise InputError(f"{path}: version {progress.get('version')!r} is newer than this neva_pack reads ({STORE_FORMAT_VERSION})")
    if progress["version"] != STORE_FORMAT_VERSION:
        raise InputError(f"{directory}: a sample store of version {progress['version']}; this neva_pack needs "
                         f"{STORE_FORMAT_VERSION} (run again with --overwrite)")  # fmt: skip
    return progress


def is_dynamic(progress: dict) -> bool:
    """Whether a store's progress file describes a dynamic-resolution store (files.py's docstring)."""
    return progress.get("image_shape") is None


def pool_codec(progress: dict) -> str | None:
    """The codec a store's pool entries are compressed with (--frame_compression), None when raw;
    InputError for one this neva_pack does not know, or on a fixed store."""
    codec = progress.get("frame_compression")
    if codec is not None and (codec not in FRAME_CODECS or not is_dynamic(progress)):
        raise InputError(f"{PROGRESS_FILE}: frame_compression {codec!r} (this neva_pack knows {FRAME_CODECS}, on dynamic-resolution stores)")
    return codec


def check_settings(stored: dict, current: dict) -> None:
    """--resume: ConfigError naming the first setting (by key) whose stored value differs from this run's."""
    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            raise ConfigError(
                f"--resume: the output was started with {key}={stored.get(key)!r}, this run has "
                f"{current.get(key)!r}; run with the same settings, or --overwrite to start again"
            )


def check_input(directory: Path, stored: str | None, current: str | None, data_path) -> None:
    """--resume: the input must be, byte for byte, the one the store at ``directory`` was started from
    (its content digest, ``input_digest``), whatever its size and mtime say; InputError otherwise.
    A store written before the digest was recorded (None) resumes on its fingerprint's size and mtime,
    as it did: refusing it would throw away every store made until now."""
    if stored is None or stored == current:
        return
    raise InputError(
        f"--resume: the sample store in {directory} was built from other content than --data_path {data_path} "
        "holds now (the input was edited, even if its size and mtime are the same); run with --overwrite to start again"
    )


def segment_checksums(directory: Path, name: str) -> dict[str, str]:
    """xxh3-128 of each file of a committed segment besides its pool's, by file name (``SegmentInfo.checksums``)."""
    return {path.name: file_checksum(path) for path in segment_files(directory, name)}


def store_checksums_problem(directory: Path, progress: dict) -> str | None:
    """What first differs between a store's committed files and the checksums its progress file
    records (every byte read: a resume checks them before adding to them), None when all agree.
    A segment recorded without them (a store written before they were) is checked by its sizes and
    its pool's checksums only."""
    directory = Path(directory)
    problem = store_files_problem(directory, progress)
    if problem is not None:
        return problem
    for segment in (SegmentInfo(**info) for info in progress["shards"]):
        pool = pool_segment(directory, segment.name, segment.pool_images, segment.pool_checksums, dynamic=is_dynamic(progress),
                            codec=pool_codec(progress))  # fmt: skip
        if pool.count and pool.checksums is not None and file_checksum(pool.images_file) != pool.checksums[0]:
            return f"{pool.images_file.name} does not hash to the checksum its progress file records"
        if segment.checksums is None:
            continue
        found = {path.name for path in segment_files(directory, segment.name)}
        if found != set(segment.checksums):
            return f"{segment.name}: files {sorted(found ^ set(segment.checksums))} differ from those recorded"
        for file_name, expected in segment.checksums.items():
            if file_checksum(directory / file_name) != expected:
                return f"{file_name} does not hash to the checksum its progress file records"
    return None


def store_files_problem(directory: Path, progress: dict) -> str | None:
    """What is wrong with the files of a store's committed segments, checked against what its progress
    file records: each file's size (rows, image refs, the pool's images and keys; the text index's
    documents and the size of the text it points into), the skipped lines' count, and the checksum of
    each pool segment's keys (its images are hashed as ``join_part`` copies them). None when all agree.
    Cheap: reads the indexes and keys, never the text or the pixels."""
    directory = Path(directory)
    dynamic = is_dynamic(progress)
    for segment in (SegmentInfo(**info) for info in progress["shards"]):
        pool = pool_segment(directory, segment.name, segment.pool_images, segment.pool_checksums, dynamic=dynamic,
                            codec=pool_codec(progress))  # fmt: skip
        sizes = [(segment_rows_path(directory, segment.name), segment.samples * SAMPLE_ROW.itemsize),
                 (segment_image_refs_path(directory, segment.name), segment.images * KEY_BYTES)]  # fmt: skip
        if pool.count and dynamic:
            shapes = pool.shapes_file
            if not shapes.is_file() or shapes.stat().st_size != pool.count * POOL_IMAGE_ROW.itemsize:
                return f"{shapes.name} is not {pool.count} image rows"
            if pool.checksums is not None and file_checksum(shapes) != pool.checksums[2]:
                return f"{shapes.name} does not hash to the checksum its progress file records"
            if pool.codec is not None and pool.checksums is not None and (
                    not pool.sizes_file.is_file() or file_checksum(pool.sizes_file) != pool.checksums[3]):  # fmt: skip
                return f"{pool.sizes_file.name} is missing or does not hash to the checksum its progress file records"
            try:
                expected = int(stored_offsets(pool, read_shapes(pool))[-1])
            except (OSError, ValueError) as exc:
                return str(exc)
            sizes += [(pool.images_file, expected), (pool.keys_file, pool.count * KEY_BYTES)]
        elif pool.count:
            sizes += [(pool.images_file, pool.count * int(np.prod(progress["image_shape"]))), (pool.keys_file, pool.count * KEY_BYTES)]
        text = segment_text_prefix(directory, segment.name)
        if segment.samples:
            try:
                index = read_index(idx_path(text))
            except (OSError, InputError) as exc:
                return f"{idx_path(text).name}: {exc.strerror if isinstance(exc, OSError) else exc}"
            if len(index.sequence_lengths) != TEXT_ITEMS * segment.samples or len(index.document_indices) != segment.samples + 1:
                return f"{idx_path(text).name} indexes {len(index.document_indices) - 1} samples, {segment.samples} expected"
            end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * np.dtype(STORE_TEXT_DTYPE).itemsize
            sizes.append((bin_path(text), end))
        for path, expected in sizes:
            if not path.is_file():
                return f"{path.name} is missing"
            if path.stat().st_size != expected:
                return f"{path.name} is {path.stat().st_size:,} bytes, {expected:,} expected"
        skipped = segment_skipped_path(directory, segment.name)
        if not skipped.is_file():
            return f"{skipped.name} is missing"
        with open(skipped, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        if lines != sum(segment.skipped_by_reason.values()):
            return f"{skipped.name} lists {lines} records, {sum(segment.skipped_by_reason.values())} expected"
        if pool.count and pool.checksums is not None and file_checksum(pool.keys_file) != pool.checksums[1]:
            return f"{pool.keys_file.name} does not hash to the checksum its progress file records"
    return None
