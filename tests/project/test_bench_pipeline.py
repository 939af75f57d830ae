"""The pipeline benchmark runs end to end on its smallest configuration (so it cannot rot unseen):
a table per workload with its floor, a row per run, and the goal line of a 2-worker run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pipeline.py"


@pytest.mark.slow
def test_the_smallest_benchmark_prints_every_table_row_and_goal(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH), "--image_records", "6", "--text_records", "40", "--zipf_records", "30", "--workers",
         "--compact_workers", "2", "--memory_records"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    titles = [line for line in lines if "floor on one core" in line]
    assert [title.split(":")[0] for title in titles] == ["image", "text-only", "text-only, 50,000-word Zipf vocabulary"]
    assert "6 records" in titles[0] and "40 records" in titles[1] and "30 records" in titles[2]
    headers = [n for n, line in enumerate(lines) if line.split()[:3] == ["workers", "format", "floor"]]
    assert len(headers) == 3
    for n in headers:
        header, values = lines[n].split(), lines[n + 1].split()
        assert values[:2] == ["2", "compact"]
        assert "steady" in header and "CPU" in header
        assert "megatron" in header and values[2:].count("no") == 1  # preprocessing never imports megatron-core
        numbers = [v for v in values[2:-1] if v != "no"]  # the last: the workers' RSS, one per worker
        assert all(float(v) >= 0 for v in numbers)
    goals = [line.strip() for line in lines if line.strip().startswith("goal ")]
    assert [" ".join(goal.split()[1:3]) for goal in goals] == ["image <=", "text <=", "text <=", "image steady"]
    assert all(" met (" in goal for goal in goals)  # "met (" or "NOT met (": the verdict and its ratio
    steady = lines.index(next(line for line in lines if line.startswith("steady state: image 6 -> 24 records")))
    header, values = lines[steady + 1].split(), lines[steady + 2].split()
    assert header[:2] == ["workers", "format"] and "x" in header and values[:2] == ["2", "compact"]
    small, large, _, extra_mb = map(float, values[2:6])  # the extra seconds of 18 records may be noise of either sign
    assert small > 0 and large > 0 and extra_mb >= 0
