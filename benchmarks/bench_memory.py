#!/usr/bin/env python
"""Peak memory of a preprocess run against merely json.load-ing its input, in one run.

    python benchmarks/bench_memory.py [--records 100000 300000] [--workers 2]

Synthesises a JSON list of text-only LLaVA records sized like LLaVA-1.5 mix665k's (its 1.03 GB
file holds 665,298 records: about 1.5 KB each; here 1 to 4 rounds of generated sentences), then
for each size runs, each in a fresh process:
  - ``json.load`` of the file (what a non-streaming tool does first), peak RSS;
  - ``neva-pack preprocess`` on it (v1 template, near_optimal, the sample tokenizer), peak RSS
    of the main process and of the largest process of the run (workers included), and time.
Goal: peak RSS under 1 GB, below the json.load figure, and not growing with the record count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peak_rss import SOURCE as PEAK_RSS_SOURCE  # noqa: E402

WORDS = (
    "the a picture shows image cat coffee rocket galaxy person table light colour blue green red large small "
    "near far left right under over because while there is are was were has have what why how which describe "
    "explain count answer question detail background foreground pack sequence token model train"
).split()

MEASURE = PEAK_RSS_SOURCE + r"""
import json, resource, sys, runpy
mode, path = sys.argv[1], sys.argv[2]
if mode == "json.load":
    with open(path) as f:
        data = json.load(f)
    print(json.dumps({"records": len(data), "self_kb": peak_rss_kb()}))
else:
    from neva_pack.cli import main
    code = main(sys.argv[3:])
    usage_self = peak_rss_kb()
    usage_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"code": code, "self_kb": usage_self, "children_kb": usage_children}))
"""


def synthesise(path: Path, records: int) -> None:
    import random

    rng = random.Random(records)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(records):
            turns = []
            for _ in range(rng.choice((1, 2, 3, 4))):
                turns.append({"from": "human", "value": sentence(rng.randint(6, 24))})
                answer = " ".join(sentence(rng.randint(8, 20)) for _ in range(rng.randint(2, 8)))
                turns.append({"from": "gpt", "value": answer})
            f.write(json.dumps({"id": f"rec-{i}", "conversations": turns}))
            f.write(",\n" if i + 1 < records else "\n")
        f.write("]\n")


def measure(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-2000:])
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    if measured.get("code", 0) != 0:
        raise SystemExit(f"preprocess exited {measured['code']}: {result.stderr.strip()[-2000:]}")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[100_000, 300_000])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{'records':>9}{'file MB':>9}{'json.load RSS MB':>18}{'run main RSS MB':>17}{'run max RSS MB':>16}{'time s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for records in args.records:
            data = Path(tmp) / f"records_{records}.json"
            synthesise(data, records)
            baseline = measure("json.load", str(data))
            started = time.perf_counter()
            run = measure(
                "run", str(data), "preprocess", "--quiet", "--data_path", str(data),
                "--tokenizer_path", str(ROOT / "sample_data" / "tokenizer.model"),
                "--output_dir", str(Path(tmp) / f"out_{records}"), "--conv_template", "v1",
                "--packing_algorithm", "near_optimal", "--max_seq_length", "4096",
                "--num_workers", str(args.workers),
            )  # fmt: skip
            seconds = time.perf_counter() - started
            print(
                f"{records:>9,}{data.stat().st_size / 2**20:>9.0f}{baseline['self_kb'] / 1024:>18.0f}"
                f"{run['self_kb'] / 1024:>17.0f}{max(run['self_kb'], run['children_kb']) / 1024:>16.0f}{seconds:>8.0f}"
            )


if __name__ == "__main__":
    main()
