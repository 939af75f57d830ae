"""Token counts from image headers vs decode + resize, images/s on one core, same files, same run.

A few hundred JPEG and PNG files are made in a temporary directory from the image zoo
(scikit-image and matplotlib sample photos, public domain / CC0) at varied sizes (from thumbnails
to 12 megapixels). For each dynamic-resolution family (Qwen2-VL native, LLaVA-NeXT anyres):

- header: ``tokens_from_header(data, processor)`` on the file's bytes in memory (what a worker holds
  once ``ImageSource`` has read a file or a tar member): PIL reads the size from the header, the
  family's arithmetic gives the count; no pixel is decoded. Also from the path (the file opened
  and its header read), which adds the filesystem's cost;
- decode: ``decode_image`` of the file's bytes + the family's ``to_uint8`` (resize), what a worker
  does per image; its count is checked equal to the header's.

The process is pinned to one core when the OS allows it, and timed in CPU seconds (per core). Goal: >= 20,000 images/s per core for
counting from headers.

Usage: python benchmarks/bench_image_tokens.py [--files 300] [--decode_files 40]
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neva_pack.families import resolve_encoder  # noqa: E402
from neva_pack.families import decode_image, dynamic_processor, tokens_from_header  # noqa: E402

SOURCES = [
    importlib.resources.files("matplotlib") / "mpl-data" / "sample_data" / "grace_hopper.jpg",
    *(importlib.resources.files("skimage") / "data" / name
      for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "hubble_deep_field.jpg", "retina.jpg")),
]  # fmt: skip
ENCODERS = ("Qwen/Qwen2-VL-7B-Instruct", "llava-hf/llava-v1.6-vicuna-7b-hf")


def make_files(directory: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` files, JPEG and PNG alternately, each a zoo photo resized to a random size."""
    rng = np.random.default_rng(seed)
    photos = [Image.open(source).convert("RGB") for source in SOURCES]
    files = []
    for k in range(count):
        megapixels = float(np.exp(rng.uniform(np.log(0.01), np.log(12))))
        aspect = float(np.exp(rng.uniform(np.log(0.4), np.log(2.5))))
        width = max(1, int(np.sqrt(megapixels * 1e6 * aspect)))
        height = max(1, int(megapixels * 1e6 / width))
        image = photos[k % len(photos)].resize((width, height), Image.Resampling.BILINEAR)
        path = directory / (f"{k:04d}.jpg" if k % 2 == 0 else f"{k:04d}.png")
        image.save(path, quality=90) if k % 2 == 0 else image.save(path, compress_level=1)
        files.append(path)
    return files


def on_one_core() -> None:
    """This process pinned to one core (where the system allows it): every figure is one core's."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def mean_pixels(files: list[Path]) -> float:
    """The files' mean pixels, from their headers."""
    return sum(width * height for width, height in (Image.open(f).size for f in files)) / len(files)


def rate(run, items: list, repeat: int) -> float:
    """Best of ``repeat`` passes over ``items``, in items per second of this process's CPU time: the
    rate of one core, even on a machine whose cores other processes share."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for item in items:
            run(item)
        best = min(best, time.process_time() - start)
    return len(items) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--decode_files", type=int, default=20, help="files decoded + resized (the slow side)")
    args = parser.parse_args()
    on_one_core()
    with tempfile.TemporaryDirectory() as temporary:
        files = make_files(Path(temporary), args.files)
        pixels = mean_pixels(files)
        print(f"{len(files)} files (JPEG and PNG), mean {pixels / 1e6:.2f} megapixels; one core")
        for name in ENCODERS:
            processor = dynamic_processor(resolve_encoder(name))
            contents = [path.read_bytes() for path in files]
            header = rate(lambda data: tokens_from_header(data, processor), contents, repeat=5)
            from_path = rate(lambda path: tokens_from_header(path, processor), files, repeat=3)
            sample = files[: args.decode_files]

            def decode(path: Path) -> None:
                stored = processor.to_uint8(decode_image(path.read_bytes(), path.name))
                assert stored.tokens == tokens_from_header(path, processor)

            decoded = rate(decode, sample, repeat=1)
            print(f"{name}: header {header:,.0f} images/s (from the path {from_path:,.0f}/s); "
                  f"decode + resize {decoded:,.1f} images/s; "
                  f"ratio {header / decoded:,.0f}x; goal 20,000/s {'met' if header >= 20_000 else 'NOT met'}")  # fmt: skip


if __name__ == "__main__":
    main()
