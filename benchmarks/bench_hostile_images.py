#!/usr/bin/env python
"""What each class of hostile image costs to decode (``decode_image``) and to read the header of
(``header_size``, the dynamic families' planning), against the budgets: the pixel budget
(--max_image_pixels, 36,000,000) and the decode-time budget (--max_image_decode_seconds, 5 s of CPU).

    python benchmarks/bench_hostile_images.py [--classes NAME ...] [--seconds 5]

Each class is one file built here: a plugin that decodes inside ``Image.open`` (ICO's largest entry),
one that allocates its canvas there (WebP), multi-frame files (GIF, APNG, multi-page TIFF), embedded
previews (an MPO's second frame, a JPEG's EXIF thumbnail), a decoder in one call (JPEG-in-TIFF, a
Deflate TIFF), a decoder in Python (RLE BMP), a scan bomb (progressive JPEG), a zlib bomb (PNG) and
formats not vetted (PSD, ICNS, EPS). For each: the outcome (the size decoded, or the skip), the CPU
seconds of each path (measured in this process: the CPU clock of the thread, as the budget's), and
whether it stayed within the budget (the budget, plus the one decoder call that may run past it: a
chunk of DECODE_CHUNK bytes). Before the vetted plugins, the ICO took 1.7 s and 430 MB inside
``Image.open`` with any budget. Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import struct
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_hostile import progressive_jpeg_with_scans  # noqa: E402 (the scan bomb the run benchmark measures)


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def ico_holding_png(side: int = 12_000) -> bytes:
    """An ICO whose one entry (its directory says 256 x 256) is a PNG of side x side: PIL's ICO
    plugin decodes the largest entry inside ``Image.open``."""
    png = _save(Image.new("RGB", (side, side), (30, 90, 200)), "PNG")
    directory = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 22)
    return directory + png


def webp_declaring(width: int = 12_000, height: int = 12_000) -> bytes:
    """A WebP whose VP8X header declares a width x height canvas (its one frame is 16 x 16): PIL's
    plugin allocates the canvas inside ``Image.open``."""
    simple = _save(Image.new("RGB", (16, 16), (1, 2, 3)), "WEBP", lossless=True)
    frame = simple[12:]  # its VP8L chunk
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + vp8x + frame
    return b"RIFF" + struct.pack("<I", len(body)) + body


def animated_gif(side: int = 2_000, frames: int = 200) -> bytes:
    """A GIF of many full frames: only its first is decoded."""
    images = [Image.new("P", (side, side), k % 256) for k in range(frames)]
    return _save(images[0], "GIF", save_all=True, append_images=images[1:])


def apng(side: int = 2_000, frames: int = 100) -> bytes:
    images = [Image.new("RGB", (side, side), (k, 0, 0)) for k in range(frames)]
    return _save(images[0], "PNG", save_all=True, append_images=images[1:])


def mpo_with_large_second_frame(side: int = 8_000) -> bytes:
    """An MPO (a camera's JPEG with further frames) whose first frame is 640 x 480 and whose second
    is side x side: the second is never decoded."""
    return _save(_noise(640, 480), "MPO", save_all=True, append_images=[Image.new("RGB", (side, side), (9, 9, 9))])


def jpeg_with_exif_thumbnail() -> bytes:
    """A 640 x 480 JPEG whose EXIF holds a 60 KB thumbnail (a JPEG of its own): never decoded."""
    thumbnail = _save(_noise(160, 120, 1), "JPEG", quality=100)
    exif = Image.Exif()
    exif[0x010F] = "camera"
    raw = exif.tobytes() + thumbnail  # the thumbnail's bytes ride in the APP1 segment
    return _save(_noise(640, 480), "JPEG", exif=raw[:65_000])


def multipage_tiff(pages: int = 1_000) -> bytes:
    images = [Image.new("RGB", (64, 64), (k % 256, 0, 0)) for k in range(pages)]
    return _save(images[0], "TIFF", save_all=True, append_images=images[1:])


def jpeg_in_tiff(side: int = 2_000) -> bytes:
    """A TIFF compressed with JPEG: libtiff decodes it in one call no clock can stop."""
    return _save(_noise(side, side), "TIFF", compression="jpeg")


def deflate_tiff_at_budget(width: int = 6_000, height: int = 6_000) -> bytes:
    """A TIFF of 36 megapixels (the budget), Deflate-compressed: decoded by libtiff in one call."""
    return _save(Image.new("RGB", (width, height), (40, 50, 60)), "TIFF", compression="tiff_adobe_deflate")


def rle_bmp(width: int = 6_000, height: int = 6_000) -> bytes:
    """An 8-bit RLE BMP of width x height: PIL decodes RLE in Python, a pixel run at a time."""
    rows = bytearray()
    for _ in range(height):
        left = width
        while left:
            run = min(255, left)
            rows += bytes((run, 7))
            left -= run
        rows += b"\x00\x00"  # end of line
    rows += b"\x00\x01"  # end of bitmap
    palette = b"".join(bytes((k, k, k, 0)) for k in range(256))
    offset = 14 + 40 + len(palette)
    header = b"BM" + struct.pack("<IHHI", offset + len(rows), 0, 0, offset)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(rows), 2835, 2835, 256, 0)
    return header + info + palette + bytes(rows)


def png_zlib_bomb(width: int = 6_000, height: int = 6_000) -> bytes:
    """A PNG of 36 megapixels of one colour: a few hundred KB that inflate to 108 MB."""
    return _save(Image.new("RGB", (width, height), (200, 10, 10)), "PNG", optimize=True)


def psd_file() -> bytes:
    """A minimal PSD (one channel, 8 x 8, raw), a format not vetted."""
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 1, 8, 8, 8, 1)
    return header + struct.pack(">I", 0) + struct.pack(">I", 0) + struct.pack(">I", 0) + struct.pack(">H", 0) + bytes(64)


def icns_file() -> bytes:
    return _save(Image.new("RGB", (256, 256), (5, 5, 5)), "ICNS")


def eps_file() -> bytes:
    """An EPS: PIL would run Ghostscript, a process of its own, to decode it."""
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nshowpage\n"


CLASSES = {
    "decodes inside open: ICO holding a 144-megapixel PNG": ico_holding_png,
    "allocates inside open: WebP declaring a 144-megapixel canvas": webp_declaring,
    "multi-frame: GIF of 200 frames of 4 megapixels": animated_gif,
    "multi-frame: APNG of 100 frames of 4 megapixels": apng,
    "multi-frame: TIFF of 1,000 pages": multipage_tiff,
    "embedded preview: MPO whose second frame is 64 megapixels": mpo_with_large_second_frame,
    "embedded preview: JPEG with an EXIF thumbnail": jpeg_with_exif_thumbnail,
    "one decoder call: JPEG-in-TIFF": jpeg_in_tiff,
    "one decoder call: Deflate TIFF at the pixel budget": deflate_tiff_at_budget,
    "decoder in Python: RLE BMP at the pixel budget": rle_bmp,
    "scan bomb: progressive JPEG of 1,000 scans": lambda: progressive_jpeg_with_scans(4_000, 4_000, 1_000),
    "zlib bomb: PNG at the pixel budget": png_zlib_bomb,
    "not vetted: PSD": psd_file,
    "not vetted: ICNS": icns_file,
    "not vetted: EPS (Ghostscript)": eps_file,
}
"""Class -> a hostile file of it (the tests build the same files: tests/families/test_hostile_images.py)."""


def measure(make, seconds: float) -> dict:
    from neva_pack.families import decode_image, header_size
    from neva_pack.records import RecordError

    data = make()
    row = {"bytes": len(data)}
    for path, run in (("decode", lambda: decode_image(data, "x", max_seconds=seconds).size), ("header", lambda: header_size(data, "x"))):
        start = time.thread_time()
        try:
            outcome = "x".join(map(str, run()))
        except RecordError as skip:
            outcome = skip.reason
        row[path] = outcome
        row[f"{path}_cpu"] = time.thread_time() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", nargs="*", default=list(CLASSES), help="substrings of class names")
    parser.add_argument("--seconds", type=float, default=5.0, help="the decode-time budget (CPU seconds)")
    args = parser.parse_args()
    slack = 0.5  # one decoder call past the deadline: a chunk of the slowest file is well under it
    print(f"{'class':62} {'bytes':>11} {'decode':>16} {'cpu s':>6} {'header':>16} {'cpu s':>6}  within {args.seconds:g} s")
    for name, make in CLASSES.items():
        if not any(wanted in name for wanted in args.classes):
            continue
        row = measure(make, args.seconds)
        within = row["decode_cpu"] <= args.seconds + slack and row["header_cpu"] <= args.seconds + slack
        print(f"{name:62} {row['bytes']:>11,} {row['decode']:>16} {row['decode_cpu']:>6.2f} {row['header']:>16} "
              f"{row['header_cpu']:>6.2f}  {'yes' if within else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main()
