#!/usr/bin/env python
"""Throughput of ``neva-pack preprocess`` against the floor of its per-record work, in one run.

    python benchmarks/bench_pipeline.py [--image_records 4000 (0: none)] [--text_records 100000 [20000 ...]]
                                        [--zipf_records 100000]
                                        [--workers 1 2 4] [--compact_workers 2]
                                        [--memory_records 10000 100000] [--steady_factor 4]

Workloads (benchmarks/workloads.py, seeded): LLaVA-style records over real photos (v1 template,
``pad``, CLIP-L/14-336, near_optimal at 4096), text-only records (v1, the sample tokenizer) of
~70 common words, and text-only records over a 50,000-word Zipf vocabulary (``--zipf_records``:
the tokenizer's per-word cache then misses as on natural text), one table per workload and size.

Floor = the unavoidable work, timed (wall clock, like the runs) in this process on one core,
divided by the cores the run can use (min(workers, CPUs)):
  image: read + decode + convert RGB + pad to square + resize/crop + normalise, per image instance;
  text:  sentencepiece encode (ids only) of every turn.
Pipeline = the real command in a fresh process, into an empty output directory (as a new user's
first run), stage by stage: start-up (process start to the first record in the main process),
encode (to the last record stored), pack, write (packs, plan, stats, meta), then ``neva-pack
verify``; "megatron": whether the preprocess process imported megatron-core (seconds of CPU; it
should not: its stores are written by files.indexed); peak RSS of the main process and the sum
of the workers' peaks (VmHWM; a forked worker's RSS counts the pages it shares with the main process).
Rows: ``nemo`` output for each of ``--workers``, and ``compact`` output for each of ``--compact_workers``.

Fixed costs apart from per-record cost:
  steady x   (total - start-up) / floor: the run without its start-up;
  x floor    (after encode) encode / floor: the per-record stage alone;
  CPU        seconds of CPU of the main process, of the workers together (getrusage of the
             command's children) and of ``verify``; "x floor CPU" = workers' CPU / the floor's CPU
             on one core: the per-record cost of the workers' work, whatever else loads the machine.
A line per 2-worker run says whether the throughput goal is met (image <= 1.25x its floor, text-only
<= 3x).

Steady state (``--steady_factor F``, default 4; 0: not run): the image workload is also run with F
times its records (the smaller workload's records are the larger's first ones), in each format of
``--compact_workers``' rows with that many workers, and the marginal cost of the extra records, start-up
and every other fixed cost cancelled, is set against the marginal floor: the image work above without
the normalisation (compact stores uint8 pixels; its reader normalises) divided by the cores, plus the
output's extra bytes at the disk's write bandwidth (measured here: 256 MB written and fsynced in the
output's directory). "x floor CPU" there: the extra CPU of main process and
workers together against the extra floor CPU. ``--memory_records`` runs text-only workloads of those sizes (2 workers) for the main
process's peak RSS against the record count (a size already run above is not run again).

The package's bytecode is compiled (as pip does on install) and a small untimed run of each
workload comes first (numba's disk cache then holds every kernel).
The defaults take a quarter of an hour or more on a 2-core machine. Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import compileall
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peak_rss import SOURCE as PEAK_RSS_SOURCE  # noqa: E402
from benchmarks.workloads import image_workload, text_workload  # noqa: E402

TOKENIZER = ROOT / "sample_data" / "tokenizer.model"
ENCODER = "openai/clip-vit-large-patch14-336"

HARNESS = PEAK_RSS_SOURCE + r"""
import json, os, resource, sys, time
stages = {"process_start": float(sys.argv[1])}
report_dir = sys.argv[2]
from neva_pack import pipeline
from neva_pack.samples import stream as sample_stream
from neva_pack.pipeline import pack as pack_stage
from neva_pack.sample_store import SampleStoreWriter

def timed(owner, name, key):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        started = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            stages[key] = stages.get(key, 0.0) + time.time() - started
    setattr(owner, name, wrapper)

for method in ("append", "append_stored", "skip"):  # the first record reaches the store
    original = getattr(SampleStoreWriter, method)
    def first(self, *args, _original=original, **kwargs):
        stages.setdefault("first_record", time.time())
        return _original(self, *args, **kwargs)
    setattr(SampleStoreWriter, method, first)
