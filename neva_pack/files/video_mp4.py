"""The header of an MP4 / MOV (ISO-BMFF) clip, read from its boxes as FFmpeg's demuxer reads them.

::

    ftyp | free | mdat (media: skipped, never read) | moov   <- top level; moov may come first or last
    moov: mvhd (movie timescale) | trak ... | udta
      trak: tkhd (display matrix -> rotation) | edts/elst (edit list) | mdia
        mdia: mdhd (media timescale, duration) | hdlr ("vide") | minf/stbl
          stbl: stsd (sample entry: codec, width, height) | stts (sample durations) | ctts (composition
                offsets) | stsz (sample count) | stss | stsc | stco ...

Only the top level's box headers are read until ``moov`` is found; then ``moov`` is read whole (its
sample tables are bounded by the header budget) and only the boxes on the path above are parsed:
nesting is fixed by the path (no recursion into what a file declares) and each box is visited once.

What FFmpeg reports, and so what ``VideoHeader`` holds (libavformat/mov.c): ``nb_frames`` = the
samples of ``stts``; ``avg_frame_rate`` = timescale x samples / sum of durations (reduced to terms of
at most 2^31 - 1); duration = min(mdhd duration, sum of durations), or with an edit list the sum of
its non-empty edits in the media timescale. An edit list also decides which frames a decoder
presents: those whose composition time (decode time + ``ctts`` offset) falls inside an edit.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from neva_pack.files.video_common import (
    ByteSource,
    VideoHeader,
    VideoHeaderError,
    av_reduce,
)

__all__ = ["MP4_BRANDS", "read_mp4_header"]

MP4_BRANDS = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid")
"""Box types that can open an ISO-BMFF file (QuickTime files may lack ``ftyp``)."""

_LOOK_AHEAD = 1 << 16
"""Bytes read at a top-level box found past the file's first read: a whole ``moov`` of a few
minutes of video comes with its header."""
_MAX_TOP_BOXES = 4096
"""Top-level boxes walked before ``moov`` (real files have a handful)."""
_MAX_TRACKS = 1024
_MAX_CHILDREN = 1 << 14
"""Boxes one container may hold (a moov holds its tracks and a few more): 16-byte boxes filling a
64 MB moov would otherwise make millions of entries."""
_MAX_STTS_DELTA = 1 << 31
"""A sample duration this large is a damaged table (FFmpeg clips such values as corrections)."""
_INT_MAX = (1 << 31) - 1
_MAX_EDITS = 4096
"""Edits read from one edit list (real files have one to three)."""


def read_mp4_header(source: ByteSource, *, max_frames: int, max_pixels: int) -> VideoHeader:
    moov = _find_moov(source)
    tracks = _children(moov, 0, len(moov), "moov")
    movie_scale = _movie_timescale(moov, next((span for kind, *span in tracks if kind == b"mvhd"), None))
    if any(kind == b"mvex" for kind, _, _ in tracks):
        raise VideoHeaderError("video_unsupported", "a fragmented MP4 (moov/mvex): its frames are declared in "
                               "moof boxes through the file, not in the header")
    traks = [(start, end) for kind, start, end in tracks if kind == b"trak"]
    if len(traks) > _MAX_TRACKS:
        raise VideoHeaderError("video_malformed", f"{len(traks)} tracks (at most {_MAX_TRACKS} are read)")
    for start, end in traks:
        boxes = _index(moov, start, end, "trak")
        mdia = _index(moov, *_need(boxes, b"mdia", "trak"), "mdia")
        hdlr = _payload(moov, _need(mdia, b"hdlr", "mdia"), 12, "hdlr")
        if hdlr[8:12] == b"vide":
            return _video_track(moov, boxes, mdia, movie_scale, max_frames, max_pixels)
    raise VideoHeaderError("video_no_video_track", f"no video track among {len(traks)} track(s)")


def _find_moov(source: ByteSource) -> bytes:
    offset = 0
    for _ in range(_MAX_TOP_BOXES):
        if offset + 8 > source.size:
            break
        source.prefetch(offset, _LOOK_AHEAD)  # a box past the first read: it and what follows in one read
        size, kind, header = _box_header(source.upto(offset, 16), source.size - offset)
        if kind == b"moov":
            return source.bytes(offset + header, size - header, "the moov box")
        if kind == b"moof":
            raise VideoHeaderError("video_unsupported", "a fragmented MP4 (moof before moov)")
        offset += size
    else:
        raise VideoHeaderError("video_malformed", f"no moov among the first {_MAX_TOP_BOXES} boxes")
    raise VideoHeaderError("video_truncated", f"no moov box in the file's {source.size} bytes "
                           "(cut off before its header was written?)")


def _box_header(data: bytes, room: int) -> tuple[int, bytes, int]:
    """(size, type, header length) of the box at the start of ``data``, with ``room`` bytes left in
    its parent: a size of 0 runs to the parent's end, 1 means a 64-bit size follows."""
    if len(data) < 8:
        raise VideoHeaderError("video_truncated", f"a box header cut off ({len(data)} of 8 bytes)")
    size, kind = struct.unpack_from(">I4s", data)
    header = 8
    if size == 1:
        if len(data) < 16:
            raise VideoHeaderError("video_truncated", "a 64-bit box size cut off")
        size, header = struct.unpack_from(">Q", data, 8)[0], 16
    elif size == 0:
        size = room
    if size < header:
        raise VideoHeaderError("video_malformed", f"box {_name(kind)} declares {size} bytes, less than its header")
    if size > room:
        raise VideoHeaderError("video_truncated", f"box {_name(kind)} declares {size} bytes where {room} remain")
    return size, kind, header


