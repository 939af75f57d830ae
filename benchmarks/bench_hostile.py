#!/usr/bin/env python
"""Peak memory of a preprocess run over 3 good records + 1 hostile one, with the default budgets.

    python benchmarks/bench_hostile.py [--cases NAME ...] [--workers 0]

Each case runs ``neva-pack preprocess`` in a fresh process and prints its exit code, the hostile
record's skip reason, the peak RSS of the main process and of the largest worker (when
--workers > 0), the wall time and the CPU time (all processes), and the CPU time over the
baseline (3 good records, nothing hostile), which is measured first in the same run. CPU time is
the figure to compare on a shared machine: the wall time grows with everyone else's load.
Goal: no single hostile record costs a run more than 1.5 GB or 10 s over the baseline. Before the
budgets, the 50 MB value took 6.8 GB and the 20000 x 1 PNG 6 GB with ``pad`` (killed for memory
without them); 142,000 <image> placeholders took 1.0 GB before they were refused; the progressive
JPEG of 10,000 scans took minutes to decode before --max_image_decode_seconds.
Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "sample_data" / "images" / "chelsea.jpg"

MEASURE = r"""
import json, resource, sys
from neva_pack.cli import main
code = main(sys.argv[1:])
me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"code": code, "self_kb": me.ru_maxrss, "children_kb": children.ru_maxrss,
                  "cpu": me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime}))
