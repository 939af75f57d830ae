"""Lossless compression of a dynamic image pool's entries (``--frame_compression zstd``): one zstd frame per
image or video clip, decompressed only within the size the pool's rows say it has.

    <segment>.images       each entry's zstd frame, back to back (instead of its raw uint8 parts)
    <segment>.entry_sizes  int64 per entry: the bytes of its frame in .images (their sums are the offsets)

An entry is the bytes a raw pool holds for it (its parts, C-order, back to back), compressed whole at
``ZSTD_LEVEL`` with zstd's content size and checksum in the frame. Reading it back trusts nothing of
the frame: its declared content size must be the size the entry's row gives (its parts' shapes) before
any byte is decompressed, the output is capped at that size, and zstd's own checksum must hold -- a
damaged or hostile payload is refused in one line, never decompressed past what the row allows.

Why zstd at level 3 (benchmarks/bench_frame_store.py measures it): on frames of real video (an H.264
pan over photographs, 20 frames at 644x364) it keeps 1.9x fewer bytes and decodes at ~700 MB/s, where
PNG keeps 3.2x fewer but encodes at 17 MB/s and decodes at 130 MB/s, and WebP-lossless 4.9x at 6 and
110 MB/s: their encoders alone would cost more than decoding the clip, zstd's costs a fraction of it.
The same zstd library and level always give the same bytes, so the store stays byte-identical across
runs and worker counts.
"""

from __future__ import annotations

__all__ = ["FRAME_CODECS", "ZSTD_LEVEL", "compress_entry", "decompress_entry"]

FRAME_CODECS = ("zstd",)
"""The codecs a pool's entries may be stored with (--frame_compression); none: raw uint8."""
ZSTD_LEVEL = 3
"""zstd's own default level: the ratio's knee (benchmarks/bench_frame_store.py)."""


def compress_entry(codec: str, data) -> bytes:
    """One pool entry's raw bytes (a buffer) as one frame of ``codec``, its content size and checksum in it."""
    if codec != "zstd":
        raise ValueError(f"frame codec {codec!r}: not one of {FRAME_CODECS}")
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True).compress(data)


def decompress_entry(codec: str, payload: bytes, expected: int) -> bytes:
    """The raw bytes of one entry whose row says it holds ``expected`` bytes; ValueError (one line) when
    the payload declares another size, is damaged or decompresses to anything else -- nothing beyond
    ``expected`` bytes is ever allocated."""
    if codec != "zstd":
        raise ValueError(f"frame codec {codec!r}: not one of {FRAME_CODECS}")
    import zstandard

    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame ({exc})") from None
    if declared < 0:
        raise ValueError(f"its zstd frame declares no content size (its row {expected:,} bytes)")
    if declared != expected:
        raise ValueError(f"its zstd frame declares {declared:,} bytes, its row {expected:,}")
    reader = zstandard.ZstdDecompressor().decompressobj()  # the frame's declared size (== expected) bounds its output
    try:
        data = reader.decompress(payload)
    except zstandard.ZstdError as exc:
        raise ValueError(f"its zstd frame is damaged ({exc})") from None
    if not reader.eof or reader.unused_data or len(data) != expected:
        raise ValueError(f"its zstd frame is cut short or followed by other bytes ({len(data):,} bytes of {expected:,})")
    return data
