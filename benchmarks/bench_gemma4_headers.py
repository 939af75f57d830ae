"""Gemma 4 images on one core, CPU time, same images, same run: planning from headers against reading
the whole file, and our worker + reader halves against transformers' processor.

- header: ``tokens_from_header(bytes, family)``: the size from the header and the family's arithmetic
  (the count a packing plan needs), for every soft-token budget;
- whole file: ``decode_image(bytes)``: what a plan made without headers would cost per image (decode,
  RGB), the floor of any pixel-reading path;
- ours: ``family.to_uint8(rgb)`` (the worker: resize, planar uint8) + ``family.model_inputs([stored])``
  (the reader: rescale, patchify, pad to the budget);
- transformers: ``Gemma4ImageProcessorPil`` called on the same decoded image (the same work: PIL image
  in, model inputs out). Our model inputs are checked equal to it, bit for bit, before anything is timed.

Images: scikit-image and matplotlib photos as shipped, and one photo resized to camera / screen sizes
and saved as JPEG quality 90. Each figure is the best of a few repeats of ``time.process_time``.

Usage: python benchmarks/bench_gemma4_headers.py [--min_seconds 0.3]
"""

from __future__ import annotations

import argparse
import importlib.resources
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neva_pack.families import decode_image, dynamic_processor, resolve_encoder, tokens_from_header  # noqa: E402

ENCODER = "google/gemma-4-E2B-it"
BUDGETS = (70, 140, 280, 560, 1120)
SKIMAGE = importlib.resources.files("skimage") / "data"
PHOTOS = {
    "grace_hopper.jpg": importlib.resources.files("matplotlib") / "mpl-data" / "sample_data" / "grace_hopper.jpg",
    **{name: SKIMAGE / name for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "hubble_deep_field.jpg")},
}
SIZES = ((640, 480), (1920, 1080), (4000, 3000))


def images() -> dict[str, bytes]:
    files = {name: path.read_bytes() for name, path in PHOTOS.items()}
    base = Image.open(io.BytesIO(files["astronaut.png"])).convert("RGB")
    for width, height in SIZES:
        out = io.BytesIO()
        base.resize((width, height), Image.Resampling.BICUBIC).save(out, "JPEG", quality=90)
        files[f"photo {width}x{height}.jpg"] = out.getvalue()
    return files


def per_second(work, count: int, min_seconds: float) -> float:
    """Best rate (items/s of CPU time) over a few repeats of ``work`` (doing ``count`` items) lasting at least ``min_seconds``."""
    best = float("inf")
    for _ in range(3):
        rounds, start = 0, time.process_time()
        while True:
            work()
            rounds += 1
            spent = time.process_time() - start
            if spent >= min_seconds:
                break
        best = min(best, spent / rounds)
    return count / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min_seconds", type=float, default=0.3)
    args = parser.parse_args()
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    files = images()
    blobs = list(files.values())
    print(f"{len(blobs)} images; one core, CPU time, best of 3")
    print(f"{'stage':34s} {'images/s':>12s}")
    whole = per_second(lambda: [decode_image(blob, "bench") for blob in blobs], len(blobs), args.min_seconds)
    print(f"{'whole file (decode_image)':34s} {whole:12,.0f}")
    for budget in BUDGETS:
        family = dynamic_processor(resolve_encoder(ENCODER), max_soft_tokens=budget)
        header = per_second(lambda: [tokens_from_header(blob, family) for blob in blobs], len(blobs), args.min_seconds)
        print(f"{f'header, max_soft_tokens {budget}':34s} {header:12,.0f}   ({header / whole:,.0f}x the whole-file read)")
    family = dynamic_processor(resolve_encoder(ENCODER))
    reference = Gemma4ImageProcessorPil()
    print(f"\n{'image (budget 280)':28s} {'ours ms':>9s} {'transformers ms':>16s}")
    for name, blob in files.items():
        rgb = decode_image(blob, name)
        expected = reference(images=rgb, return_tensors="np")
        got = family.model_inputs([family.to_uint8(rgb)])
        assert all(np.array_equal(got[key], np.asarray(expected[key])) for key in got), name
        ours = per_second(lambda: family.model_inputs([family.to_uint8(rgb)]), 1, args.min_seconds)
        theirs = per_second(lambda: reference(images=rgb, return_tensors="np"), 1, args.min_seconds)
        print(f"{name:28s} {1000 / ours:9.2f} {1000 / theirs:16.2f}")


if __name__ == "__main__":
    main()