"""


def turns(question: str, answer: str = "A cat.") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


GOOD = [
    {"id": "good0", "conversations": turns("Hi there", "Hello!")},
    {"id": "good1", "image": "chelsea.jpg", "conversations": turns("<image>\nWhat is this?")},
    {"id": "good2", "conversations": turns("Name a colour.", "Blue.")},
]


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def jpeg_claiming(width: int, height: int) -> bytes:
    """A 16 x 16 JPEG whose header says width x height (what a decoder allocates for)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def progressive_jpeg_with_scans(width: int, height: int, scans: int) -> bytes:
    """A flat progressive JPEG whose last scan is repeated ``scans`` times: each repeat is a few
    dozen bytes, and every one makes the decoder walk every block of the image again."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(buffer, "JPEG", progressive=True, quality=90)
    data = buffer.getvalue()
    last_scan, end = data.rindex(b"\xff\xda"), data.rindex(b"\xff\xd9")
    return data[:end] + data[last_scan:end] * scans + data[end:]


def blp_unknown_encoding() -> bytes:
    """A 4 x 4 BLP2 header naming encoding 9, which PIL refuses with its own BLPFormatError."""
    import struct

    offsets, lengths = struct.pack("<16I", 1172, *[0] * 15), struct.pack("<16I", 16, *[0] * 15)
    header = b"BLP2" + struct.pack("<i", 1) + bytes([9, 0, 0, 0]) + struct.pack("<II", 4, 4)
    return header + offsets + lengths + b"\0" * (1024 + 16)


def dds_unknown_pixel_format() -> bytes:
    """A 4 x 4 DDS header whose pixel-format flags name nothing PIL knows (NotImplementedError)."""
    import struct

    header = struct.pack("<7I", 124, 0x1007, 4, 4, 0, 0, 0) + b"\0" * 44 + struct.pack("<2I", 32, 0x4000_0000)
    return b"DDS " + header + b"\0" * (40 + 64)


def many_images_record(count: int) -> dict:
    """One record of ``count`` <image> placeholders, each with its image (the same small file)."""
    return {"id": "many", "image": ["chelsea.jpg"] * count, "conversations": turns("<image>" * count)}


def image_case(name: str, data: bytes, *extra: str):
    def make(folder: Path):
        (folder / name).write_bytes(data)
        return {"id": "hostile", "image": name, "conversations": turns("<image>\nWhat?")}, extra

    return make


def record_case(record, *extra: str):
    return lambda folder: (record, extra)


CASES = {
    "baseline (3 good records)": None,
    "50 MB conversation value": record_case({"id": "big", "conversations": turns("a " * 25_000_000)}),
    "50 MB value, --max_record_bytes 64 MiB": record_case(
        {"id": "big", "conversations": turns("a " * 25_000_000)}, "--max_record_bytes", str(64 << 20)
    ),
    "999,990-character question (tokenized, cut)": record_case({"id": "edge", "conversations": turns("a " * 499_995)}),
    "JSON list record nested 100,000 deep": record_case("[" * 100_000 + "]" * 100_000),
    "20000x1 PNG, square": image_case("wide.png", png(20_000, 1)),
    "20000x1 PNG, pad": image_case("wide.png", png(20_000, 1), "--image_aspect_ratio", "pad"),
    "108-megapixel JPEG header": image_case("huge.jpg", jpeg_claiming(12_000, 9_000)),
    "6000x6000 PNG (36 Mpx, at the budget)": image_case("big.png", png(6_000, 6_000)),
    "6000x4000 PNG, pad (36 Mpx padded)": image_case("big.png", png(6_000, 4_000), "--image_aspect_ratio", "pad"),
    "progressive JPEG 6000x6000, 10,000 scans": image_case("slow.jpg", progressive_jpeg_with_scans(6_000, 6_000, 10_000)),
    "BLP with an unknown encoding": image_case("odd.blp", blp_unknown_encoding()),
    "DDS with unknown pixel flags": image_case("odd.dds", dds_unknown_pixel_format()),
    "142,000 <image> placeholders and images": record_case(many_images_record(142_000)),
    "142,000 images, --max_images_per_record 200,000": record_case(
        many_images_record(142_000), "--max_images_per_record", "200000"
    ),
}


def run_case(tmp: Path, name: str, workers: int) -> dict:
    case_dir = tmp / str(abs(hash(name)))
    folder = case_dir / "images"
    folder.mkdir(parents=True)
    (folder / "chelsea.jpg").write_bytes(IMAGE.read_bytes())
    records, extra = list(GOOD), ()
    if CASES[name] is not None:
        hostile, extra = CASES[name](folder)
        records.insert(1, hostile)
    data = case_dir / "data.json"
    data.write_text("[\n" + ",\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n]\n")
    out = case_dir / "out"
    args = ["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(folder),
            "--tokenizer_path", str(ROOT / "sample_data" / "tokenizer.model"), "--output_dir", str(out),
            "--conv_template", "v1", "--num_workers", str(workers), "--max_skip_fraction", "1", *extra]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0 or not result.stdout.strip():
        return {"code": result.returncode, "reason": result.stderr.strip()[-200:], "self_kb": 0, "children_kb": 0, "s": seconds,
                "cpu": 0.0}  # fmt: skip
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    skipped = out / "skipped.jsonl"
    reasons = [json.loads(line)["reason"] for line in skipped.read_text().splitlines()] if skipped.is_file() else []
    measured.update(reason=",".join(reasons) or "-", s=seconds)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    print(f"{'case':<50}{'exit':>5}  {'skipped as':<18}{'main RSS MB':>12}{'worker RSS MB':>14}{'wall s':>8}{'CPU s':>7}"
          f"{'CPU - baseline':>15}")  # fmt: skip
    baseline_cpu = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            m = run_case(Path(tmp), name, args.workers)
            if CASES[name] is None:
                baseline_cpu = m["cpu"]
            worker = f"{m['children_kb'] / 1024:>14.0f}" if args.workers else f"{'-':>14}"
            over = f"{m['cpu'] - baseline_cpu:>+15.1f}" if baseline_cpu is not None else f"{'-':>15}"
            print(f"{name:<50}{m['code']:>5}  {m['reason']:<18}{m['self_kb'] / 1024:>12.0f}{worker}{m['s']:>8.1f}"
                  f"{m['cpu']:>7.1f}{over}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
