"""A sharded run's part joined into the store as one segment, decoding nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from neva_pack.files import IndexedWriter, bin_path, file_checksum, fsync_close, idx_path
from neva_pack.sample_store.checks import StoreDamage, pool_codec, read_progress
from neva_pack.sample_store.files import (
    STORE_IMAGE_DTYPE,
    STORE_TEXT_DTYPE,
    SegmentInfo,
    segment_image_refs_path,
    segment_name,
    segment_rows_path,
    segment_skipped_path,
    segment_text_prefix,
)
from neva_pack.sample_store.image_pool import KEY_BYTES, PoolSegment, PoolWriter, pool_segment, read_shapes, stored_offsets
from neva_pack.sample_store.writer import SampleStoreWriter

__all__ = ["join_part"]

_CONCATENATED = (segment_rows_path, segment_image_refs_path, segment_skipped_path)
"""Files of a segment that join by concatenation."""
_IMAGES_PER_READ = 32


def join_part(writer: SampleStoreWriter, part: Path, first_record: int, end_record: int) -> None:
    """Append a complete store ``part`` (one shard's record range of a sharded run) to ``writer`` as
    one segment, decoding nothing:

    - text: the part's segments joined by ``add_index`` (bytes copied, index extended: files/indexed.py);
    - rows, image refs, skipped lines: concatenated in record order;
    - images: those of the part's pool that no earlier part holds, in the part's order. A part
      dedups only within itself; dropping what an earlier part already stored leaves each image
      once, in order of first use -- the pool (and so every pool index) of a run without shards.
    """
    progress = read_progress(part)
    if (progress.get("image_run") != writer.run.to_json() or progress.get("ignore_index") != writer.ignore_index
            or progress.get("image_processor") != writer.image_processor
            or progress.get("frame_compression") != writer.frame_compression):  # fmt: skip
        raise ValueError(f"{part}: written with another image run, image processor, ignore value or frame compression "
                         "than the store it joins")  # fmt: skip
    sources = [SegmentInfo(**segment) for segment in progress["shards"]]
    if not writer.between_segments or writer.next_record != first_record:
        raise ValueError(f"{part}: starts at record {first_record}, the store is at {writer.next_record}")
    directory, name = writer.directory, segment_name(len(writer.segments))
    text = None
    if any(source.samples for source in sources):
        text = IndexedWriter(bin_path(segment_text_prefix(directory, name)), STORE_TEXT_DTYPE)
    pool = writer.new_pool_segment(name)
    targets = [open(path(directory, name), "wb") for path in _CONCATENATED]
    for source in sources:
        if source.samples:
            text.add_index(segment_text_prefix(part, source.name))
        for path, target in zip(_CONCATENATED, targets):
            with open(path(part, source.name), "rb") as f:
                shutil.copyfileobj(f, target)
        images = pool_segment(part, source.name, source.pool_images, source.pool_checksums, dynamic=writer.run.dynamic,
                              codec=pool_codec(progress))  # fmt: skip
        read = _copy_new_images(images, pool, writer.image_shape)
        if images.dynamic and images.count and images.checksums is not None and file_checksum(images.shapes_file) != images.checksums[2]:
            raise StoreDamage(f"{images.shapes_file.name} does not hash to the checksum its progress file records")
        if images.checksums is not None and read is not None and read != images.checksums[0]:
            raise StoreDamage(f"{images.images_file.name} does not hash to the checksum its progress file records")
    for target in targets:
        fsync_close(target)
    if text is not None:
        text.finalize(idx_path(segment_text_prefix(directory, name)))
    writer.add_segment(
        SegmentInfo(
            name=name,
            first_record=first_record,
            end_record=end_record,
            samples=sum(source.samples for source in sources),
            images=sum(source.images for source in sources),
            pool_images=pool.close(),
            truncated=sum(source.truncated for source in sources),
            skipped_by_reason=_sum_counts(source.skipped_by_reason for source in sources),
            pool_checksums=pool.checksums(),
        )
    )


def _copy_new_images(source: PoolSegment, pool: PoolWriter, image_shape) -> str | None:
    """Add the images of ``source`` that ``pool`` lacks; returns the xxh3-128 of the source's images
    file as read (every image is read: the check that the part arrived whole costs no extra read)."""
    if source.count == 0:
        return None
    import xxhash

    keys = source.keys_file.read_bytes()
    digest = xxhash.xxh3_128()
    if source.dynamic:
        return _copy_new_stored_images(source, keys, pool, digest)
    size = int(np.prod(image_shape))
    with open(source.images_file, "rb") as f:
        for first in range(0, source.count, _IMAGES_PER_READ):
            count = min(_IMAGES_PER_READ, source.count - first)
            data = f.read(count * size)
            if len(data) != count * size:
                raise StoreDamage(f"{source.images_file.name} ends before its image {first + len(data) // size}")
            digest.update(data)
            images = np.frombuffer(data, dtype=STORE_IMAGE_DTYPE).reshape(count, *image_shape)
            for k in range(count):
                pool.add_keyed(keys[(first + k) * KEY_BYTES : (first + k + 1) * KEY_BYTES], images[k])
    return digest.hexdigest()


def _copy_new_stored_images(source: PoolSegment, keys: bytes, pool: PoolWriter, digest) -> str:
    """``_copy_new_images`` for a dynamic pool segment: each image's entry read at its own size (its shapes
    row; a compressed pool's sizes file) and copied as stored, a compressed frame not decoded."""
    try:
        rows = read_shapes(source)
        offsets = stored_offsets(source, rows)
    except (OSError, ValueError) as exc:
        raise StoreDamage(f"{(source.sizes_file or source.shapes_file).name}: {exc}") from None
    if source.codec is not None and source.checksums is not None and file_checksum(source.sizes_file) != source.checksums[3]:
        raise StoreDamage(f"{source.sizes_file.name} does not hash to the checksum its progress file records")
    with open(source.images_file, "rb") as f:
        for k, (row, size) in enumerate(zip(rows, np.diff(offsets).tolist())):
            data = f.read(size)
            if len(data) != size:
                raise StoreDamage(f"{source.images_file.name} ends before its image {k}")
            digest.update(data)
            pool.add_entry(keys[k * KEY_BYTES : (k + 1) * KEY_BYTES], row, data)
    return digest.hexdigest()


def _sum_counts(counts) -> dict:
    total: dict[str, int] = {}
    for count in counts:
        for reason, value in count.items():
            total[reason] = total.get(reason, 0) + value
    return total