original_encode = pipeline.encode_samples
def encode(*args, **kwargs):
    try:
        return original_encode(*args, **kwargs)
    finally:
        stages["encode_end"] = time.time()
pipeline.encode_samples = encode
timed(pack_stage, "pack", "pack")
timed(pipeline, "_write_prefix", "write_prefix")

original_iter = sample_stream.SampleStream.__iter__
def iter_and_report(self):
    yield from original_iter(self)
    with open(os.path.join(report_dir, f"worker_{os.getpid()}.json"), "w") as f:
        json.dump({"maxrss_kb": peak_rss_kb()}, f)
sample_stream.SampleStream.__iter__ = iter_and_report

from neva_pack.cli import main
stages["main_start"] = time.time()
code = main(sys.argv[3:])
stages["end"] = time.time()
stages["maxrss_kb"] = peak_rss_kb()
cpu = lambda who: resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
stages["main_cpu"] = cpu(resource.RUSAGE_SELF)
stages["workers_cpu"] = cpu(resource.RUSAGE_CHILDREN)  # the DataLoader's workers, joined by now
stages["megatron_imported"] = any(name.split(".")[0] == "megatron" for name in sys.modules)
print(json.dumps({"code": code, **stages}))
"""

GOALS = {"image": 1.25, "text": 3.0}
"""The throughput goals with 2 workers: total <= this many times the floor."""
GOAL_WORKERS = 2


def image_floor(data_path: Path, image_folder: Path, normalise: bool = True) -> tuple[float, float, int]:
    """Seconds (wall, CPU) of the unavoidable image work on one core, and the number of image instances.
    ``normalise=False``: without the float normalisation, which an output of uint8 pixels (compact,
    energon) leaves to its reader: read, decode, convert, pad and resize only."""
    from PIL import Image

    from neva_pack.families import resolve_encoder
    from neva_pack.families.fixed import expand_to_square, fast_geometry, normalisation_from_settings

    encoder = resolve_encoder(ENCODER)
    geometry, normalisation = fast_geometry(encoder), normalisation_from_settings(encoder)
    background = tuple(int(c * 255) for c in encoder.preprocessor_config["image_mean"])
    names = []
    for record in json.loads(data_path.read_text()):
        image = record.get("image")
        names += [] if image is None else [image] if isinstance(image, str) else image
    started, started_cpu = time.perf_counter(), time.process_time()
    for name in names:
        data = (image_folder / name).read_bytes()
        image = Image.open(io.BytesIO(data))
        image.load()
        pixels = geometry.apply(expand_to_square(image.convert("RGB"), background))
        if normalise:
            normalisation.apply(pixels[None])
    return time.perf_counter() - started, time.process_time() - started_cpu, len(names)


def text_floor(data_path: Path) -> tuple[float, float, int]:
    """Seconds (wall, CPU) of sentencepiece encoding of every turn on one core, and the number of turns."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.Load(str(TOKENIZER))
    texts = [turn["value"] for record in json.loads(data_path.read_text()) for turn in record["conversations"]]
    started, started_cpu = time.perf_counter(), time.process_time()
    for text in texts:
        sp.encode(text)
    return time.perf_counter() - started, time.process_time() - started_cpu, len(texts)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pipeline(args: list[str], workdir: Path) -> dict:
    """One run into an output directory emptied first, untimed (a new user's run: --overwrite's
    removal of a previous output is not the pipeline's throughput), once the
    disk has taken what earlier runs wrote."""
    report_dir = Path(tempfile.mkdtemp(dir=workdir))
    shutil.rmtree(args[args.index("--output_dir") + 1], ignore_errors=True)
    os.sync()  # the previous run's write-back (GBs for an image nemo output) is not this run's
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-c", HARNESS, str(started), str(report_dir), "preprocess", "--quiet", "--overwrite", *args],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    stages = json.loads(result.stdout.strip().splitlines()[-1])
    workers = [json.loads(p.read_text())["maxrss_kb"] for p in report_dir.glob("worker_*.json")]
    output_dir = Path(args[args.index("--output_dir") + 1])
    verify_started, verify_cpu = time.time(), _children_cpu()
    subprocess.run([sys.executable, "-m", "neva_pack.cli", "verify", "--quiet", str(output_dir)], check=True,
                   capture_output=True)  # fmt: skip
    verify = time.time() - verify_started
    first = stages.get("first_record", stages["end"])
    return {
        "total": stages["end"] - stages["process_start"],
        "startup": first - stages["process_start"],
        "encode": stages["encode_end"] - first,
        "megatron": "yes" if stages["megatron_imported"] else "no",
        "pack": stages.get("pack", 0.0),
        "write": stages.get("write_prefix", 0.0) - stages.get("pack", 0.0),
        "verify": verify,
        "verify_cpu": _children_cpu() - verify_cpu,
        "main_cpu": stages["main_cpu"],
        "workers_cpu": stages["workers_cpu"],
        "main_rss_mb": stages["maxrss_kb"] / 1024,
        "workers_rss_mb": sum(workers) / 1024,
        "worker_rss_mb": [w / 1024 for w in workers],
    }


