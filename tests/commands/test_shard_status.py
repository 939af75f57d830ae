"""``neva-pack shards status OUTPUT``: each shard done, running, stale, missing or made with other
settings, the lines that resubmit exactly the stale and missing ones, the same as JSON; and two
processes given the same shard: the second is refused in one line naming the holder."""

import json
import os
import signal
import subprocess
import sys

import pytest

from neva_pack.cli import main
from neva_pack.files import store_dir
from neva_pack.pipeline import OutputLock, shards_status
from neva_pack.sample_store import PROGRESS_FILE, part_dir
from tests.shard_faults import ROOT, command, write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "records.json")


def run_shard(dataset, out, num_shards, index, *extra):
    return main(command(dataset, out, "--num_shards", num_shards, "--shard_index", index, *extra))


def make_stale(part):
    """What a kill after the part's first committed segment leaves behind."""
    progress = json.loads((part / PROGRESS_FILE).read_text())
    progress["shards"], progress["complete"] = progress["shards"][:1], False
    (part / PROGRESS_FILE).write_text(json.dumps(progress))


def test_each_state_and_the_lines_that_resubmit_the_stale_and_missing_shards(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    for index in (0, 1, 2):
        assert run_shard(dataset, out, 6, index) == 0
    assert run_shard(dataset, out, 6, 4, "--ignore_index", "-100") == 0  # other settings
    make_stale(part_dir(store_dir(out), 6, 2))
    part_dir(store_dir(out), 6, 5).mkdir()  # created, nothing in it: missing, as shard 3
    with OutputLock(part_dir(store_dir(out), 6, 1)):  # shard 1 run again, and running
        capsys.readouterr()
        assert main(["shards", "status", str(out)]) == 1
        lines = capsys.readouterr().out.strip().splitlines()
        assert main(["shards", "status", str(out), "--json"]) == 1
        status = json.loads(capsys.readouterr().out)
    assert [line.split()[2] for line in lines[:6]] == ["done", "running", "stale", "missing", "other", "missing"], lines
    assert lines[0] == "shard 0  done           records 0..5"
    assert f"pid {os.getpid()} on " in lines[1]
    assert lines[2].startswith("shard 2  stale          records 13..19 (1 committed)"), lines[2]
    assert "ignore_index differs from the other parts" in lines[4]
    assert lines[6] == f"6 shard(s) in {out}: 1 done, 1 running, 1 stale, 2 missing, 1 other settings"
    assert lines[7] == "redo with this run's settings: --shard_index 4 --overwrite (made with other settings)"
    assert lines[8].startswith("resubmit with SLURM: sbatch --array=2,3,5 ... ") and "--num_shards 6 --resume" in lines[8]
    assert "an Indexed Job of completions 3 with env NEVA_PACK_SHARD_INDEXES=2,3,5" in lines[9]
    assert lines[-1].startswith("resubmit with Ray: run_shard(config, index, 6) for index in [2, 3, 5]")
    assert [s["state"] for s in status["shards"]] == ["done", "running", "stale", "missing", "other settings", "missing"]
    assert status["resubmit"] == [2, 3, 5] and status["redo"] == [4] and not status["done"]
    assert status["next"] == lines[7:] and status["shards"][2] == {
        "index": 2, "state": "stale", "first_record": 13, "end_record": 20, "committed": 1, "detail": ""}  # fmt: skip
    # what the lines say, done: every shard done, then joined by the final step
    assert run_shard(dataset, out, 6, 4, "--overwrite") == 0
    for index in (2, 3, 5):
        assert run_shard(dataset, out, 6, index, "--resume") == 0
    capsys.readouterr()
    assert main(["shards", "status", str(out)]) == 0
    assert "every shard is done: run the final step" in capsys.readouterr().out
    assert main(command(dataset, out, "--num_shards", 6)) == 0
    joined = shards_status(out)
    assert joined.joined and joined.done and [s.detail for s in joined.shards] == ["joined"] * 6


def test_status_needs_the_number_of_shards_only_where_the_parts_do_not_say_it(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["shards", "status", str(out)]) == 2
    assert "holds no part of a sharded run; pass --num_shards" in capsys.readouterr().err
    assert main(["shards", "status", str(out), "--num_shards", "2", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["resubmit"] == [0, 1]
    assert run_shard(dataset, out, 2, 0) == 0 and run_shard(dataset, out, 3, 0) == 0
    assert main(["shards", "status", str(out)]) == 2
    assert "parts of 2 and 3 shards; pass --num_shards" in capsys.readouterr().err
    assert shards_status(out, 3).resubmit == (1, 2)


def test_two_processes_given_the_same_shard_cannot_both_write(dataset, tmp_path, capsys):
    """The first holds the part's lock (another process, as another node's would be); the second is
    refused in one line naming it, and the status shows the shard running. Once the holder is killed,
    the shard is free again."""
    out = tmp_path / "out"
    part = part_dir(store_dir(out), 4, 2)
    part.mkdir(parents=True)
    program = (f"import time; from neva_pack.pipeline import OutputLock; OutputLock({str(part)!r}).acquire(); "
               "print('held', flush=True); time.sleep(120)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert run_shard(dataset, out, 4, 2, "--resume") == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "in use by another neva-pack run" in err and f"pid {holder.pid} on " in err, err
        state = shards_status(out, 4).shards[2]
        assert state.state == "running" and f"pid {holder.pid} on " in state.detail
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert shards_status(out, 4).shards[2].state == "missing"  # the lock file left, nothing held nor written
    assert run_shard(dataset, out, 4, 2, "--resume") == 0
    assert shards_status(out, 4).shards[2].state == "done"
