"""The header of a Matroska / WebM clip, read from its EBML elements as FFmpeg's demuxer reads them.

::

    EBML header (DocType "matroska" | "webm")
    Segment                                   <- its size may be "unknown" (a live recording)
      SeekHead | Info (TimecodeScale, Duration) | Tracks | Cues | Tags ...   <- skipped unless named here
      Tracks: TrackEntry (TrackNumber, TrackType 1 = video, CodecID, DefaultDuration,
              Video: PixelWidth, PixelHeight, Projection/ProjectionPoseRoll)
      Cluster (size known or unknown): Timecode | SimpleBlock | BlockGroup/Block ...

Matroska declares no frame count (FFmpeg's ``nb_frames`` is 0 for it), so the frames are counted:
every Cluster's SimpleBlock and Block headers are read (track number, flags, lace count: a few bytes
each) and their payloads skipped, never read. That reads a few bytes per frame (a file of N frames
costs N small reads, about 2.5 us each), not the media; the count is what a decoder presents. A
caller that plans many long clips may ask for the estimate instead (``count_frames=False``):
round(Duration / DefaultDuration), exact for a constant-rate track whose Duration ends with its
last frame (FFmpeg's and mkvmerge's files), read without touching a Cluster.

Only the elements on the paths above are entered, each loop walking one element's children once, so
nesting a file declares (a "billion laughs" of masters inside masters) is skipped by its size, never
descended. Every element walked counts against an element budget, every size is checked against its
parent, and an unknown size is allowed only where Matroska allows it (Segment, Cluster).
"""

from __future__ import annotations

import math
import struct

from neva_pack.files.video_common import (
    ByteSource,
    VideoHeader,
    VideoHeaderError,
    av_reduce,
)

__all__ = ["EBML_MAGIC", "read_matroska_header"]

EBML_MAGIC = b"\x1a\x45\xdf\xa3"

_EBML, _DOCTYPE, _SEGMENT, _INFO, _TRACKS, _CLUSTER = 0x1A45DFA3, 0x4282, 0x18538067, 0x1549A966, 0x1654AE6B, 0x1F43B675
_TIMECODE_SCALE, _DURATION = 0x2AD7B1, 0x4489
_TRACK_ENTRY, _TRACK_NUMBER, _TRACK_TYPE, _CODEC_ID, _DEFAULT_DURATION, _VIDEO = 0xAE, 0xD7, 0x83, 0x86, 0x23E383, 0xE0
_PIXEL_WIDTH, _PIXEL_HEIGHT, _PROJECTION, _POSE_ROLL = 0xB0, 0xBA, 0x7670, 0x7675
_SIMPLE_BLOCK, _BLOCK_GROUP, _BLOCK = 0xA3, 0xA0, 0xA1
_TOP_LEVEL = frozenset({_CLUSTER, _INFO, _TRACKS, 0x114D9B74, 0x1C53BB6B, 0x1254C367, 0x1043A770, 0x1941A469, _EBML})
"""IDs that end a Cluster of unknown size (the next top-level element begins)."""
_UNKNOWN = -1
_LOOK = 24
_MAX_TRACKS = 1024
"""Tracks read, and track numbers counted in blocks (the inline path's are under 128)."""
"""Bytes read at an element's start: its header (at most 12) and a SimpleBlock's own header."""
_SMALL = 1 << 16
"""The largest value element (number, string, float) read: the ones read here are a few bytes."""
_FFMPEG_RATE_LIMIT = 30000
"""FFmpeg approximates 10^9 / DefaultDuration by a fraction with terms of at most this."""


