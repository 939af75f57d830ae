"""Streaming a large output file to disk without filling the page cache with it.

A plain buffered write of GBs (NeMo's float32 images; the image pool) leaves every page dirty in
the page cache until the kernel's dirty limit throttles the writer, and grows the cache by the
file's size. So write-back of each window starts as soon as it is written, the writer waits for the
window before it and drops that one from the cache (the file is read again only by training, long
after): less kernel CPU and a faster write (benchmarks/ measures it). Only a speed matter:
durability still comes from the writers' fsync at checkpoints and
at publish, and where the calls are missing or refused (not Linux, some network file systems)
the writer goes on without them.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

__all__ = ["PAGE", "WINDOW", "WriteBehind", "sync_file_range"]

WINDOW = 32 << 20
"""Bytes of data written back as one range; two ranges at most are in flight or dirty (a tuning
knob, read when a WriteBehind is made: any size gives the same file)."""

PAGE = mmap.PAGESIZE
"""A range ends at a page boundary."""
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start write-back of the range's dirty pages
_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on disk when it returns


@functools.cache
def sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


class WriteBehind:
    """Follows a file being written from offset ``start`` on: ``advance(end)`` after each write
    (the file is written up to ``end``), ``skip(end)`` after a hole (a seek to ``end``, nothing
    written). Once the range behind the writer holds ``window`` bytes of data, its write-back is
    started, and the range before it is waited for and dropped from the page cache.

    Holes count for nothing: a nemo output of text-only packs (32 KB of ids, then a 1.35 MB zero
    image left as a hole) is written back in a range per 32 MB of ids, not a range per 32 MB of
    file, which had the writer wait on the disk once every 23 packs."""

    def __init__(self, fd: int, start: int = 0, window: int | None = None):
        self.fd = fd
        self.window = WINDOW if window is None else window
        self.started = self.end = start
        """Start of the range not yet written back, and where the writer is."""
        self.data = 0
        """Bytes written in [started, end)."""
        self.pending: tuple[int, int] | None = None
        """(offset, length) of the range whose write-back was started last."""
        self.enabled = sync_file_range() is not None and hasattr(os, "posix_fadvise")

    def advance(self, end: int) -> None:
        self.data += end - self.end
        self.end = end
        if not self.enabled or self.data < self.window:
            return
        cut = end - end % PAGE  # a page the next write continues is not handed to the disk (it would wait for it)
        if cut <= self.started:  # a window under a page: nothing whole yet (a length of 0 would mean "to the end")
            return
        written = (self.started, cut - self.started)
        self.started, self.data = cut, end - cut
        self._call(*written, _WRITE)
        if self.pending is not None:
            self._call(*self.pending, _WAIT)
            if self.enabled:
                os.posix_fadvise(self.fd, *self.pending, os.POSIX_FADV_DONTNEED)
        self.pending = written

    def skip(self, end: int) -> None:
        self.end = end

    def _call(self, offset: int, length: int, flags: int) -> None:
        if self.enabled and sync_file_range()(self.fd, offset, length, flags) != 0:
            self.enabled = False  # refused here (e.g. a file system without it): plain writes from now on