HEADER = (f"{'workers':>7} {'format':>7} {'floor s':>8} {'total s':>8} {'x floor':>8} {'start-up':>9} {'steady x':>9} "
          f"{'encode':>7} {'x floor':>8} {'megatron':>9} {'pack':>6} {'write':>6} {'verify':>7} "
          f"{'main CPU':>9} {'workers CPU':>12} {'x floor CPU':>12} {'verify CPU':>11} "
          f"{'main RSS MB':>12} {'workers RSS MB':>15}")  # fmt: skip


def row(workers: int, fmt: str, floor: float, floor_cpu: float, m: dict) -> str:
    per_worker = "+".join(f"{w:.0f}" for w in m["worker_rss_mb"])
    return (f"{workers:>7} {fmt:>7} {floor:>8.2f} {m['total']:>8.2f} {m['total'] / floor:>8.2f} {m['startup']:>9.2f} "
            f"{(m['total'] - m['startup']) / floor:>9.2f} {m['encode']:>7.2f} {m['encode'] / floor:>8.2f} "
            f"{m['megatron']:>9} {m['pack']:>6.2f} {m['write']:>6.2f} {m['verify']:>7.2f} "
            f"{m['main_cpu']:>9.2f} {m['workers_cpu']:>12.2f} {m['workers_cpu'] / floor_cpu:>12.2f} {m['verify_cpu']:>11.2f} "
            f"{m['main_rss_mb']:>12.0f} {m['workers_rss_mb']:>9.0f} ({per_worker})")  # fmt: skip


def goal_line(kind: str, fmt: str, floor: float, m: dict) -> str:
    ratio, goal = m["total"] / floor, GOALS[kind]
    verdict = "met" if ratio <= goal else "NOT met"
    return (f"  goal {kind} <= {goal}x floor with {GOAL_WORKERS} workers ({fmt}): {verdict} "
            f"({ratio:.2f}x; {(m['total'] - m['startup']) / floor:.2f}x without start-up)")


WARM_UP_RECORDS = 8
ZIPF_VOCABULARY = 50_000
"""Pseudo-words of the Zipf text workload: ~15-20K distinct words per 100K records' worker share,
so the tokenizer's word cache misses as on natural text, not as on the default workload's ~70 words."""


def warm_up(workdir: Path, common: list[str]) -> None:
    """The package's bytecode compiled, as ``pip install`` does (a checkout run with
    PYTHONDONTWRITEBYTECODE, as in some containers, would compile every module again in every run,
    inside the start-up being measured), then one small untimed run of each workload, so that numba's disk cache
    holds every kernel (a fresh checkout compiles them once) and the first timed run is like the others."""
    compileall.compile_dir(ROOT / "neva_pack", quiet=1)
    image = image_workload(workdir / "warm_up_image", WARM_UP_RECORDS, seed=2)
    text = text_workload(workdir / "warm_up_text.json", WARM_UP_RECORDS, seed=2)
    for flags in (["--data_path", str(image["data_path"]), "--image_folder", str(image["image_folder"]),
                   "--image_aspect_ratio", "pad", "--hf_vision_encoder", ENCODER], ["--data_path", str(text)]):  # fmt: skip
        run_pipeline([*flags, *common, "--output_dir", str(workdir / "warm_up"), "--num_workers", "1"], workdir)


