"""Dynamic-resolution images, per image and per stage: our path against its floor and against
transformers' PIL-backend processors, one core, CPU time, same images, same run.

For each family (Qwen2-VL native resolution; LLaVA-NeXT v1.6 anyres; LLaVA-OneVision anyres_max_9)
and each image (scikit-image and matplotlib photos as shipped; the same photo resized to typical
camera / screen sizes and saved as JPEG quality 90), the stages of our path:

- header: ``tokens_from_header(bytes, processor)``: the size from the header, the family's arithmetic;
  floor: PIL's ``Image.open(bytes).size`` (no format hint);
- decode: ``decode_image(bytes)`` (pixel and time budgets, RGB);
  floor: ``Image.open(bytes).load()`` (+ ``convert("RGB")`` for a file that is not RGB);
- worker: ``processor.to_uint8(rgb)``: the stored uint8 parts (resize, layout);
  floor: the same PIL resize(s) to the same size(s) (Qwen: one; anyres: the base and the grid), nothing else;
- reader: ``processor.model_inputs([stored])``: normalise + patchify (Qwen) / pad + tile (anyres);
  floor: a numpy normalise of as many values as the model inputs hold (a 256-entry float32 lookup
  table per channel, ``np.take`` into a float32 buffer: one byte read and four written per value);

and the baseline users have: transformers' ``Qwen2VLImageProcessorPil`` /
``LlavaNextImageProcessorPil`` / ``LlavaOnevisionImageProcessorPil`` called on the decoded image,
against our worker + reader halves (the same work: PIL image in, model inputs out). Our model inputs
are checked equal to transformers' on every image (bit for bit) before anything is timed.

Each figure is the best of a few repeats of ``time.process_time`` (CPU seconds of this process,
pinned to one core where the OS allows): the cost on one core whatever else loads the machine.

Usage: python benchmarks/bench_dynamic_images.py [--sizes 640x480 1024x768 1920x1080 4000x3000] [--min_seconds 0.3]
"""

from __future__ import annotations

import argparse
import importlib.resources
import io
import os
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neva_pack.families import resolve_encoder  # noqa: E402
from neva_pack.families import decode_image, dynamic_processor, tokens_from_header  # noqa: E402

SKIMAGE = importlib.resources.files("skimage") / "data"
PHOTOS = {
    "grace_hopper.jpg": importlib.resources.files("matplotlib") / "mpl-data" / "sample_data" / "grace_hopper.jpg",
    **{name: SKIMAGE / name for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "hubble_deep_field.jpg", "retina.jpg")},
}
FAMILIES = {
    "Qwen2-VL": "Qwen/Qwen2-VL-7B-Instruct",
    "LLaVA-NeXT": "llava-hf/llava-v1.6-vicuna-7b-hf",
    "OneVision": "llava-hf/llava-onevision-qwen2-7b-ov-hf",
}
STAGES = ("header", "decode", "worker", "reader")


def images(sizes: list[tuple[int, int]]) -> dict[str, bytes]:
    """The shipped photos' bytes, then one photo (retina.jpg, 1411 x 1411, detailed) resized to each size as a JPEG."""
    found = {name: path.read_bytes() for name, path in PHOTOS.items()}
    photo = Image.open(PHOTOS["retina.jpg"]).convert("RGB")
    for width, height in sizes:
        out = io.BytesIO()
        photo.resize((width, height), Image.Resampling.BICUBIC).save(out, format="JPEG", quality=90)
        found[f"{width}x{height}.jpg"] = out.getvalue()
    return found


def cpu_seconds(run, min_seconds: float, most: int = 50) -> float:
    """Best of repeated calls of ``run()``, in CPU seconds of this process: at least 3 calls, more while
    the calls together take under ``min_seconds``."""
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or (spent < min_seconds and calls < most):
        start = time.process_time()
        run()
        took = time.process_time() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def transformers_processor(encoder):
    from transformers.models.llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    cls = {"qwen2_vl": Qwen2VLImageProcessorPil, "llava_next": LlavaNextImageProcessorPil,
           "llava_onevision": LlavaOnevisionImageProcessorPil}[encoder.processor]  # fmt: skip
    skip = ("image_processor_type", "processor_class", "aspect_ratio_setting")
    return cls(**{k: v for k, v in encoder.preprocessor_config.items() if k not in skip})


