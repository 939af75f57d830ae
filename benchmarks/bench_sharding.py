#!/usr/bin/env python
"""A sharded run at scale: encoding throughput per core, peak memory per shard and in the final
step, and the final step's join against its floor, in one run.

    python benchmarks/bench_sharding.py [--records 1000000] [--shards 16] [--parallel 2]
                                        [--images 2000] [--image_share 0.25] [--format compact]

Synthesises ``--records`` LLaVA-style records (``small_image_workload``: 1-3 turns of generated
text, ``--image_share`` of them with small images, one in twelve of those with two, from ``--images``
distinct JPEGs of 64-320 px),
then runs every shard as its own ``neva-pack preprocess --shard_index i`` process, ``--parallel``
at a time (one worker each: a shard is one core's work), and finally the final step (the same
command without ``--shard_index``: join the parts, pack, write). Each process reports its own peak
RSS (VmHWM) and CPU seconds.

Figures printed:
  - records/s per core: records over the shards' summed CPU seconds (user + system, workers
    included), the figure a cluster's throughput is that many cores times;
  - peak RSS of the largest shard and of the final step;
  - the final step's time split: join (``join_part`` over every part) against its floor, the
    parts' bytes copied once at this disk's bandwidth, measured in the same run by copying a file
    of the same size; then pack + write.
With ``--scales`` the final step is also run over the first fraction of the parts (e.g. 0.25 0.5
1): how its time and peak memory grow with the record count, which docs/sharding.md projects.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peak_rss import SOURCE as PEAK_RSS_SOURCE
from benchmarks.workloads import small_image_workload

MEASURE = PEAK_RSS_SOURCE + r"""
import json, resource, sys, time
import neva_pack.pipeline as pipeline
from neva_pack.cli import main
joined = [0.0]
def timed(join):
    def join_parts(*args, **kwargs):
        t = time.perf_counter()
        try:
            return join(*args, **kwargs)
        finally:
            joined[0] += time.perf_counter() - t
    return join_parts
pipeline.join_parts = timed(pipeline.join_parts)
started = time.perf_counter()
code = main(sys.argv[1:])
seconds = time.perf_counter() - started
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"code": code, "self_kb": peak_rss_kb(), "children_kb": kids.ru_maxrss, "seconds": seconds, "join": joined[0],
                  "cpu": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime}))
"""


def command(paths: dict, output: Path, shards: int, fmt: str) -> list[str]:
    return [
        "preprocess", "--quiet", "--data_path", str(paths["data_path"]), "--image_folder", str(paths["image_folder"]),
        "--tokenizer_path", str(ROOT / "sample_data" / "tokenizer.model"), "--output_dir", str(output),
        "--conv_template", "v1", "--image_aspect_ratio", "pad", "--packing_algorithm", "first_fit_shuffle",
        "--max_seq_length", "4096", "--num_workers", "1", "--num_shards", str(shards), "--output_format", fmt,
    ]  # fmt: skip


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MEASURE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate()
    if process.returncode != 0 or not out.strip():
        raise SystemExit(err[-3000:])
    measured = json.loads(out.strip().splitlines()[-1])
    if measured["code"] != 0:
        raise SystemExit(f"exited {measured['code']}: {err.strip()[-3000:]}")
    return measured


BANDWIDTH_SAMPLE = 2 << 30
"""At most this many bytes are copied to measure the disk (the parts of a large run may not fit twice)."""


def disk_bandwidth(directory: Path, size: int) -> float:
    """Bytes/s of copying a file of ``size`` bytes (at most BANDWIDTH_SAMPLE) on this disk, fsynced:
    the join's floor is the parts' bytes at this rate."""
    size = min(size, BANDWIDTH_SAMPLE)
    source, target = directory / "bandwidth.src", directory / "bandwidth.dst"
    block = os.urandom(1 << 20)
    with open(source, "wb") as f:
        for _ in range(max(1, size >> 20)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    os.posix_fadvise(os.open(source, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    started = time.perf_counter()
    with open(source, "rb") as f, open(target, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 22)
        g.flush()
        os.fsync(g.fileno())
    seconds = time.perf_counter() - started
    written = source.stat().st_size
    source.unlink()
    target.unlink()
    return written / seconds


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=2, help="shards run at once (cores to use)")
    parser.add_argument("--images", type=int, default=2000, help="distinct images")
    parser.add_argument("--image_share", type=float, default=0.25, help="share of the records with images")
    parser.add_argument("--format", default="compact")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the data and outputs here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        started = time.perf_counter()
        paths = small_image_workload(tmp / "data", args.records, images=args.images, image_share=args.image_share)
        data_mb = paths["data_path"].stat().st_size / 2**20
        print(f"workload: {args.records:,} records ({data_mb:,.0f} MB JSON), {args.images:,} distinct images, "
              f"made in {time.perf_counter() - started:.0f} s")  # fmt: skip
        output = tmp / "out"
        base = command(paths, output, args.shards, args.format)

        shard_runs, running, pending = [], [], list(range(args.shards))
        started = time.perf_counter()
        while pending or running:
            while pending and len(running) < args.parallel:
                index = pending.pop(0)
                running.append((index, start([*base, "--shard_index", str(index)])))
            index, process = running.pop(0)
            shard_runs.append(finish(process))
            print(f"  shard {index:>3}: {shard_runs[-1]['seconds']:7.1f} s, cpu {shard_runs[-1]['cpu']:7.1f} s, "
                  f"peak {max(shard_runs[-1]['self_kb'], shard_runs[-1]['children_kb']) / 1024:6.0f} MB", flush=True)  # fmt: skip
        encode_wall = time.perf_counter() - started
        cpu = sum(run["cpu"] for run in shard_runs)
        parts_bytes = tree_bytes(output)

        bandwidth = disk_bandwidth(tmp, parts_bytes)
        final = finish(start(base))
        floor = parts_bytes / bandwidth
        shard_peak = max(max(run["self_kb"], run["children_kb"]) for run in shard_runs) / 1024
        final_peak = max(final["self_kb"], final["children_kb"]) / 1024
        print()
        print(f"records/s per core (encode):   {args.records / cpu:10,.0f}   ({cpu:,.0f} CPU s over {args.shards} shards; "
              f"wall {encode_wall:,.0f} s at {args.parallel} at a time)")  # fmt: skip
        print(f"peak RSS, largest shard:       {shard_peak:10,.0f} MB")
        print(f"peak RSS, final step:          {final_peak:10,.0f} MB")
        print(f"parts on disk:                 {parts_bytes / 2**20:10,.0f} MB   disk copy bandwidth {bandwidth / 2**20:,.0f} MB/s")
        print(f"final step, join:              {final['join']:10,.1f} s    floor (parts' bytes copied once) {floor:.1f} s   "
              f"ratio {final['join'] / floor:.2f}x")  # fmt: skip
        print(f"final step, all (join+pack+write): {final['seconds']:6,.1f} s")
        print(f"output on disk:                {tree_bytes(output) / 2**20:10,.0f} MB (parts included)")


if __name__ == "__main__":
    main()