STEADY_GOAL = 1.25
"""The image pipeline's steady-state goal: the marginal cost of more records at most this many times
the marginal floor (decode and resize on the cores the run has, the output's bytes at the disk's bandwidth)."""
BANDWIDTH_PROBE_BYTES = 256 << 20


def disk_write_bandwidth(directory: Path) -> float:
    """Bytes per second that this disk takes, written and fsynced (what an output costs at least to write)."""
    probe = directory / "bandwidth_probe"
    block = os.urandom(8 << 20)
    started = time.perf_counter()
    with open(probe, "wb") as f:
        for _ in range(BANDWIDTH_PROBE_BYTES // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    probe.unlink()
    return BANDWIDTH_PROBE_BYTES / seconds


def output_bytes(output_dir: Path) -> int:
    return sum(p.stat().st_size for p in output_dir.rglob("*") if p.is_file())


def steady_state(workdir: Path, records: int, factor: int, runs: list[tuple[int, str]], common: list[str], cpus: int) -> None:
    """The marginal cost of ``(factor - 1) * records`` image records against their marginal floor."""
    small = image_workload(workdir / "steady_small", records, seed=0)
    large = image_workload(workdir / "steady_large", records * factor, seed=0)
    floors = {name: image_floor(w["data_path"], w["image_folder"], normalise=False) for name, w in (("small", small), ("large", large))}
    bandwidth = disk_write_bandwidth(workdir)
    extra_images = floors["large"][2] - floors["small"][2]
    extra_floor, extra_floor_cpu = floors["large"][0] - floors["small"][0], floors["large"][1] - floors["small"][1]
    print(f"\nsteady state: image {records:,} -> {records * factor:,} records (+{extra_images:,} images); "
          f"floor of the extra images on one core {extra_floor:.2f} s ({extra_floor_cpu:.2f} s CPU); "
          f"disk write bandwidth {bandwidth / 1e6:,.0f} MB/s")  # fmt: skip
    print(f"{'workers':>7} {'format':>7} {'total small':>12} {'total large':>12} {'extra s':>8} {'extra MB':>9} "
          f"{'floor s':>8} {'x floor':>8} {'extra CPU':>10} {'x floor CPU':>12} {'main CPU':>9}")  # fmt: skip
    lines = []
    for workers, fmt in runs:
        measured = {}
        for name, workload in (("small", small), ("large", large)):
            out = workdir / "steady_out"
            flags = ["--data_path", str(workload["data_path"]), "--image_folder", str(workload["image_folder"]),
                     "--image_aspect_ratio", "pad", "--hf_vision_encoder", ENCODER]  # fmt: skip
            m = run_pipeline([*flags, *common, "--output_dir", str(out), "--num_workers", str(workers), "--output_format", fmt], workdir)
            measured[name] = (m, output_bytes(out))
        (small_m, small_bytes), (large_m, large_bytes) = measured["small"], measured["large"]
        extra = large_m["total"] - small_m["total"]
        extra_bytes = large_bytes - small_bytes
        floor = extra_floor / min(workers, cpus) + extra_bytes / bandwidth
        extra_cpu = (large_m["main_cpu"] + large_m["workers_cpu"]) - (small_m["main_cpu"] + small_m["workers_cpu"])
        extra_main = large_m["main_cpu"] - small_m["main_cpu"]
        print(f"{workers:>7} {fmt:>7} {small_m['total']:>12.2f} {large_m['total']:>12.2f} {extra:>8.2f} "
              f"{extra_bytes / 1e6:>9.1f} {floor:>8.2f} {extra / floor:>8.2f} {extra_cpu:>10.2f} "
              f"{extra_cpu / extra_floor_cpu:>12.2f} {extra_main:>9.2f}", flush=True)  # fmt: skip
        verdict = "met" if extra / floor <= STEADY_GOAL else "NOT met"
        lines.append(f"  goal image steady state <= {STEADY_GOAL}x floor ({fmt}, {workers} workers): {verdict} ({extra / floor:.2f}x)")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_records", type=int, default=4000, help="0: no image workload")
    parser.add_argument("--text_records", type=int, nargs="*", default=[100_000], help="one text-only table per size")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4], help="nemo output rows")
    parser.add_argument("--compact_workers", type=int, nargs="*", default=[GOAL_WORKERS], help="compact output rows")
    parser.add_argument("--zipf_records", type=int, nargs="*", default=[100_000],
                        help="text-only tables over a Zipf vocabulary (the tokenizer's word cache misses)")
    parser.add_argument("--memory_records", type=int, nargs="*", default=[10_000, 100_000])
    parser.add_argument("--steady_factor", type=int, default=4,
                        help="the image workload also run with this many times its records, for the marginal cost (0: not run)")
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    print(f"machine: {cpus} CPUs; load average at start {os.getloadavg()[0]:.2f}")
    common = ["--tokenizer_path", str(TOKENIZER), "--conv_template", "v1", "--packing_algorithm", "near_optimal",
              "--max_seq_length", "4096"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm_up(tmp, common)
        workloads = []
        if args.image_records > 0:
            image = image_workload(tmp / "image", args.image_records, seed=0)
            image_seconds, image_cpu, images = image_floor(image["data_path"], image["image_folder"])
            workloads.append((
                "image", args.image_records, f"image: {args.image_records:,} records, {images:,} images (v1, pad, CLIP-L/14-336)",
                image_seconds, image_cpu,
                ["--data_path", str(image["data_path"]), "--image_folder", str(image["image_folder"]),
                 "--image_aspect_ratio", "pad", "--hf_vision_encoder", ENCODER],
            ))  # fmt: skip
        for records in args.text_records:
            text = text_workload(tmp / f"text_{records}_seed0.json", records, seed=0)
            text_seconds, text_cpu, turns = text_floor(text)
            workloads.append(("text", records, f"text-only: {records:,} records, {turns:,} turns (v1)", text_seconds, text_cpu,
                              ["--data_path", str(text)]))  # fmt: skip
        for records in args.zipf_records:
            text = text_workload(tmp / f"zipf_{records}_seed0.json", records, seed=0, vocabulary=ZIPF_VOCABULARY)
            text_seconds, text_cpu, turns = text_floor(text)
            title = f"text-only, {ZIPF_VOCABULARY:,}-word Zipf vocabulary: {records:,} records, {turns:,} turns (v1)"
            workloads.append(("text", records, title, text_seconds, text_cpu, ["--data_path", str(text)]))
        memory = {}
        for kind, records, title, floor_one_core, floor_cpu, flags in workloads:
            print(f"\n{title}: floor on one core {floor_one_core:.2f} s ({floor_cpu:.2f} s CPU)")
            print(HEADER)
            goals = []
            runs = [(workers, "nemo") for workers in args.workers] + [(workers, "compact") for workers in args.compact_workers]
            for workers, fmt in runs:
                floor = floor_one_core / min(workers, cpus)
                out = tmp / "out"
                m = run_pipeline([*flags, *common, "--output_dir", str(out), "--num_workers", str(workers),
                                  "--output_format", fmt], tmp)  # fmt: skip
                print(row(workers, fmt, floor, floor_cpu, m), flush=True)
                if workers == GOAL_WORKERS:
                    goals.append(goal_line(kind, fmt, floor, m))
                    if kind == "text" and fmt == "nemo" and records not in memory:  # the first text workload's
                        memory[records] = m
            if goals:
                print("\n".join(goals))
        if args.image_records > 0 and args.steady_factor > 1:
            steady_state(tmp, args.image_records, args.steady_factor, [(w, "compact") for w in args.compact_workers], common, cpus)
        if args.memory_records:
            print(f"\nmain process peak RSS against the record count (text-only, {GOAL_WORKERS} workers)")
            print(f"{'records':>9} {'total s':>8} {'main RSS MB':>12} {'workers RSS MB':>15}")
            for records in args.memory_records:
                m = memory.get(records)
                if m is None:
                    data = text_workload(tmp / f"text_{records}.json", records, seed=1)
                    m = run_pipeline(["--data_path", str(data), *common, "--output_dir", str(tmp / "mem"),
                                      "--num_workers", str(GOAL_WORKERS)], tmp)  # fmt: skip
                print(f"{records:>9,} {m['total']:>8.1f} {m['main_rss_mb']:>12.0f} {m['workers_rss_mb']:>15.0f}")
        print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
