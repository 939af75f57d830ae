"""InternVL 3.5 planning from headers vs reading whole files, images/s on one core, same files, same run.

The files are bench_image_tokens.py's (zoo photos, public domain / CC0, resized to 0.01..12 megapixels,
JPEG and PNG alternately). For the shipped ``OpenGVLab/InternVL3_5-8B-HF`` settings:

- header: ``tokens_from_header`` on the file's bytes in memory, and from its path (the file opened, the
  header read): PIL reads the size, the family's grid arithmetic gives 256 x tiles; nothing decoded;
- whole file: ``Path.read_bytes`` of every file (what any planner that looks at the file pays at least);
- decode: the whole file read, decoded and stored as the worker does (``decode_image`` + ``to_uint8``: the
  grid resize and the thumbnail), its count checked equal to the header's;
- worker + reader against transformers: ``to_uint8`` + ``model_inputs`` (PIL image in, ``pixel_values`` out)
  beside ``GotOcr2ImageProcessorPil`` of the same settings on the same decoded images (checked bit-identical
  first), and the reader alone (``model_inputs`` of the stored parts).

Pinned to one core where the OS allows it, timed in CPU seconds. Goal: >= 20,000 images/s per core from headers.

Usage: python benchmarks/bench_internvl_headers.py [--files 300] [--decode_files 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_image_tokens import make_files, mean_pixels, on_one_core, rate  # noqa: E402
from neva_pack.families import decode_image, dynamic_processor, resolve_encoder, tokens_from_header  # noqa: E402

ENCODER = "OpenGVLab/InternVL3_5-8B-HF"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--decode_files", type=int, default=20, help="files decoded + stored (the slow side)")
    args = parser.parse_args()
    on_one_core()
    processor = dynamic_processor(resolve_encoder(ENCODER))
    with tempfile.TemporaryDirectory() as temporary:
        files = make_files(Path(temporary), args.files)
        pixels = mean_pixels(files)
        tiles = sum(tokens_from_header(f, processor) for f in files) / len(files) / processor.settings.tokens_per_tile
        print(f"{len(files)} files (JPEG and PNG), mean {pixels / 1e6:.2f} megapixels, mean {tiles:.1f} tiles; one core; {ENCODER}")
        contents = [path.read_bytes() for path in files]
        header = rate(lambda data: tokens_from_header(data, processor), contents, repeat=5)
        from_path = rate(lambda path: tokens_from_header(path, processor), files, repeat=3)
        whole = rate(lambda path: path.read_bytes(), files, repeat=3)

        def decode(path: Path) -> None:
            stored = processor.to_uint8(decode_image(path.read_bytes(), path.name))
            assert stored.tokens == tokens_from_header(path, processor)

        decoded = rate(decode, files[: args.decode_files], repeat=1)
        print(f"header (bytes in memory)   {header:>10,.0f} images/s   goal 20,000/s {'met' if header >= 20_000 else 'NOT met'}")
        print(f"header (from the path)     {from_path:>10,.0f} images/s")
        print(f"whole-file read            {whole:>10,.0f} images/s")
        print(f"whole-file read + decode + grid resize + thumbnail  {decoded:,.1f} images/s "
              f"(header from the path {from_path / decoded:,.0f}x faster)")  # fmt: skip
        rgb = [decode_image(path.read_bytes(), path.name) for path in files[: args.decode_files]]
        stored = [processor.to_uint8(image) for image in rgb]
        reference = transformers_processor()
        for image, one in zip(rgb, stored):
            expected = reference(images=image, crop_to_patches=True, return_tensors="np")["pixel_values"]
            assert np.array_equal(processor.model_inputs([one])["pixel_values"], expected)
        theirs = rate(lambda image: reference(images=image, crop_to_patches=True, return_tensors="np"), rgb, repeat=1)
        ours = rate(lambda image: processor.model_inputs([processor.to_uint8(image)]), rgb, repeat=1)
        reader = rate(lambda one: processor.model_inputs([one]), stored, repeat=3)
        print(f"PIL image -> pixel_values: ours (worker + reader) {ours:,.1f} images/s, transformers' "
              f"GotOcr2ImageProcessorPil {theirs:,.1f} images/s ({ours / theirs:.1f}x); reader alone {reader:,.1f} images/s")


def transformers_processor():
    """``GotOcr2ImageProcessorPil`` of the shipped settings (the processor transformers maps internvl to)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    settings = resolve_encoder(ENCODER).preprocessor_config
    return GotOcr2ImageProcessorPil(**{k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")})


if __name__ == "__main__":
    main()
