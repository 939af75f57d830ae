"""A compressed image pool (--frame_compression zstd): each clip or image one zstd frame, read back
bit-identical to the raw pool, the same bytes however often it is written, and a damaged or hostile
frame refused in one line before anything past its row's size is decompressed."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from neva_pack.core import InputError, StoredImage
from neva_pack.sample_store import (
    FRAME_CODECS,
    ImagePool,
    PoolWriter,
    image_key,
    pool_segment,
)

FRAMES = 6


def clip(seed: int, height: int = 24, width: int = 40) -> StoredImage:
    """A clip of smooth frames drifting (what video frames are like: they compress), plus a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : FRAMES * height, 0:width]
    frames = np.stack([(x + 2 * y + seed) % 256, (3 * x + y) % 256, (x * y // 7) % 256]).astype(np.uint8)
    frames[:, ::5, ::3] = rng.integers(0, 256, frames[:, ::5, ::3].shape, dtype=np.uint8)
    return StoredImage(size=(width + 3, height + 1), parts=(frames,), tokens=FRAMES * height * width // 784 + 1, frames=FRAMES, grid_seconds=0.5)


def still(seed: int) -> StoredImage:
    rng = np.random.default_rng(seed)
    return StoredImage(size=(30, 20), parts=(rng.integers(0, 256, (3, 28, 56), dtype=np.uint8),), tokens=2)


IMAGES = [clip(1), still(2), clip(3), clip(1), still(4)]
"""A repeated clip (stored once), stills beside the clips: one pool for both."""


def write_pool(directory, codec):
    segment = pool_segment(directory, "shard_00000", 0, dynamic=True, codec=codec)
    writer = PoolWriter(segment, {}, 0)
    indices = [writer.add(image)[1] for image in IMAGES]
    count, checksums = writer.close(), writer.checksums()
    return pool_segment(directory, "shard_00000", count, checksums, dynamic=True, codec=codec), indices


def same(a: StoredImage, b: StoredImage) -> bool:
    return (a.size, a.tokens, a.frames, a.grid_seconds) == (b.size, b.tokens, b.frames, b.grid_seconds) and all(
        x.dtype == y.dtype == np.uint8 and np.array_equal(x, y) for x, y in zip(a.parts, b.parts, strict=True)
    )


@pytest.mark.parametrize("mmap", [True, False])
def test_a_compressed_pool_reads_back_exactly_what_a_raw_pool_holds(tmp_path, mmap):
    (tmp_path / "raw").mkdir(), (tmp_path / "zstd").mkdir()
    raw, raw_indices = write_pool(tmp_path / "raw", None)
    packed, indices = write_pool(tmp_path / "zstd", "zstd")
    assert FRAME_CODECS == ("zstd",) and indices == raw_indices == [0, 1, 2, 0, 3]
    assert packed.keys_file.read_bytes() == raw.keys_file.read_bytes()  # the same content keys: dedup as before
    assert packed.shapes_file.read_bytes() == raw.shapes_file.read_bytes()
    assert packed.images_file.stat().st_size < raw.images_file.stat().st_size  # smooth frames compress
    sizes = np.fromfile(packed.sizes_file, dtype="<i8")
    assert len(sizes) == 4 and sizes.sum() == packed.images_file.stat().st_size
    for pool in (ImagePool([raw], None, mmap=mmap), ImagePool([packed], None, mmap=mmap)):
        read = pool.read_stored(indices)
        assert all(same(a, b) for a, b in zip(read, IMAGES, strict=True))
    assert ImagePool([packed], None).entries_problem(0) is None


def test_the_same_images_give_the_same_compressed_bytes(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, _ = write_pool(tmp_path / "a", "zstd")
    b, _ = write_pool(tmp_path / "b", "zstd")
    assert a.checksums == b.checksums and a.images_file.read_bytes() == b.images_file.read_bytes()


def damage(segment, at: int, payload: bytes) -> None:
    """Entry ``at`` of the segment replaced by ``payload`` (the sizes file rewritten to match)."""
    sizes = np.fromfile(segment.sizes_file, dtype="<i8")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    data = segment.images_file.read_bytes()
    segment.images_file.write_bytes(data[: offsets[at]] + payload + data[offsets[at + 1] :])
    sizes[at] = len(payload)
    sizes.astype("<i8").tofile(segment.sizes_file)


def refusal(segment, index: int) -> str:
    with pytest.raises(InputError) as caught:
        ImagePool([segment], None).read_stored([index])
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and f"image {index}" in message
    assert ImagePool([segment], None).entries_problem(0) == message
    return message


def entry(segment, at: int) -> bytes:
    sizes = np.fromfile(segment.sizes_file, dtype="<i8")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return segment.images_file.read_bytes()[offsets[at] : offsets[at + 1]]


def test_a_damaged_frame_is_refused_in_one_line(tmp_path):
    segment, _ = write_pool(tmp_path, "zstd")
    payload = bytearray(entry(segment, 0))
    payload[len(payload) // 2] ^= 0x55
    assert "damaged" in refusal_after(segment, 0, bytes(payload))
    assert "cut short" in refusal_after(segment, 0, entry(segment, 0)[:-9])
    original = IMAGES[1].parts[0].tobytes()
    assert "followed by other bytes" in refusal_after(segment, 1, _zstd(original) + b"junk")
    assert "not a zstd frame" in refusal_after(segment, 1, b"\x00" * 32)


def refusal_after(segment, at: int, payload: bytes) -> str:
    keep = segment.images_file.read_bytes(), segment.sizes_file.read_bytes()
    damage(segment, at, payload)
    try:
        return refusal(segment, at)
    finally:
        segment.images_file.write_bytes(keep[0])
        segment.sizes_file.write_bytes(keep[1])


def _zstd(data: bytes, **options) -> bytes:
    return zstandard.ZstdCompressor(level=3, **options).compress(data)


def test_a_frame_declaring_more_than_its_row_is_refused_before_it_is_decompressed(tmp_path):
    """A bomb: 256 MiB of zeros in a few KiB, where the row says 2 KiB. Refused from the frame's header;
    one without a declared size is refused too (nothing to bound it by but the row)."""
    segment, _ = write_pool(tmp_path, "zstd")
    bomb = _zstd(bytes(256 << 20))
    assert len(bomb) < 64 << 10
    assert "declares 268,435,456 bytes, its row 4,704" in refusal_after(segment, 1, bomb)
    streamed = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    unsized = streamed.compress(bytes(64 << 20)) + streamed.flush()
    assert "declares" in refusal_after(segment, 1, unsized)
    assert image_key(ImagePool([segment], None).read_stored([1])[0]) == image_key(IMAGES[1])  # restored, reads again


def test_only_a_dynamic_pool_is_compressed_and_only_with_a_known_codec(tmp_path):
    with pytest.raises(ValueError, match="only a dynamic pool"):
        pool_segment(tmp_path, "shard_00000", 0, dynamic=False, codec="zstd")
    with pytest.raises(ValueError, match="only a dynamic pool"):
        pool_segment(tmp_path, "shard_00000", 0, dynamic=True, codec="lzma")
