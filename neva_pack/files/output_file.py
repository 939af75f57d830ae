"""An output file written front to back, once: what every writer of ours streams its bytes into.

Each byte is written or skipped (a hole, which reads as zeros and takes no disk block) exactly
once, in order, so the file's xxh3-128 checksum is computed as it is written and publish never
reads the file back. A large file is also streamed to disk past the page cache (write_behind).
A writer resumed from a checkpoint continues the file cut back to the checkpoint's size, its
checksum fed those bytes first::

    OutputFile(path)                  a new file
    OutputFile(path, resume_at=n)     the file cut back to n bytes, written on from there
    .write(data)  .skip(size)         bytes, or a hole of ``size`` zeros
    .sync()                           durable up to .position (a checkpoint, a publish)
    .checksum()                       store.file_checksum of what was written
"""

from __future__ import annotations

import os
from pathlib import Path

from neva_pack.files.write_behind import WriteBehind
from neva_pack.files.checksums import digest_of_first_bytes, hash_zeros


class OutputFile:
    def __init__(
        self, path: Path, *, resume_at: int | None = None, buffered: bool = True, write_behind: bool = False,
        checksum: bool = True,
    ):  # fmt: skip
        """``buffered=False``: every write goes to the kernel at once (large writes gain nothing
        from a buffer); ``write_behind``: streamed to disk past the page cache; ``checksum``: hashed
        as written. A file shorter than ``resume_at`` raises ValueError."""
        self.path = Path(path)
        buffering = -1 if buffered else 0
        if resume_at is None:
            self.file = open(self.path, "wb", buffering=buffering)
            self.position = 0
        else:
            if self.path.stat().st_size < resume_at:
                raise ValueError(f"{self.path}: shorter than its checkpoint ({resume_at} bytes)")
            self.file = open(self.path, "r+b", buffering=buffering)
            self.file.truncate(resume_at)
            self.file.seek(resume_at)
            self.position = int(resume_at)
        self._hole = False  # the file ends with a skipped range not yet materialised by a truncate
        self._behind = WriteBehind(self.file.fileno(), self.position) if write_behind else None
        self._digest = digest_of_first_bytes(self.path, self.position) if checksum else None

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return  # nothing: a hole before it is still the file's end
        written = 0
        while written < len(view):  # an unbuffered write may take part of the data
            written += self.file.write(view[written:])
        self.position += len(view)
        self._hole = False
        if self._behind is not None:
            self._behind.advance(self.position)
        if self._digest is not None:
            self._digest.update(view)

    def skip(self, size: int) -> None:
        """``size`` zero bytes, left as a hole: nothing written, nothing stored on disk."""
        if size:
            self.position += size
            self.file.seek(self.position)
            self._hole = True
            if self._behind is not None:
                self._behind.skip(self.position)
            if self._digest is not None:
                hash_zeros(self._digest, size)

    def flush(self) -> None:
        """Write out what is buffered and materialise a trailing hole: the file's size is ``position``."""
        self.file.flush()
        if self._hole:
            self.file.truncate(self.position)
            self._hole = False

    def sync(self) -> None:
        """The bytes written so far made durable."""
        self.flush()
        os.fsync(self.file.fileno())

    def fileno(self) -> int:
        return self.file.fileno()

    def tell(self) -> int:
        return self.position

    def checksum(self) -> str:
        """xxh3-128 hex digest of the file (one created with ``checksum=True``): store.file_checksum's value."""
        return self._digest.hexdigest()

    def close(self, sync: bool = True) -> None:
        """Close the file, durable first when ``sync``."""
        if sync:
            self.sync()
        else:
            self.flush()
        self.file.close()

    def abandon(self) -> None:
        """Close the file as it is (a failed run: nothing more is written)."""
        self.file.close()