def read_matroska_header(source: ByteSource, *, max_frames: int, max_pixels: int, max_elements: int,
                         count_frames: bool = True) -> VideoHeader:
    """``count_frames`` False: a video track with a DefaultDuration, in a segment with a Duration,
    takes round(Duration / DefaultDuration) frames and no Cluster is read (the walk stops at the first
    one); the count of a constant-rate track, which a decode confirms or not."""
    walk = _Walk(source, max_elements)
    element_id, start, end, _ = walk.element(0, source.size)
    if element_id != _EBML:
        raise VideoHeaderError("video_unknown_format", "no EBML header at the start of the file")
    doctype = next((walk.string(s, e) for i, s, e in walk.children(start, end) if i == _DOCTYPE), "matroska")
    if doctype not in ("matroska", "webm"):
        raise VideoHeaderError("video_unknown_format", f"an EBML file of DocType {doctype!r}")
    element_id, start, end, _ = walk.element(end, source.size, unknown_ok=True)
    if element_id != _SEGMENT:
        raise VideoHeaderError("video_malformed", f"element {element_id:#x} where the Segment belongs")
    end = source.size if end is None else end
    scale, duration, tracks, blocks = 1_000_000, None, [], {}
    for element_id, s, e in walk.children(start, end, clusters=True):
        if element_id == _INFO:
            for i, s2, e2 in walk.children(s, e):
                if i == _TIMECODE_SCALE:
                    scale = walk.uint(s2, e2)
                elif i == _DURATION:
                    duration = walk.float(s2, e2)
        elif element_id == _TRACKS and not tracks:
            for i, s2, e2 in walk.children(s, e):
                if i == _TRACK_ENTRY:
                    if len(tracks) == _MAX_TRACKS:
                        raise VideoHeaderError("video_malformed", f"more than {_MAX_TRACKS} tracks")
                    tracks.append(_track(walk, s2, e2))
        elif element_id == _CLUSTER:
            if not count_frames and _estimate(tracks, scale, duration, max_frames) is not None:
                break
            _count_blocks(walk, s, e, blocks, max_frames)
    video = next((track for track in tracks if track["type"] == 1), None)
    if video is None:
        raise VideoHeaderError("video_no_video_track", f"no video track among {len(tracks)} track(s)")
    estimate = None if count_frames else _estimate(tracks, scale, duration, max_frames)
    return _header(video, blocks.get(video["number"], 0) if estimate is None else estimate, scale, duration, max_pixels)


def _estimate(tracks: list[dict], scale: int, duration, max_frames: int) -> int | None:
    """round(Duration / DefaultDuration) of the first video track, where both are known and finite."""
    video = next((track for track in tracks if track["type"] == 1), None)
    if video is None or not video["default_duration"] or duration is None or not math.isfinite(duration * scale):
        return None
    frames = round(duration * scale / video["default_duration"])
    if frames > max_frames:
        raise VideoHeaderError("video_too_many_frames", f"about {frames} frames declared (at most {max_frames})")
    return frames


def _header(video: dict, frames: int, scale: int, duration, max_pixels: int) -> VideoHeader:
    width, height = video["width"], video["height"]
    if width * height > max_pixels:
        raise VideoHeaderError("video_too_large", f"{width} x {height} frames ({width * height} pixels, at most {max_pixels})")
    if width == 0 or height == 0:
        raise VideoHeaderError("video_empty", f"a {width} x {height} video track")
    if frames == 0:
        raise VideoHeaderError("video_empty", "a video track with no frame in its clusters")
    if scale == 0 or duration is None or not math.isfinite(duration) or duration <= 0:
        raise VideoHeaderError("video_bad_frame_rate", f"segment duration {duration} x timecode scale {scale} ns: "
                               "the frame rate is not a number")
    seconds = duration * scale / 1e9
    if not math.isfinite(seconds):
        raise VideoHeaderError("video_bad_frame_rate", f"segment duration {duration} x timecode scale {scale} ns")
    if video["default_duration"]:
        num, den = av_reduce(1_000_000_000, video["default_duration"], _FFMPEG_RATE_LIMIT)
        fps = num / den if den else math.nan
    else:
        fps = frames / seconds
    if not math.isfinite(fps) or fps <= 0:
        raise VideoHeaderError("video_bad_frame_rate", f"a frame rate of {fps}")
    return VideoHeader(container="matroska", codec=video["codec"], width=width, height=height,
                       rotation=video["rotation"], frame_count=frames, presented_frames=frames, fps=fps,
                       duration_s=seconds)


