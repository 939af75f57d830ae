"""What the video container readers share: the header they return, its one error, the budgets, and a
bounded view of an untrusted file that reads only the byte ranges a reader asks for."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "MAX_VIDEO_FRAMES",
    "MAX_VIDEO_HEADER_BYTES",
    "MAX_VIDEO_PIXELS",
    "VIDEO_HEADER_REASONS",
    "ByteSource",
    "VideoHeader",
    "VideoHeaderError",
    "av_reduce",
]

MAX_VIDEO_FRAMES = 1 << 20
"""Frames one clip may declare (about 9.7 hours at 30 fps); more is ``video_too_many_frames``."""
MAX_VIDEO_PIXELS = 7680 * 4320
"""Pixels of one frame as stored (8K UHD); more is ``video_too_large``."""
MAX_VIDEO_HEADER_BYTES = 64 << 20
"""Bytes of header one clip may make us read (an MP4 ``moov``, a Matroska header): a ten-hour
clip's sample tables are about 16 MB; more is ``video_header_too_large``."""

VIDEO_HEADER_REASONS = {
    "video_unknown_format": "a video file is neither MP4/MOV (ISO-BMFF) nor Matroska/WebM",
    "video_truncated": "a video's header (MP4 moov, Matroska element) runs past the end of the file",
    "video_malformed": "a video's header breaks its container's structure (box or element sizes, "
    "nesting, sample tables that disagree)",
    "video_no_video_track": "a video file holds no video track (audio only, or nothing)",
    "video_empty": "a video track declares no frame, no size or no duration",
    "video_bad_frame_rate": "a video's frame rate is zero, infinite or not a number "
    "(a zero timescale or zero frame durations)",
    "video_too_many_frames": "a video declares more frames than the frame budget",
    "video_too_large": "a video's frames have more pixels than the pixel budget",
    "video_header_too_large": "a video's header is larger than the header budget, or holds too many elements",
    "video_unsupported": "a video container feature the header reader does not plan from "
    "(fragmented MP4, a Matroska track whose blocks are not counted)",
}
"""Every reason ``VideoHeaderError`` carries, with what it means (for a run's skip summary)."""


