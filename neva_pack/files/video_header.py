"""A video clip's frame count, frame rate, duration, size and rotation from its container header
alone (MP4/MOV ``moov``, Matroska/WebM elements): tens of microseconds where opening the file with a
decoder library costs tens of milliseconds (it probes by decoding).

The numbers equal what PyAV reports for the same file (``stream.frames``, ``float(stream.average_rate)``,
the stream's duration), which is what the reference video loaders sample frame indices from, so a
plan made from headers is the plan a decode would make. The file is untrusted: every size is checked
against what holds it, nesting and element counts are bounded, the bytes read are budgeted, and
anything wrong is one ``VideoHeaderError`` with a reason slug (``VIDEO_HEADER_REASONS``).

Only the byte ranges a header needs are read (``read_video_header_file``): an MP4's top-level box
headers, then its ``moov`` (wherever it is: often after the media); a Matroska file's element
headers. The media itself is never read.

Where the header and a decode disagree, and what to do about it:

- An MP4 edit list can leave frames out (a trimmed start): ``frame_count`` (FFmpeg's ``nb_frames``,
  what loaders sample indices from) then exceeds ``presented_frames`` (what the decoder yields), and
  ``VideoHeader.frames_disagree`` is True. A caller that decodes by those indices must skip such a clip
  (or plan from ``presented_frames``); the header says so before anything is decoded.
- Matroska declares no frame count (PyAV's ``stream.frames`` is 0): ``frame_count`` is the number of
  frames in the track's blocks, i.e. the decoded count (a few microseconds per frame: a minute at
  30 fps costs a few milliseconds), or with ``count_frames=False`` round(Duration / DefaultDuration),
  read in microseconds, exact for constant-rate tracks. PyAV's frame rate for a track without
  DefaultDuration comes from decoding its first frames; here it is frames over the segment duration.
- Fragmented MP4 (frames declared in ``moof`` boxes through the file) is ``video_unsupported``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO

from neva_pack.files.video_common import (
    MAX_VIDEO_FRAMES,
    MAX_VIDEO_HEADER_BYTES,
    MAX_VIDEO_PIXELS,
    VIDEO_HEADER_REASONS,
    ByteSource,
    VideoHeader,
    VideoHeaderError,
)
from neva_pack.files.video_matroska import EBML_MAGIC, read_matroska_header
from neva_pack.files.video_mp4 import MP4_BRANDS, read_mp4_header

__all__ = [
    "MAX_VIDEO_FRAMES",
    "MAX_VIDEO_HEADER_BYTES",
    "MAX_VIDEO_PIXELS",
    "VIDEO_HEADER_REASONS",
    "VideoHeader",
    "VideoHeaderError",
    "read_video_header",
    "read_video_header_at",
    "read_video_header_file",
]


def read_video_header(data: bytes, *, max_frames: int = MAX_VIDEO_FRAMES, max_pixels: int = MAX_VIDEO_PIXELS,
                      max_header_bytes: int = MAX_VIDEO_HEADER_BYTES, count_frames: bool = True) -> VideoHeader:
    """The header of a clip held in memory (the whole file's bytes)."""
    view = memoryview(data)
    return read_video_header_at(lambda offset, size: bytes(view[offset:offset + size]), len(data),
                                max_frames=max_frames, max_pixels=max_pixels, max_header_bytes=max_header_bytes,
                                count_frames=count_frames)


def read_video_header_file(file: BinaryIO, *, max_frames: int = MAX_VIDEO_FRAMES, max_pixels: int = MAX_VIDEO_PIXELS,
                           max_header_bytes: int = MAX_VIDEO_HEADER_BYTES, count_frames: bool = True) -> VideoHeader:
    """The header of a clip in a seekable binary file (an open regular file, a tar member's
    ``extractfile``), reading only the ranges the header needs: never the media. A file with a
    descriptor is read with ``os.pread`` on it (so its ``fileno()`` must be the clip itself, not an
    archive holding it: pass such a member as ``read_video_header_at`` with its own reader)."""
    size = file.seek(0, os.SEEK_END)
    try:
        descriptor = file.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError: a file in memory, a tar member
        descriptor = None

    def read(offset: int, length: int) -> bytes:
        if descriptor is not None:
            return os.pread(descriptor, length, offset)  # one system call, no seek, no buffer to fill
        file.seek(offset)
        return file.read(length)

    return read_video_header_at(read, size, max_frames=max_frames, max_pixels=max_pixels,
                                max_header_bytes=max_header_bytes, count_frames=count_frames)


def read_video_header_at(read: Callable[[int, int], bytes], size: int, *, max_frames: int = MAX_VIDEO_FRAMES,
                         max_pixels: int = MAX_VIDEO_PIXELS, max_header_bytes: int = MAX_VIDEO_HEADER_BYTES,
                         count_frames: bool = True) -> VideoHeader:
    """The header of a clip of ``size`` bytes that ``read(offset, length)`` returns ranges of (fewer
    bytes only at the end): how a caller with its own storage (a tar, an object store) plans a clip.

    ``max_frames`` and ``max_pixels`` bound what the clip may declare (``video_too_many_frames``,
    ``video_too_large``); ``max_header_bytes`` bounds the bytes read, and with it the work done.
    ``count_frames`` False lets a Matroska clip's frame count be estimated from its durations instead
    of counted from its blocks (MP4 declares its count: nothing changes for it)."""
    if size == 0:
        raise VideoHeaderError("video_empty", "a video file of 0 bytes")
    source = ByteSource(read, size, budget=max_header_bytes)
    head = source.upto(0, 8)
    if head.startswith(EBML_MAGIC):
        # an element per frame and a few per cluster: the frame budget bounds the walk
        return read_matroska_header(source, max_frames=max_frames, max_pixels=max_pixels,
                                    max_elements=4 * max_frames + 4096, count_frames=count_frames)
    if head[4:8] in MP4_BRANDS:
        return read_mp4_header(source, max_frames=max_frames, max_pixels=max_pixels)
    raise VideoHeaderError("video_unknown_format", f"a file starting {head.hex()} is neither MP4/MOV nor Matroska/WebM")