def _track(walk: _Walk, start: int, end: int) -> dict:
    track = {"number": 0, "type": 0, "codec": "", "default_duration": 0, "width": 0, "height": 0, "rotation": 0}
    for element_id, s, e in walk.children(start, end):
        if element_id == _TRACK_NUMBER:
            track["number"] = walk.uint(s, e)
        elif element_id == _TRACK_TYPE:
            track["type"] = walk.uint(s, e)
        elif element_id == _CODEC_ID:
            track["codec"] = walk.string(s, e)
        elif element_id == _DEFAULT_DURATION:
            track["default_duration"] = walk.uint(s, e)
        elif element_id == _VIDEO:
            for i, s2, e2 in walk.children(s, e):
                if i == _PIXEL_WIDTH:
                    track["width"] = walk.uint(s2, e2)
                elif i == _PIXEL_HEIGHT:
                    track["height"] = walk.uint(s2, e2)
                elif i == _PROJECTION:
                    roll = next((walk.float(s3, e3) for i3, s3, e3 in walk.children(s2, e2) if i3 == _POSE_ROLL), 0.0)
                    # FFmpeg turns the picture counter-clockwise by the roll: clockwise is its negation
                    track["rotation"] = round(-roll / 90) % 4 * 90 if math.isfinite(roll) else 0
    return track


def _count_blocks(walk: _Walk, start: int, end: int, blocks: dict, max_frames: int) -> None:
    """Adds each track's frames in one Cluster to ``blocks`` (a laced block holds several). A
    SimpleBlock's header (track number, timecode, flags, lace count) follows its element header, so
    one look-ahead read serves both; a Cluster of unknown size ends at the next top-level element.

    The common SimpleBlock (1-byte ID, a track number under 128) is read inline: the frame count of
    a Matroska file costs one small read and a few byte operations per block."""
    source = walk.source
    at = start
    while at < end:
        head = source.upto(at, min(_LOOK, end - at))
        if head[0] == _SIMPLE_BLOCK and len(head) >= 14:
            length = 9 - head[1].bit_length()  # the size's length (9 for an invalid 0x00)
            size = int.from_bytes(head[1:1 + length], "big") & ((1 << (7 * length)) - 1)
            block = 1 + length
            if length <= 8 and size != (1 << (7 * length)) - 1 and size >= 5 and at + block + size <= end \
                    and head[block] & 0x80 and block + 5 <= len(head):
                walk.left -= 1
                if walk.left < 0:
                    raise VideoHeaderError("video_header_too_large", "more EBML elements than the element budget")
                number = head[block] & 0x7F
                total = blocks.get(number, 0) + (head[block + 4] + 1 if head[block + 3] & 0x06 else 1)
                if total > max_frames:
                    raise VideoHeaderError("video_too_many_frames", f"more than {max_frames} frames in track {number}")
                blocks[number] = total
                at += block + size
                continue
        element_id, s, e, head = walk.element(at, end)
        if element_id in _TOP_LEVEL:
            return
        if element_id == _SIMPLE_BLOCK:
            block = head[s - at:]
            if len(block) < 12 and e - s > len(block):
                block = walk.source.upto(s, min(e - s, 12))
            _add_block(block, s, e, blocks, max_frames)
        elif element_id == _BLOCK_GROUP:
            for i, s2, e2 in walk.children(s, e):
                if i == _BLOCK:
                    _add_block(walk.source.upto(s2, min(e2 - s2, 12)), s2, e2, blocks, max_frames)
        at = e


def _add_block(head: bytes, start: int, end: int, blocks: dict, max_frames: int) -> None:
    number, length = _vint(head, 0, "a block's track number")
    if length + 4 > min(end - start, len(head)):
        raise VideoHeaderError("video_malformed", f"a block of {end - start} bytes at offset {start}")
    frames = head[length + 3] + 1 if head[length + 2] & 0x06 else 1
    if number not in blocks and len(blocks) == _MAX_TRACKS:
        raise VideoHeaderError("video_malformed", f"blocks of more than {_MAX_TRACKS} track numbers")
    total = blocks.get(number, 0) + frames
    if total > max_frames:
        raise VideoHeaderError("video_too_many_frames", f"more than {max_frames} frames in track {number}")
    blocks[number] = total


