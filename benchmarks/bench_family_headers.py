"""The newer families in one run on one core: planning from headers beside the whole-file read, and the
reader's model inputs beside transformers' processor, same files, CPU time.

The files are bench_image_tokens.py's (zoo photos, public domain / CC0, resized to 0.01..12 megapixels,
JPEG and PNG alternately). For each family, with its shipped settings (Qwen3-VL under both references,
``--image_reference transformers`` and ``qwen_vl_utils``; Gemma 4 at the default budget of 280; InternVL
3.5 under ``transformers`` and ``internvl``):

- header: ``tokens_from_header`` on the file's bytes in memory, and from its path (the file opened, its
  header read): the size from PIL, the family's arithmetic; nothing decoded. Goal: >= 20,000 images/s;
- whole file: ``Path.read_bytes`` of every file, measured once in the same run (what any planner that
  looks at the file pays at least; decoding it costs a thousand times more);
- reader: ``model_inputs`` of the stored uint8 parts (what ``PackedSeqDataset`` does per image at read
  time), and worker + reader (``to_uint8`` + ``model_inputs``: PIL image in, model inputs out), beside
  transformers' PIL processor of the same settings on the same decoded images (``Qwen2VLImageProcessorPil``,
  ``Gemma4ImageProcessorPil``, ``GotOcr2ImageProcessorPil`` with ``crop_to_patches``), checked bit-identical
  first. For qwen_vl_utils the processor is given the image qwen-vl-utils resized, with ``do_resize=False``.

Usage: python benchmarks/bench_family_headers.py [--files 300] [--decode_files 12]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_image_tokens import make_files, mean_pixels, on_one_core, rate  # noqa: E402
from neva_pack.families import decode_image, dynamic_processor, resolve_encoder, tokens_from_header  # noqa: E402

CASES = (  # (label, encoder, family options)
    ("Qwen3-VL, transformers", "Qwen/Qwen3-VL-8B-Instruct", {}),
    ("Qwen3-VL, qwen_vl_utils", "Qwen/Qwen3-VL-8B-Instruct", {"arithmetic": "qwen_vl_utils"}),
    ("Gemma 4 E4B, 280", "google/gemma-4-E4B-it", {}),
    ("InternVL 3.5, transformers", "OpenGVLab/InternVL3_5-8B-HF", {}),
    ("InternVL 3.5, internvl", "OpenGVLab/InternVL3_5-8B-HF", {"arithmetic": "internvl"}),
)


def reference(encoder_name: str, options: dict):
    """transformers' PIL processor of the encoder's settings -> a function of a PIL image giving its model
    inputs (numpy), as the family's ``model_inputs`` keys them."""
    encoder = resolve_encoder(encoder_name)
    settings = {k: v for k, v in encoder.preprocessor_config.items() if k not in ("image_processor_type", "processor_class")}
    if encoder.family == "native":
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        processor = Qwen2VLImageProcessorPil(**settings)
        resize = options.get("arithmetic") == "qwen_vl_utils"
        return lambda image: processor(images=image, do_resize=not resize, return_tensors="np")
    if encoder.family == "gemma4":
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        processor = Gemma4ImageProcessorPil(**settings)
        return lambda image: processor(images=image, return_tensors="np")
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    processor = GotOcr2ImageProcessorPil(**settings)
    return lambda image: processor(images=image, crop_to_patches=True, return_tensors="np")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--decode_files", type=int, default=12, help="files decoded for the reader / processor comparison")
    args = parser.parse_args()
    on_one_core()
    with tempfile.TemporaryDirectory() as temporary:
        files = make_files(Path(temporary), args.files)
        pixels = mean_pixels(files)
        contents = [path.read_bytes() for path in files]
        whole = rate(lambda path: path.read_bytes(), files, repeat=3)
        rgb = [decode_image(data, path.name) for data, path in zip(contents[: args.decode_files], files)]
        print(f"{len(files)} files (JPEG and PNG), mean {pixels / 1e6:.2f} megapixels; one core, CPU time")
        print(f"whole-file read (Path.read_bytes): {whole:,.0f} images/s\n")
        print(f"{'family':28s} {'header/s':>10s} {'from path/s':>12s} {'x read':>7s} {'reader/s':>9s} "
              f"{'worker+reader/s':>16s} {'transformers/s':>15s} {'x':>5s}")  # fmt: skip
        for label, name, options in CASES:
            family = dynamic_processor(resolve_encoder(name), **options)
            header = rate(lambda data, family=family: tokens_from_header(data, family), contents, repeat=5)
            from_path = rate(lambda path, family=family: tokens_from_header(path, family), files, repeat=3)
            theirs_of = reference(name, options)
            stored = [family.to_uint8(image) for image in rgb]
            given = [Image.fromarray(one.parts[0].transpose(1, 2, 0)) for one in stored]  # qwen-vl-utils' resized image
            inputs = given if options.get("arithmetic") == "qwen_vl_utils" else rgb
            for image, one in zip(inputs, stored):
                ours, theirs = family.model_inputs([one]), theirs_of(image)
                assert all(np.array_equal(value, np.asarray(theirs[key])) for key, value in ours.items()), (label, image.size)
            reader = rate(lambda one, family=family: family.model_inputs([one]), stored, repeat=3)
            worker_reader = rate(lambda image, family=family: family.model_inputs([family.to_uint8(image)]), rgb, repeat=1)
            transformers = rate(theirs_of, inputs, repeat=1)
            print(f"{label:28s} {header:10,.0f} {from_path:12,.0f} {from_path / whole:7.1f} {reader:9,.1f} "
                  f"{worker_reader:16,.1f} {transformers:15,.1f} {worker_reader / transformers:5.1f}")  # fmt: skip
        print("\nx read: header count from the path over the whole-file read; x: worker + reader over transformers "
              "(for qwen_vl_utils transformers is given the resized image, so it does less than the worker)")


if __name__ == "__main__":
    main()