def _name(kind: bytes) -> str:
    return repr(kind.decode("latin-1"))


_HEAD = struct.Struct(">I4s")


def _children(data: bytes, start: int, end: int, parent: str) -> list[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of each box in ``data[start:end]``: at most one per 8 bytes."""
    out, at = [], start
    while at < end:
        if len(out) == _MAX_CHILDREN:
            raise VideoHeaderError("video_malformed", f"{parent} holds more than {_MAX_CHILDREN} boxes")
        room = end - at
        if room < 8:
            raise VideoHeaderError("video_malformed", f"{room} stray bytes at the end of {parent}")
        size, kind = _HEAD.unpack_from(data, at)
        header = 8
        if size == 1:
            if room < 16:
                raise VideoHeaderError("video_truncated", f"a 64-bit box size cut off in {parent}")
            size, header = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = room
        if size < header or size > room:
            raise VideoHeaderError("video_malformed", f"box {_name(kind)} in {parent} declares {size} bytes "
                                   f"where {room} remain")
        out.append((kind, at + header, at + size))
        at += size
    return out


def _index(data, start, end, parent) -> dict[bytes, tuple[int, int]]:
    """The first box of each type in a container (later duplicates are ignored, as FFmpeg warns)."""
    found: dict[bytes, tuple[int, int]] = {}
    for kind, s, e in _children(data, start, end, parent):
        found.setdefault(kind, (s, e))
    return found


def _need(boxes: dict, kind: bytes, parent: str) -> tuple[int, int]:
    if kind not in boxes:
        raise VideoHeaderError("video_malformed", f"{parent} has no {kind.decode()} box")
    return boxes[kind]


def _payload(data: bytes, span: tuple[int, int], minimum: int, what: str) -> bytes:
    start, end = span
    if end - start < minimum:
        raise VideoHeaderError("video_malformed", f"{what} box of {end - start} bytes (at least {minimum} expected)")
    return data[start:end]


def _movie_timescale(moov: bytes, span) -> int:
    if span is None:
        raise VideoHeaderError("video_malformed", "moov has no mvhd box")
    mvhd = _payload(moov, span, 20, "mvhd")
    return struct.unpack_from(">I", mvhd, 20 if mvhd[0] == 1 else 12)[0] if len(mvhd) >= 24 else 0


def _video_track(moov, boxes, mdia, movie_scale, max_frames, max_pixels) -> VideoHeader:
    mdhd = _payload(moov, _need(mdia, b"mdhd", "mdia"), 24, "mdhd")
    if mdhd[0] == 1:
        if len(mdhd) < 32:
            raise VideoHeaderError("video_malformed", "version 1 mdhd box cut short")
        scale, media_duration = struct.unpack_from(">IQ", mdhd, 20)
        unknown = (1 << 64) - 1
    else:
        scale, media_duration = struct.unpack_from(">II", mdhd, 12)
        unknown = (1 << 32) - 1
    if media_duration == unknown:
        media_duration = 0  # "unknown": FFmpeg reports a duration of 0, as for a declared 0
    minf = _index(moov, *_need(mdia, b"minf", "mdia"), "minf")
    stbl = _index(moov, *_need(minf, b"stbl", "minf"), "stbl")
    codec, width, height = _sample_entry(_payload(moov, _need(stbl, b"stsd", "stbl"), 8, "stsd"))
    if width * height > max_pixels:
        raise VideoHeaderError("video_too_large", f"{width} x {height} frames ({width * height} pixels, at most {max_pixels})")
    if width == 0 or height == 0:
        raise VideoHeaderError("video_empty", f"a {width} x {height} video track")
    counts, deltas = _table(_payload(moov, _need(stbl, b"stts", "stbl"), 8, "stts"), "stts")
    frames = int(counts.sum())
    if frames > max_frames:
        raise VideoHeaderError("video_too_many_frames", f"{frames} frames declared (at most {max_frames})")
    if frames == 0:
        raise VideoHeaderError("video_empty", "a video track with no frame")
    if b"stsz" in stbl:
        stsz = _payload(moov, stbl[b"stsz"], 12, "stsz")
        sizes = struct.unpack_from(">I", stsz, 8)[0]
        if sizes != frames:
            raise VideoHeaderError("video_malformed", f"stts declares {frames} frames, stsz {sizes}")
    if deltas.size and int(deltas.max()) >= _MAX_STTS_DELTA:
        raise VideoHeaderError("video_bad_frame_rate", f"a frame lasting {int(deltas.max())} ticks")
    ticks = int((counts * deltas).sum())
    if scale == 0 or ticks <= 0:
        raise VideoHeaderError("video_bad_frame_rate", f"timescale {scale}, {ticks} ticks for {frames} frames: "
                               "the frame rate is not a number")
    num, den = av_reduce(scale * frames, ticks, _INT_MAX)
    if num == 0:
        raise VideoHeaderError("video_bad_frame_rate", f"{frames} frames in {ticks} ticks of 1/{scale} s: "
                               "a frame rate that rounds to 0")
    duration = min(media_duration, ticks)
    presented = frames
    if b"edts" in boxes:
        edits, span = _edits(moov, boxes[b"edts"], movie_scale, scale)
        if edits:
            duration = min(duration, span)
            ctts = _table(_payload(moov, stbl[b"ctts"], 8, "ctts"), "ctts") if b"ctts" in stbl else None
            presented = _presented(counts, deltas, ctts, edits)
            if presented > max_frames:
                raise VideoHeaderError("video_too_many_frames", f"an edit list presenting {presented} frames "
                                       f"(at most {max_frames})")
    return VideoHeader(
        container="mp4", codec=codec, width=width, height=height, rotation=_rotation(moov, boxes),
        frame_count=frames, presented_frames=presented, fps=num / den,
        duration_s=duration / scale,
    )


def _sample_entry(stsd: bytes) -> tuple[str, int, int]:
    """The first sample entry's type and coded size (VisualSampleEntry: width, height at 24..28)."""
    if len(stsd) < 16 or struct.unpack_from(">I", stsd, 4)[0] == 0:
        raise VideoHeaderError("video_malformed", "a video track whose stsd box has no sample entry")
    size, kind, header = _box_header(stsd[8:24], len(stsd) - 8)
    if size - header < 28:
        raise VideoHeaderError("video_malformed", f"sample entry {_name(kind)} of {size} bytes has no frame size")
    width, height = struct.unpack_from(">HH", stsd, 8 + header + 24)
    return kind.decode("latin-1"), width, height


def _table(box: bytes, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The (count, value) runs of an ``stts`` or ``ctts`` box, as int64 arrays: counts unsigned, and
    ``ctts`` offsets signed whatever the box's version says (FFmpeg reads them so: encoders write
    negative offsets in version 0 boxes too)."""
    entries = struct.unpack_from(">I", box, 4)[0]
    if 8 + 8 * entries > len(box):
        raise VideoHeaderError("video_malformed", f"{what} declares {entries} entries in {len(box)} bytes")
    pairs = np.frombuffer(box, dtype=">u4", count=2 * entries, offset=8).astype(np.int64)
    counts, values = pairs[0::2], pairs[1::2]
    if what == "ctts":
        values = values - ((values & 0x80000000) << 1)
    return counts, values


def _edits(moov, span, movie_scale, media_scale) -> tuple[list[tuple[int, int]], int]:
    """The non-empty edits of ``elst`` as (media time, duration in the media timescale), and the
    duration of all edits (empty ones, media time -1, delay the start: they present no frame but
    count in the stream's duration, which FFmpeg caps at that sum)."""
    elst = _index(moov, *span, "edts").get(b"elst")
    if elst is None:
        return [], 0
    box = _payload(moov, elst, 8, "elst")
    version, entries = box[0], struct.unpack_from(">I", box, 4)[0]
    width = 20 if version == 1 else 12
    if entries > _MAX_EDITS:
        raise VideoHeaderError("video_malformed", f"an edit list of {entries} edits (at most {_MAX_EDITS} are read)")
    if 8 + width * entries > len(box):
        raise VideoHeaderError("video_malformed", f"elst declares {entries} edits in {len(box)} bytes")
    if movie_scale == 0:
        raise VideoHeaderError("video_bad_frame_rate", "an edit list in a movie timescale of 0")
    edits, total = [], 0
    for i in range(entries):
        if version == 1:
            length, media_time = struct.unpack_from(">Qq", box, 8 + width * i)
        else:
            length, media_time = struct.unpack_from(">Ii", box, 8 + width * i)
        length = (length * media_scale + movie_scale // 2) // movie_scale
        total += length
        if media_time == -1:
            continue
        if media_time < 0:
            raise VideoHeaderError("video_malformed", f"edit {i} starts at media time {media_time}")
        edits.append((media_time, length))
    return edits, total


def _presented(counts, deltas, ctts, edits) -> int:
    """How many samples have a composition time inside an edit (each edit counted on its own: an
    edit list may show a stretch twice). The usual list, one edit spanning every sample (an encoder's
    B-frame delay), is answered from the extremes; otherwise two comparisons per sample and edit, or
    for a long list one sort and a binary search per edit."""
    frames = int(counts.sum())
    if counts.size == 1:  # one frame duration throughout: decode times are a range
        cts = np.arange(0, frames * int(deltas[0]), int(deltas[0]), dtype=np.int64) if deltas[0] else np.zeros(frames, np.int64)
    else:
        durations = np.repeat(deltas, counts)
        cts = np.cumsum(durations)
        cts -= durations  # decode times: each sample starts where the ones before it end
    if ctts is not None and ctts[0].size:
        runs, values = ctts
        if int(runs.sum()) > frames:  # offsets for more samples than there are: the rest is ignored
            ends = np.cumsum(runs)
            last = int(np.searchsorted(ends, frames))
            runs, values = runs[:last + 1].copy(), values[:last + 1]
            runs[last] -= int(ends[last]) - frames
        offsets = np.repeat(values, runs)
        cts[:offsets.size] += offsets  # negative offsets too: FFmpeg compares these times to the edits unshifted
    if len(edits) == 1:
        start, length = edits[0]
        if start <= int(cts.min()) and int(cts.max()) < start + length:
            return int(cts.size)
    if len(edits) <= 4:
        return sum(int(np.count_nonzero((cts >= start) & (cts < start + length))) for start, length in edits)
    cts.sort()
    starts = np.array([start for start, _ in edits], dtype=np.int64)
    ends = starts + np.array([length for _, length in edits], dtype=np.int64)
    return int((np.searchsorted(cts, ends) - np.searchsorted(cts, starts)).sum())


def _rotation(moov: bytes, boxes: dict) -> int:
    """Clockwise degrees from ``tkhd``'s display matrix (a b / c d in 16.16): the angle of (a, b),
    snapped to a quarter turn as players do; a mirrored matrix is read for its rotation alone, and
    the movie's own matrix (``mvhd``, the identity in practice) is not applied."""
    if b"tkhd" not in boxes:
        return 0
    tkhd = _payload(moov, boxes[b"tkhd"], 84, "tkhd")
    at = 52 if tkhd[0] == 1 else 40
    if len(tkhd) < at + 16:
        raise VideoHeaderError("video_malformed", "tkhd box cut short of its matrix")
    a, b = struct.unpack_from(">ii", tkhd, at)
    if a == 0 and b == 0:
        return 0
    return round(math.degrees(math.atan2(b, a)) / 90) % 4 * 90
