"""Checksums of output files (xxh3-128), holes of sparse files hashed as the zeros they read as.

The meta lists one for every file an output consists of (``formats.base.publish``); verify, stats
and convert compare them (``formats.checked_meta``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from neva_pack.files.untrusted import regular_output

__all__ = ["data_extents", "digest_of_first_bytes", "file_checksum", "hash_zeros"]

_READ_CHUNK = 16 << 20

_ZEROS = memoryview(bytes(1 << 20))
"""What a hole is hashed as, a MiB at a time (xxh3 has no shortcut for zeros; a buffer that stays
in the CPU cache hashes fastest)."""


def data_extents(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The [start, end) byte ranges of an open file's first ``size`` bytes that hold data; the rest
    are holes, which read as zeros (a sparse file: the nemo writer leaves zero images as holes).

    From ``lseek(SEEK_DATA / SEEK_HOLE)``; None where the OS or the filesystem cannot tell (then
    every byte must be read). A filesystem without holes reports the whole file as data.
    Moves the file's position.
    """
    if not hasattr(os, "SEEK_DATA"):
        return None
    extents: list[tuple[int, int]] = []
    position = 0
    try:
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole from position to the end
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            extents.append((start, end))
            position = end
    except OSError:  # SEEK_DATA not supported here: read everything
        return None
    return extents


def hash_zeros(digest, size: int) -> None:
    """Feed ``size`` zero bytes to ``digest``: what a hole reads as, hashed without reading it."""
    for offset in range(0, size, len(_ZEROS)):
        digest.update(_ZEROS[: min(len(_ZEROS), size - offset)])


def file_checksum(path: Path) -> str:
    """xxh3-128 of the file's bytes; its holes are hashed as the zeros they read as, without reading them."""
    import xxhash

    digest = xxhash.xxh3_128()
    view = memoryview(bytearray(_READ_CHUNK))
    with open(regular_output(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        extents = data_extents(f.fileno(), size)
        f.seek(0)
        if extents is None:
            while read := f.readinto(view):
                digest.update(view[:read])
            return digest.hexdigest()
        position = 0
        for start, end in extents + [(size, size)]:  # the last one: a hole to the end
            hash_zeros(digest, start - position)  # the hole before this extent
            f.seek(start)
            position = start
            while position < end:
                read = f.readinto(view[: min(len(view), end - position)])
                if not read:  # the file shrank while read: what was there
                    return digest.hexdigest()
                digest.update(view[:read])
                position += read
    return digest.hexdigest()


def digest_of_first_bytes(path: Path, size: int):
    """An xxh3-128 state fed the first ``size`` bytes of ``path``: a writer that continues a file
    after a checkpoint feeds it what it appends, and has the file's checksum at the end without
    reading the file again. The file must hold ``size`` bytes (ValueError otherwise)."""
    import xxhash

    digest = xxhash.xxh3_128()
    if size:
        view = memoryview(bytearray(min(_READ_CHUNK, size)))
        with open(path, "rb", buffering=0) as f:
            remaining = size
            while remaining:
                read = f.readinto(view[: min(len(view), remaining)])
                if not read:
                    raise ValueError(f"{path}: shorter than its checkpoint ({size} bytes)")
                digest.update(view[:read])
                remaining -= read
    return digest