def floor_decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def floor_resizes(processor, image: Image.Image):
    """The PIL resize(s) our worker half does, to the same sizes, nothing else."""
    width, height = image.size
    resample = processor.settings.resample
    if processor.family == "native":
        resized_height, resized_width = processor.resized_size(width, height)
        return lambda: image.resize((resized_width, resized_height), resample=resample)
    tile = processor.settings.tile
    _, grid_part = processor.to_uint8(image).parts
    grid_size = (grid_part.shape[2], grid_part.shape[1])
    return lambda: (image.resize((tile, tile), resample=resample), image.resize(grid_size, resample=resample))


def floor_normalise(processor, values: int):
    """A numpy lookup-table normalise of ``values`` values, channel-planar, into a fresh float32 buffer."""
    lut = processor.normalisation.lut()
    per_channel = -(-values // 3)
    pixels = np.random.default_rng(0).integers(0, 256, (3, per_channel), dtype=np.uint8)

    def run():
        out = np.empty((3, per_channel), dtype=np.float32)
        for c in range(3):
            np.take(lut[c], pixels[c], out=out[c])
        return out

    return run


def measure(processor, reference, name: str, data: bytes, min_seconds: float) -> dict[str, tuple[float, float]] | None:
    """{stage: (ours, floor)} in CPU seconds, plus "transformers": (theirs, ours worker + reader); None
    for an image the family refuses (Qwen: aspect ratio over 200)."""
    rgb = decode_image(data, name)
    try:
        stored = processor.to_uint8(rgb)
    except ValueError:
        return None
    got = processor.model_inputs([stored])
    expected = reference(images=rgb, return_tensors="np")
    for key, value in got.items():
        if not np.array_equal(value, expected[key]):
            raise AssertionError(f"{name}: {key} differs from transformers'")
    values = got["pixel_values"].size
    def t(run) -> float:
        return cpu_seconds(run, min_seconds)

    figures = {
        "header": (t(lambda: tokens_from_header(data, processor)), t(lambda: Image.open(io.BytesIO(data)).size)),
        "decode": (t(lambda: decode_image(data, name)), t(lambda: floor_decode(data))),
        "worker": (t(lambda: processor.to_uint8(rgb)), t(floor_resizes(processor, rgb))),
        "reader": (t(lambda: processor.model_inputs([stored])), t(floor_normalise(processor, values))),
    }
    ours = figures["worker"][0] + figures["reader"][0]
    figures["transformers"] = (cpu_seconds(lambda: reference(images=rgb, return_tensors="np"), min_seconds, most=5), ours)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["640x480", "1024x768", "1920x1080", "4000x3000"])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--min_seconds", type=float, default=0.3, help="repeat a stage while its calls take less")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    files = images([tuple(int(v) for v in size.split("x")) for size in args.sizes])
    print("ms of CPU per image on one core; x = ours / floor; tf/ours = transformers' processor / our worker + reader")
    totals = {}
    for family in args.families:
        encoder = resolve_encoder(FAMILIES[family])
        processor, reference = dynamic_processor(encoder), transformers_processor(encoder)
        print(f"\n{family} ({encoder.name})")
        print(f"{'image':24} {'size':>10} {'tokens':>6}" + "".join(f" {stage:>17}" for stage in STAGES) + f" {'tf ms':>8} {'tf/ours':>7}")
        sums = totals.setdefault(family, {key: [0.0, 0.0] for key in (*STAGES, "transformers")})
        for name, data in files.items():
            figures = measure(processor, reference, name, data, args.min_seconds)
            if figures is None:
                continue
            width, height = Image.open(io.BytesIO(data)).size
            cells = "".join(f" {ours * 1e3:8.3f} {ours / floor:6.2f}x  " for ours, floor in (figures[s] for s in STAGES))
            theirs, ours = figures["transformers"]
            tokens = tokens_from_header(data, processor)
            print(f"{name:24} {f'{width}x{height}':>10} {tokens:6d}{cells} {theirs * 1e3:8.1f} {theirs / ours:6.1f}x")
            for key, (a, b) in figures.items():
                sums[key][0] += a
                sums[key][1] += b
        ratios = "  ".join(f"{stage} {sums[stage][0] / sums[stage][1]:.2f}x" for stage in STAGES)
        whole_ours = sum(sums[stage][0] for stage in STAGES[1:])
        whole_floor = sum(sums[stage][1] for stage in STAGES[1:])
        print(f"all images, summed: ours/floor {ratios}; decode + worker + reader {whole_ours / whole_floor:.2f}x; "
              f"transformers / ours (worker + reader) {sums['transformers'][0] / sums['transformers'][1]:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