def _vint(data: bytes, at: int, what: str, keep_marker: bool = False) -> tuple[int, int]:
    """An EBML variable-length integer at ``data[at]``: (value, length); the value -1 when all its
    bits are set (an unknown size). IDs keep their marker bit (``keep_marker``)."""
    if at >= len(data):
        raise VideoHeaderError("video_truncated", f"{what} cut off")
    first = data[at]
    if first == 0:
        raise VideoHeaderError("video_malformed", f"{what} is not a valid EBML number (a 0x00 byte)")
    length = 9 - first.bit_length()
    if at + length > len(data):
        raise VideoHeaderError("video_truncated", f"{what} cut off")
    value = int.from_bytes(data[at:at + length], "big")
    if keep_marker:
        return value, length
    value &= (1 << (7 * length)) - 1
    return (_UNKNOWN if value == (1 << (7 * length)) - 1 else value), length


class _Walk:
    """Element headers read from the source within an element budget."""

    def __init__(self, source: ByteSource, max_elements: int):
        self.source = source
        self.left = max_elements

    def element(self, at: int, end: int, unknown_ok: bool = False) -> tuple[int, int, int | None, bytes]:
        """(ID, data start, data end, look-ahead) of the element at ``at`` inside a parent ending at
        ``end``: the end None for an unknown size (refused unless ``unknown_ok``); the look-ahead the
        bytes read from ``at`` (the header and up to ``_LOOK`` bytes in all)."""
        self.left -= 1
        if self.left < 0:
            raise VideoHeaderError("video_header_too_large", "more EBML elements than the element budget")
        head = self.source.upto(at, min(_LOOK, end - at))
        element_id, id_length = _vint(head, 0, "an element ID", keep_marker=True)
        if id_length > 4:
            raise VideoHeaderError("video_malformed", f"an element ID of {id_length} bytes at offset {at}")
        size, size_length = _vint(head, id_length, "an element size")
        start = at + id_length + size_length
        if size == _UNKNOWN:
            if not unknown_ok:
                raise VideoHeaderError("video_malformed", f"element {element_id:#x} of unknown size at offset {at}")
            return element_id, start, None, head
        if start + size > end:
            reason = "video_truncated" if end == self.source.size else "video_malformed"
            raise VideoHeaderError(reason, f"element {element_id:#x} at offset {at} declares {size} bytes "
                                   f"where {end - start} remain")
        return element_id, start, start + size, head

    def children(self, start: int, end: int, clusters: bool = False):
        """Each child (ID, data start, data end) in ``[start, end)``. With ``clusters`` (the Segment's
        children) a Cluster may have an unknown size: it ends where the next top-level element begins."""
        at = start
        while at < end:
            element_id, s, e, _ = self.element(at, end, unknown_ok=clusters)
            if e is None:
                if element_id != _CLUSTER:
                    raise VideoHeaderError("video_malformed", f"element {element_id:#x} of unknown size at offset {at}")
                e = self._cluster_end(s, end)
            yield element_id, s, e
            at = e

    def _cluster_end(self, start: int, end: int) -> int:
        at = start
        while at < end:
            element_id, _, e, _ = self.element(at, end)
            if element_id in _TOP_LEVEL:
                return at
            at = e
        return end

    def _value(self, start: int, end: int) -> bytes:
        if end - start > _SMALL:
            raise VideoHeaderError("video_malformed", f"a {end - start}-byte value element at offset {start}")
        return self.source.bytes(start, end - start, "a value element")

    def uint(self, start: int, end: int) -> int:
        data = self._value(start, end)
        if len(data) > 8:
            raise VideoHeaderError("video_malformed", f"a {len(data)}-byte integer at offset {start}")
        return int.from_bytes(data, "big")

    def float(self, start: int, end: int) -> float:
        data = self._value(start, end)
        if len(data) not in (0, 4, 8):
            raise VideoHeaderError("video_malformed", f"a {len(data)}-byte float at offset {start}")
        return struct.unpack(">f" if len(data) == 4 else ">d", data)[0] if data else 0.0

    def string(self, start: int, end: int) -> str:
        return self._value(start, end).rstrip(b"\0").decode("latin-1")
