"""Image file bytes -> one RGB PIL image, within a pixel budget read from the header first and a
decode-time budget enforced while decoding.

Decisions (as LLaVA and NeMo): ``Image.open(f).convert("RGB")`` drops alpha (no compositing
on white), EXIF orientation is not applied, an animated image contributes its first frame.

Whatever one image's bytes do to a decoder, it is that record's skip, never the run's end: PIL's
plugins raise far more than ``OSError`` (``BLPFormatError``, ``NotImplementedError`` for some DDS
files, ``struct.error``, ``IndexError``, ...), so any exception raised while decoding is an
``unreadable_image`` naming its class. Programming errors of ours cannot hide there: the code
inside is PIL's and two small conversions.

Which decoders: only PIL's plugins vetted to decode nothing inside ``Image.open`` and to allocate
nothing there beyond the header, so that the pixel budget is checked on the header's size before any
pixel is decoded (``DECODED_FORMATS``; ``Image.open`` is given no other). An image of another format
is an ``unreadable_image`` naming its format: ICO, for one, decodes its largest entry inside
``Image.open`` (an embedded PNG of any size, past every budget), ICNS, PSD, EPS (Ghostscript, a
process of its own), DDS, BLP, JPEG 2000, ... are not vetted. WebP's plugin allocates its canvas
inside ``Image.open``, so its size is read from the RIFF header first (``declared_size``); a TIFF is
decoded only when its compression's work is bounded by its pixels (libtiff decodes a whole file in one
call, where the clock below cannot stop it: raw, PackBits, LZW and Deflate only). Only the first
frame of a multi-frame file (GIF, APNG, MPO, TIFF, WebP) is decoded; embedded previews (an EXIF
thumbnail, an MPO's other frames) are never decoded. Each class of hostile image and its cost
against the budgets: benchmarks/bench_hostile_images.py.

The time budget (``--max_image_decode_seconds``). Some files cost far more to decode than their
bytes and pixels suggest: a progressive JPEG may repeat a scan thousands of times, and every scan
walks every block of the image (tens of milliseconds each at 36 megapixels), so a 200 KB file
can take minutes. Neither a signal nor a thread can stop a C decoder mid-call (a Python signal
handler runs only once the call returns), and a process per image costs more than most decodes.
What does work: PIL's ``ImageFile.load`` feeds the decoder in a Python loop, one read of the file
object at a time, and the decoder does the work of the bytes it is given before asking for more.
So the bytes are handed over in small chunks (``DECODE_CHUNK``, which bounds the work of one
call: well under a second for the worst scan-per-byte JPEG) through a file object that checks the
clock on every read and stops the decode past the deadline. The clock is the decoding thread's
CPU time, not the wall clock, so a busy machine (other workers, other jobs) does not turn an
ordinary image into a skip; the detail names the budget, not a measured time, so the report of a
run does not depend on the machine's speed except for images near the budget.
"""

from __future__ import annotations

import io
import re
import time
import warnings

import numpy as np
from PIL import Image

from neva_pack.records import RecordError

DEFAULT_MAX_IMAGE_PIXELS = 36_000_000
"""36 megapixels per image as decoded, padded to a square (pad) or resized (square): decoding,
padding and the image processor need 12 to 15 bytes per pixel on top of the libraries a process
loads, so one image keeps a worker's memory bounded (benchmarks/bench_hostile.py measures it); a
6000 x 4000 (24-megapixel) photo passes, padded too."""


DEFAULT_MAX_IMAGE_DECODE_SECONDS = 5.0
"""CPU seconds to decode one image: an ordinary 24-megapixel photo takes a fraction of a second."""

DECODE_CHUNK = 1024
"""Bytes handed to PIL's decoder per call, so the deadline is checked often enough: one call on
a chunk of the slowest progressive JPEG (each scan of a few bytes walks the whole image) stays far
under the budget (benchmarks/bench_hostile.py)."""

ONE_PASS_DECODE_CHUNK = 16384
"""The chunk for files whose decoder goes over the image once, where a larger chunk does not loosen
the budget (a call's work is bounded by one pass over the image, whatever its bytes): PNG (a byte
inflates to at most ~1,000 bytes of rows) and a baseline JPEG whose first scan holds every
component (the decoder refuses any scan after it). Not a progressive JPEG, nor a baseline one
that announces more scans: the decoder takes every scan it is handed within one call, each
walking the whole image again (tests/families/test_fixed_crop_images.py). Sixteen times fewer calls, each a Python
read, bring an ordinary photo's decode to PIL's own cost (benchmarks/bench_dynamic_images.py)."""