class VideoHeaderError(ValueError):
    """A video header that is not planned from: ``reason`` is one of ``VIDEO_HEADER_REASONS``, the
    message one line saying what was found."""

    def __init__(self, reason: str, message: str):
        if reason not in VIDEO_HEADER_REASONS:
            raise ValueError(f"unknown video header reason {reason!r}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoHeader:
    """A clip's first video track as its container declares it, equal to what PyAV (FFmpeg) reports
    for the same file when it opens it: the reference loaders (Hugging Face's video utilities,
    qwen-vl-utils) sample frame indices from these numbers."""

    container: str
    """"mp4" (MP4, MOV: ISO-BMFF) or "matroska" (MKV, WebM)."""
    codec: str
    """The MP4 sample entry ("avc1", "hvc1", "mp4v", "vp09", ...) or Matroska CodecID ("V_VP9", ...)."""
    width: int
    """Coded width as stored, before rotation."""
    height: int
    rotation: int
    """Clockwise degrees a player turns the picture by to display it: 0, 90, 180 or 270."""
    frame_count: int
    """FFmpeg's ``nb_frames`` (PyAV ``stream.frames``) for MP4: the samples ``stts`` declares. Matroska
    declares none (PyAV reports 0): the count of the track's frames in its blocks."""
    presented_frames: int
    """Frames a decoder presents: ``frame_count`` less those an MP4 edit list leaves out."""
    fps: float
    """PyAV's ``float(stream.average_rate)``: frames over the sample durations (MP4), 10^9 / the
    track's DefaultDuration (Matroska, approximated as FFmpeg does), else frames over duration."""
    duration_s: float
    """The stream's duration in seconds as FFmpeg computes it. MP4: the media header's, capped at the
    sum of the sample durations and at the edit list's length; 0 where the media header declares
    none (0, or all ones for "unknown"), as FFmpeg reports. Matroska: the segment's Duration (FFmpeg
    gives the stream none); it counts in TimecodeScale units (milliseconds as FFmpeg writes it)."""

    @property
    def frames_disagree(self) -> bool:
        """True when a decoder presents fewer (or more) frames than ``frame_count`` says: a loader that
        samples indices from ``stream.frames`` would ask for frames that never come."""
        return self.presented_frames != self.frame_count


def av_reduce(num: int, den: int, limit: int) -> tuple[int, int]:
    """``num/den`` as the closest fraction whose terms are at most ``limit`` (FFmpeg's ``av_reduce``:
    continued fractions, the last convergent's best semiconvergent), for frame rates equal to PyAV's."""
    g = math.gcd(num, den)
    if g:
        num, den = num // g, den // g
    if num <= limit and den <= limit:
        return num, den
    p0, q0, p1, q1 = 0, 1, 1, 0
    while den:
        x = num // den
        p2, q2 = x * p1 + p0, x * q1 + q0
        if p2 > limit or q2 > limit:
            x = (limit - p0) // p1 if p1 else x
            x = min(x, (limit - q0) // q1) if q1 else x
            if den * (2 * x * q1 + q0) > num * q1:
                p1, q1 = x * p1 + p0, x * q1 + q0
            break
        p0, q0, p1, q1 = p1, q1, p2, q2
        num, den = den, num - den * x
    return p1, q1


class ByteSource:
    """An untrusted file seen through ``read(offset, size) -> bytes`` (fewer bytes at its end), of a
    known ``size``; the bytes asked for add up to at most ``budget``. The first ``head`` bytes are
    read once and served from memory; a small read elsewhere (an element header) is served from a
    ``window`` read at its offset, so a walk over consecutive headers makes one read per window; a
    reader that expects a large read next asks for a larger window (``prefetch``); any other large
    read is made as asked. A reader never pulls in media data it skips (an MP4 ``mdat``; a Matroska
    block's payload, beyond the window its header opens)."""

    SMALL = 64
    """Reads up to this many bytes are served from a window."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, *, budget: int, head: int = 1 << 15,
                 window: int = 1 << 10):
        self._read = read
        self.size = size
        self.budget = budget
        self._window_size = window
        self.spent = min(head, size, budget)
        self._head = self._fetch(0, self.spent) if size else b""
        self._window, self._window_at = b"", 0

    def _fetch(self, offset: int, length: int) -> bytes:
        data = self._read(offset, length)
        if len(data) != length:
            raise VideoHeaderError("video_truncated", f"{length} bytes at offset {offset} could not be read "
                                   f"(the file has {self.size})")
        return data

    def bytes(self, offset: int, length: int, what: str) -> bytes:
        """Exactly ``length`` bytes at ``offset``, or ``video_truncated`` naming ``what`` they were."""
        end = offset + length
        if offset < 0 or length < 0 or end > self.size:
            raise VideoHeaderError("video_truncated", f"{what} ({length} bytes at offset {offset}) runs past "
                                   f"the end of the file ({self.size} bytes)")
        if end <= len(self._head):
            return self._head[offset:end]
        at = offset - self._window_at
        if at >= 0 and end - self._window_at <= len(self._window):
            return self._window[at:at + length]
        if length > self.SMALL:
            self._spend(length)
            return self._fetch(offset, length)
        self._spend(min(self._window_size, self.size - offset))
        self._window = self._fetch(offset, min(self._window_size, self.size - offset))
        self._window_at = offset
        return self._window[:length]

    def prefetch(self, offset: int, length: int) -> None:
        """Unless the first read or the window holds ``offset``'s next 16 bytes, reads up to ``length``
        bytes there into the window (counted against the budget): a reader that knows what comes next
        (an MP4 ``moov`` after its box header) gets it in one read."""
        if offset + 16 <= len(self._head) or 0 <= offset - self._window_at <= len(self._window) - 16:
            return
        length = min(length, self.size - offset)
        self._spend(length)
        self._window, self._window_at = self._fetch(offset, length), offset

    def _spend(self, length: int) -> None:
        self.spent += length
        if self.spent > self.budget:
            raise VideoHeaderError("video_header_too_large", f"the header needs more than {self.budget} bytes read")

    def upto(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset``: fewer where the file ends (a header's look-ahead)."""
        return self.bytes(offset, max(0, min(length, self.size - offset)), "a header")
