"""What the families whose images each have their own size share: the stored image's planar parts,
and token counts read from an image file's header (the interface itself is base.ModelFamily).

An image's token count depends on its size only, and the size is in the file's header: reading
it costs microseconds where decoding and resizing a photo costs tens to hundreds of milliseconds,
so a packing plan can be made from headers before any pixel is decoded. The decoded image is
then checked to have the size its header announced (``check_decoded_size``), so the count the
plan used is the count the sample gets.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

import numpy as np
from PIL import Image

from neva_pack.families.decode import declared_size, open_vetted, unreadable
from neva_pack.records import RecordError
from neva_pack.core import StoredImage

__all__ = ["StoredImage", "check_decoded_size", "header_size", "planar_uint8", "tokens_from_header"]


def planar_uint8(image: Image.Image) -> np.ndarray:
    """An RGB PIL image -> uint8 (3, H, W), C-contiguous: a stored image's part.

    PIL hands out each band on its own (its raw packer for "R", "G", "B"): one pass per band into
    the planar array, where ``np.asarray`` would copy the interleaved pixels and a transpose copy
    them again, strided (several times slower on a large image)."""
    width, height = image.size
    planes = np.empty((3, height, width), dtype=np.uint8)
    for plane, band in zip(planes, "RGB"):
        plane.reshape(-1)[:] = np.frombuffer(image.tobytes("raw", band), dtype=np.uint8)
    return planes


def header_size(data: bytes | str | os.PathLike | BinaryIO, name: str | None = None) -> tuple[int, int]:
    """(width, height) of an image file from its header alone (PIL's ``open`` reads no pixel data).

    ``data``: the file's bytes, its path, or a binary file object at its first byte (read only as far
    as the header goes); ``name``: the image's name in a skip's detail (default: the path, or "image bytes").
    The file's magic number picks PIL's plugin first (JPEG, PNG), which halves the cost of an open
    that would otherwise try each plugin in turn; any other file is identified by the vetted plugins
    (decode.DECODED_FORMATS; a WebP's size is read from its RIFF header, since its plugin allocates the
    canvas inside ``Image.open``). Anything they cannot identify is an ``unreadable_image`` skip, as it
    would be when decoded (naming its format when another PIL plugin knows it).
    (PIL warns, DecompressionBombWarning, of an image over ``Image.MAX_IMAGE_PIXELS``; the caller
    checks its own pixel budget on the size returned.)"""
    name = name or _name(data)
    try:
        if isinstance(data, bytes):
            return _open_size(io.BytesIO(data), data[:30], name)
        if hasattr(data, "read"):
            head = data.read(30)
            data.seek(0)
            return _open_size(data, head, name)
        return _path_size(data, name)
    except RecordError:
        raise
    except Image.DecompressionBombError as exc:
        raise RecordError("image_too_large", f"{name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- PIL's plugins raise far more than OSError (decode.py)
        raise unreadable(name, exc) from None


HEADER_READ = 4096
"""Bytes of an image's first read from its path: most headers (a PNG's, a JPEG's without a large
EXIF or ICC block) end within them, and one read of a raw descriptor is three system calls where a
buffered file's open, reads and seeks make six or more: 1.2x the images per second on this VM,
where a system call costs microseconds. A header that goes on is read from the file as before."""


def _path_size(path, name: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        head = os.read(fd, HEADER_READ)
        try:
            return _open_size(io.BytesIO(head), head[:30], name)
        except Exception:  # noqa: BLE001 -- a header past the first read (EXIF, ICC, a TIFF's IFD at its end)
            if len(head) < HEADER_READ:  # the whole file was read: its failure is the file's
                raise
            os.lseek(fd, 0, os.SEEK_SET)
            with io.BufferedReader(io.FileIO(fd, closefd=False)) as stream:
                return _open_size(stream, head[:30], name)
    finally:
        os.close(fd)


def _open_size(stream, head: bytes, name: str) -> tuple[int, int]:
    declared = declared_size(head)
    if declared is not None:  # WebP: its plugin would allocate the canvas inside Image.open
        return declared
    formats = next((names for magic, names in _MAGIC if head.startswith(magic)), None)
    if formats is not None:
        try:
            with Image.open(stream, formats=formats) as image:
                return image.size
        except Image.UnidentifiedImageError:
            stream.seek(0)  # a file whose magic lies about its kind: every vetted plugin's identification
    with open_vetted(stream, name, head) as image:
        return image.size


_MAGIC = ((b"\xff\xd8\xff", ("JPEG",)), (b"\x89PNG\r\n\x1a\n", ("PNG",)))


def tokens_from_header(data: bytes | str | os.PathLike, processor) -> int:
    """An image file's token count, from its header size (no decode)."""
    width, height = header_size(data)
    return processor.tokens_for_size(width, height)


def check_decoded_size(image: Image.Image, expected: tuple[int, int], name: str) -> None:
    """A decoded image must have the (width, height) its header gave the plan: else its token
    count, and the pack it was planned into, would be wrong. Skipped with the two sizes."""
    if tuple(image.size) != tuple(expected):
        raise RecordError(
            "unreadable_image",
            f"{name}: decoded as {image.size[0]} x {image.size[1]}, its header said {expected[0]} x {expected[1]}",
        )


def _name(data) -> str:
    if isinstance(data, bytes):
        return "image bytes"
    return "image file" if hasattr(data, "read") else os.fspath(data)