class _TooSlow(Exception):
    """Raised from the file object PIL reads once the decode's CPU time is spent."""


class _DecodeClock(io.BytesIO):
    """An image's bytes as a file object that refuses to be read after a CPU-time deadline.

    Reading the thread's CPU clock is a system call, several times the cost of handing over a
    chunk; the wall clock is not, and the thread cannot spend more CPU time than the wall time
    that passes. So after each look at the CPU clock, the next one waits until enough wall time
    has passed for the deadline to be reachable: the same reads fail as if every read looked."""

    def __init__(self, data: bytes, seconds: float):
        super().__init__(data)
        self._look_at = time.perf_counter() + seconds  # the wall clock read first: never later than the CPU's
        self.deadline = time.thread_time() + seconds
        self.expired = False

    def read(self, size: int | None = -1) -> bytes:
        if time.perf_counter() >= self._look_at:
            self.check()
        return super().read(size)

    def check(self) -> None:
        now = time.perf_counter()
        left = self.deadline - time.thread_time()
        if left < 0:
            self.expired = True
            raise _TooSlow
        self._look_at = now + left


def decode_image(
    data: bytes, name: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_seconds: float = DEFAULT_MAX_IMAGE_DECODE_SECONDS,
) -> Image.Image:  # fmt: skip
    """Bytes -> RGB PIL image; anything PIL cannot decode is an ``unreadable_image`` skip, a
    decode that takes longer than ``max_seconds`` of CPU time an ``image_too_slow`` skip.

    The size is read from the header and checked against ``max_pixels`` before any pixel is
    decoded. 16-bit grayscale (mode I;16, I) is scaled to 8 bits, not clipped (which whitens it).
    """
    _allow_pixels(max_pixels)
    declared = declared_size(data[:30])
    if declared is not None and declared[0] * declared[1] > max_pixels:  # before its plugin allocates the canvas
        width, height = declared
        raise RecordError("image_too_large", too_many_pixels(name, f"{width} x {height}", width * height, max_pixels))
    clock = _DecodeClock(data, max_seconds)
    try:
        with warnings.catch_warnings():
            # our own pixel budget is checked first; what else PIL warns of in one file is no news to
            # the user: the image decodes (and is used) or fails (and is that record's skip)
            warnings.simplefilter("ignore")
            image = open_vetted(clock, name, data[:16])
            width, height = image.size
            if width * height > max_pixels:
                raise RecordError("image_too_large", too_many_pixels(name, f"{width} x {height}", width * height, max_pixels))
            image.decodermaxblock = _chunk(image, data)
            image.load()
            clock.check()  # a decoder that reads everything at once is still held to the budget, if late
            if image.mode in _WIDE_GRAY_MODES:
                image = _gray_to_8_bits(image)
            return image if image.mode == "RGB" else image.convert("RGB")  # no second copy of a large image
    except RecordError:
        raise
    except Image.DecompressionBombError as exc:  # over PIL's limit, which _allow_pixels keeps above ours
        found = re.search(r"\((\d+) pixels\)", str(exc))
        what = too_many_pixels(name, "size", int(found[1]), max_pixels) if found else f"{name}: {exc}"
        raise RecordError("image_too_large", what) from None
    except Exception as exc:  # noqa: BLE001 -- any failure of a decoder on one file is that record's skip
        if clock.expired:  # also when a decoder wrapped our _TooSlow in an error of its own
            too_slow = f"{name}: decoding took more than --max_image_decode_seconds {max_seconds:g} (CPU time)"
            raise RecordError("image_too_slow", too_slow) from None
        raise unreadable(name, exc) from None


DECODED_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")
"""The PIL plugins ``Image.open`` is given (the module's docstring): their ``_open`` reads the header
and allocates nothing of the image's size, and their decode goes through ``ImageFile.load``'s reads of
the clocked file, or is one call whose work is bounded by the header's pixels. (JPEG's plugin opens an
MPO file, a JPEG with further frames, as its own format: only the first frame is decoded.)"""

TIFF_COMPRESSIONS = ("raw", "packbits", "tiff_lzw", "tiff_adobe_deflate", "tiff_deflate")
"""TIFF compressions decoded: libtiff's work on them is one pass over the pixels. Not JPEG-in-TIFF
(a progressive scan bomb in one libtiff call), nor the others (rare, unvetted)."""


