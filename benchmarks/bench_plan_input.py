"""``neva-pack plan --data_path``: planning from text + image headers vs building the samples (decode +
resize), on one core, same records, same files, same run.

Records (LLaVA-style conversations, one or two images each) over a few hundred JPEG and PNG files made
from the image zoo at varied sizes (bench_image_tokens.make_files: thumbnails to 12 megapixels), with
Qwen2-VL's settings and template and the stand-in byte-level BPE tokenizer (tests/golden/dynamic):

- header count: ``HeaderImages.read(header_only=True)`` per image, the plan path (the file opened by
  the ImageSource, confined and within its byte budget, PIL reading as far as the header goes; the
  family's count and budgets): what planning costs per image; against it, in the same run, the same
  count reading each file whole (``HeaderImages.read`` as a build reads, to decode after), and
  ``tokens_from_header`` on the bare path (no confinement, no budget);
- plan: ``plan_input.laid_out_lengths`` in this process (read the records, tokenize, count each image
  from its header, lay out), the whole of planning, in records/s and images/s;
- build: ``SampleBuilder.build`` (the same plus decode + resize of every image), what a run costs.

Pinned to one core when the OS allows it, timed in CPU seconds. Goal: the count >= 20,000 images/s per core.

Usage: PYTHONPATH=. python benchmarks/bench_plan_input.py [--records 2000] [--files 300] [--build_records 40]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_image_tokens import make_files, on_one_core  # noqa: E402
from neva_pack.families import resolve_encoder  # noqa: E402
from neva_pack.samples import HeaderImages  # noqa: E402
from neva_pack.families import dynamic_image_run  # noqa: E402
from neva_pack.families import ImageSource, dynamic_processor, tokens_from_header  # noqa: E402
from neva_pack.pipeline import laid_out_lengths  # noqa: E402
from neva_pack.records import iter_raw_records  # noqa: E402
from neva_pack.samples import SampleBuilder, Skipped  # noqa: E402
from neva_pack.text import load_template  # noqa: E402
from neva_pack.text import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENCODER = "Qwen/Qwen2-VL-7B-Instruct"
WORDS = "the a photo of shows person dog street red blue sky building car tree water light people table".split()


def write_records(path: Path, names: list[str], count: int, seed: int = 0) -> int:
    """``count`` records of one or two images and a question and answer of 5-60 words; returns the images."""
    rng = np.random.default_rng(seed)
    records, images = [], 0
    for k in range(count):
        chosen = [names[int(i)] for i in rng.integers(0, len(names), size=1 + int(rng.random() < 0.3))]
        images += len(chosen)
        question = "".join("<image>\n" for _ in chosen) + " ".join(rng.choice(WORDS, size=int(rng.integers(5, 20))))
        answer = " ".join(rng.choice(WORDS, size=int(rng.integers(10, 60))))
        conversations = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        records.append({"id": str(k), "images": chosen, "conversations": conversations})
    path.write_text(json.dumps(records))
    return images


def cpu_seconds(run) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--build_records", type=int, default=40, help="records built with decode + resize (the slow side)")
    args = parser.parse_args()
    on_one_core()
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        (root / "images").mkdir()
        files = make_files(root / "images", args.files)
        tokenizer_dir = root / "tokenizer"
        tokenizer_dir.mkdir()
        shutil.copy(ROOT / "tests" / "golden" / "dynamic" / "tokenizer.json", tokenizer_dir / "tokenizer.json")
        (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
        data = root / "data.json"
        images = write_records(data, [f.name for f in files], args.records)
        tokenizer = load_tokenizer(tokenizer_dir)
        encoder = resolve_encoder(ENCODER)
        processor = dynamic_processor(encoder)
        source = ImageSource(root / "images")
        builder = SampleBuilder(
            tokenizer=tokenizer, template=load_template("qwen2_vl", "nemo"), image_source=source,
            preprocessor=processor, image_run=dynamic_image_run(tokenizer, encoder.family), max_seq_length=16_384,
        )  # fmt: skip
        print(f"{args.records:,} records, {images:,} images over {len(files)} files (JPEG and PNG, up to 12 MP); "
              f"{ENCODER}; one core, CPU seconds")  # fmt: skip

        headers = HeaderImages(processor, source)
        names = [[f.name] for f in files]
        laid_out_lengths(builder, data)  # warm: numba kernels, the page cache
        count = min(cpu_seconds(lambda: [headers.read(n, header_only=True) for n in names]) for _ in range(3))
        whole = min(cpu_seconds(lambda: [headers.read(n) for n in names]) for _ in range(3))
        head_only = min(cpu_seconds(lambda: [tokens_from_header(path, processor) for path in files]) for _ in range(3))
        plan = min(cpu_seconds(lambda: laid_out_lengths(builder, data)) for _ in range(3))
        built = list(iter_raw_records(data))[: args.build_records]
        build = cpu_seconds(lambda: [builder.build(raw) for raw in built])
        build_images = sum(len(s.images) for s in map(builder.build, built) if not isinstance(s, Skipped))
        count_rate, plan_rate, build_rate = len(files) / count, images / plan, build_images / build
        print(f"header count   {count_rate:>10,.0f} images/s   (plan path: open + header's bytes + count; goal 20,000/s "
              f"{'met' if count_rate >= 20_000 else 'NOT met'})")  # fmt: skip
        print(f"whole file     {len(files) / whole:>10,.0f} images/s   (the same count reading each file whole, as a build "
              f"reads it; header count / whole file {whole / count:,.1f}x)")  # fmt: skip
        print(f"header only    {len(files) / head_only:>10,.0f} images/s   (tokens_from_header on the path: the header's "
              f"bytes only; mean file {np.mean([f.stat().st_size for f in files]) / 1e6:.1f} MB)")  # fmt: skip
        print(f"plan           {args.records / plan:>10,.0f} records/s  {plan_rate:>10,.0f} images/s  (text + headers, no decode)")
        print(f"build          {len(built) / build:>10,.1f} records/s  {build_rate:>10,.1f} images/s  (+ decode + resize)")
        print(f"plan / build   {plan_rate / build_rate:>10,.0f}x images/s")


if __name__ == "__main__":
    main()
