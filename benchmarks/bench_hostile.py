#!/usr/bin/env python
"""Peak memory of a preprocess run over 3 good records + 1 hostile one, with the default budgets.

    python benchmarks/bench_hostile.py [--cases NAME ...] [--workers 0]

Each case runs ``neva-pack preprocess`` in a fresh process and prints its exit code, the hostile
record's skip reason and the peak RSS of the main process and of the largest worker (when
--workers > 0). The baseline (3 good records, nothing hostile) is measured in the same run.
Goal: no single record takes a run over 1.5 GB (without the budgets, the 50 MB value and the
20000 x 1 PNG with ``pad`` took several GB). Figures: benchmarks/RESULTS.md.
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
print(json.dumps({"code": code, "self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
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
        return {"code": result.returncode, "reason": result.stderr.strip()[-200:], "self_kb": 0, "children_kb": 0, "s": seconds}
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
    print(f"{'case':<46}{'exit':>5}  {'skipped as':<24}{'main RSS MB':>12}{'worker RSS MB':>14}{'time s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            m = run_case(Path(tmp), name, args.workers)
            worker = f"{m['children_kb'] / 1024:>14.0f}" if args.workers else f"{'-':>14}"
            print(f"{name:<46}{m['code']:>5}  {m['reason']:<24}{m['self_kb'] / 1024:>12.0f}{worker}{m['s']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