def open_vetted(stream, name: str, head: bytes) -> Image.Image:
    """``Image.open`` over the vetted plugins only (``DECODED_FORMATS``). An image of another format
    PIL knows is an ``unreadable_image`` naming the format (from its first bytes, ``head``), before
    its plugin reads further; a TIFF of a compression not vetted likewise, before a pixel is decoded."""
    Image.init()  # every plugin registered (TIFF's and WebP's are not among PIL's first five); once per process
    try:
        image = Image.open(stream, formats=DECODED_FORMATS)
    except Image.UnidentifiedImageError:
        other = format_of(head)
        if other is not None:
            raise RecordError("unreadable_image", f"{name}: {_not_decoded(other)}") from None
        raise
    compression = getattr(image, "_compression", "raw") if image.format == "TIFF" else "raw"
    if compression not in TIFF_COMPRESSIONS:
        image.close()
        raise RecordError("unreadable_image", f"{name}: a TIFF compressed with {compression}, not decoded here "
                                              f"(only {', '.join(TIFF_COMPRESSIONS)})")  # fmt: skip
    return image


def format_of(head: bytes) -> str | None:
    """The PIL format, other than the vetted ones, whose plugin accepts these first bytes (16, as
    PIL reads to choose); None when none does. Only the plugins' ``accept`` checks run: no plugin opens."""
    Image.init()
    for fmt, (_, accept) in Image.OPEN.items():
        if fmt not in DECODED_FORMATS and accept is not None:
            try:
                if accept(head[:16]):
                    return fmt
            except Exception:  # noqa: BLE001 -- a plugin's check of 16 bytes failing says only "not this one"
                continue
    return None


def _not_decoded(fmt: str) -> str:
    return f"{fmt} (by its first bytes), a format not decoded here (only {', '.join(DECODED_FORMATS)})"


def declared_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) a WebP file's RIFF header declares (its first 30 bytes: the canvas of VP8X, or
    the frame of a simple lossy or lossless file); None for anything else. PIL's WebP plugin allocates
    the canvas inside ``Image.open``, so this is what the pixel budget is checked on first."""
    if len(head) < 30 or head[:4] != b"RIFF" or head[8:12] != b"WEBP":
        return None
    chunk = head[12:16]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    return None


def _chunk(image: Image.Image, data: bytes) -> int:
    """Bytes per decoder call: larger where the decoder goes over the image once (see above)."""
    if image.format == "PNG":
        return ONE_PASS_DECODE_CHUNK
    if image.format == "JPEG" and "progressive" not in image.info and _first_scan_components(data) == image.layers:
        return ONE_PASS_DECODE_CHUNK
    return DECODE_CHUNK


def _first_scan_components(data: bytes) -> int | None:
    """Components of a JPEG file's first scan (its SOS header's count), walking the segments before
    it; None for anything unexpected."""
    at = 2
    while at + 4 < len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
        elif marker == 0xDA:
            return data[at + 4]
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # markers without a length
            at += 2
        else:
            at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def unreadable(name: str, exc: Exception) -> RecordError:
    """The skip of an image a decoder failed on, however it failed: its class and message, the
    message made deterministic."""
    return RecordError("unreadable_image", f"{name}: {exc.__class__.__name__}: {_deterministic(str(exc), name)}")


_OBJECT_REPR = re.compile(r"<[^<>]*? object at 0x[0-9a-fA-F]+>|<_io\.\w+ name=[^<>]*>")


def _deterministic(message: str, name: str) -> str:
    """An exception's message as a skip detail: one line, at most 300 characters, and no object
    address (PIL names the file object it was given: ``<_io.BytesIO object at 0x7f...>``, or a file's
    ``<_io.BufferedReader name=12>``, which would make two runs' reports differ): the image's name
    stands in for it."""
    message = " ".join(_OBJECT_REPR.sub(name, message).split())
    return message if len(message) <= 300 else message[:297] + "..."


def _allow_pixels(max_pixels: int) -> None:
    """PIL refuses an image of more than twice ``Image.MAX_IMAGE_PIXELS`` (178,956,970 by default)
    in ``Image.open``, before its size can be checked against ``--max_image_pixels``; a budget above
    that, which the user asked for, raises PIL's limit to it (never lowers it): our check from the
    header then comes first, and PIL's only refuses what is over twice the budget."""
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > 2 * Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels


_WIDE_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _gray_to_8_bits(image: Image.Image) -> Image.Image:
    """16-bit grayscale (also PIL's 32-bit mode I, which PNG's 16-bit grayscale may open as) -> L,
    keeping the top 8 of 16 bits."""
    values = np.asarray(image).astype(np.int64)
    return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), mode="L")


def too_many_pixels(name: str, what: str, pixels: int, max_pixels: int) -> str:
    return f"{name}: {what} = {pixels:,} pixels > --max_image_pixels {max_pixels:,}"

