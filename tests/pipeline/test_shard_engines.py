"""One shard runner, three engines: a SLURM job array (flags or SLURM_ARRAY_TASK_ID), a Kubernetes
Indexed Job (JOB_COMPLETION_INDEX) and Ray tasks calling ``run_shard``, each followed by the final step,
give the bytes of a run without shards, also when a shard is killed (SIGKILL, at a step of its
writer drawn from a seeded generator) and restarted with the same index; a final step with a shard left is refused with the resubmission line."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.core import ConfigError
from neva_pack.records import resolve_shards
from tests.shard_faults import ROOT, command, install, killed_once, killed_run, outputs, settings, write_dataset

SHARDS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "records.json")


@pytest.fixture(scope="module")
def unsharded(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("unsharded") / "out"
    assert main(command(dataset, out)) == 0
    return outputs(out)


def run_shards(dataset, out, indexes, *extra):
    for index in indexes:
        assert main(command(dataset, out, "--num_shards", SHARDS, "--shard_index", index, *extra)) == 0


def finish(dataset, out, *extra):
    return main(command(dataset, out, "--num_shards", SHARDS, *extra))


def test_a_kubernetes_completion_index_is_the_shard_index():
    pod = {"JOB_COMPLETION_INDEX": "5"}
    assert resolve_shards(8, None, pod) == (8, 5)
    assert resolve_shards(8, 2, pod) == (8, 2)  # an explicit flag wins
    assert resolve_shards(8, None, {**pod, "SLURM_ARRAY_TASK_ID": "3"}) == (8, 3)  # SLURM's variable first
    resubmitted = {"JOB_COMPLETION_INDEX": "1", "NEVA_PACK_SHARD_INDEXES": "3,7"}  # completions 2: pod 1 redoes shard 7
    assert resolve_shards(8, None, resubmitted) == (8, 7)
    with pytest.raises(ConfigError, match="completions must be 2"):
        resolve_shards(8, None, {**resubmitted, "JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ConfigError, match="NEVA_PACK_SHARD_INDEXES='3,x'"):
        resolve_shards(8, None, {**resubmitted, "NEVA_PACK_SHARD_INDEXES": "3,x"})
    with pytest.raises(ConfigError, match=r"--shard_index 9: must be between 0 and --num_shards - 1 \(7\)"):
        resolve_shards(8, None, {"JOB_COMPLETION_INDEX": "9"})
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX='a' is not a number"):
        resolve_shards(8, None, {"JOB_COMPLETION_INDEX": "a"})


def test_a_completion_index_without_num_shards_is_refused_in_one_line(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert main(command(dataset, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "JOB_COMPLETION_INDEX='3'" in err and "needs --num_shards" in err, err
    assert not (tmp_path / "out").exists()


def test_run_shard_and_finish_shards_give_the_bytes_of_a_run_without_shards(dataset, unsharded, tmp_path):
    """The Python calls every engine's recipe makes, in any order."""
    from neva_pack import PreprocessConfig, finish_shards, run_shard

    config = PreprocessConfig(**settings(dataset, tmp_path / "out"), resume=True)
    for index in (5, 0, 7, 1, 2, 6, 3, 4):
        result = run_shard(config, index, SHARDS, progress=False)
        assert result.reports == {} and f"shard {index} of {SHARDS}" in result.notes[0]
    result = finish_shards(config, SHARDS, progress=False)
    assert result.report.records.skipped == 1
    assert outputs(tmp_path / "out") == unsharded
    with pytest.raises(ConfigError, match="give num_shards"):
        finish_shards(config)


def test_the_final_step_with_shards_left_names_them_and_the_resubmission_line(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run_shards(dataset, out, [0, 1, 2, 4, 5, 7])
    capsys.readouterr()
    assert finish(dataset, out) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "part_00003_of_00008 (records 15..19) is missing: run the same command with --shard_index 3" in err, err
    assert "2 of the 8 shards are not done: 3 (missing), 6 (missing)" in err, err
    assert "sbatch --array=3,6" in err and "NEVA_PACK_SHARD_INDEXES=3,6" in err and "--num_shards 8 --resume" in err, err
    assert not (out / "packed_seq_dataset.bin").exists()


@pytest.mark.slow
def test_eight_processes_given_job_completion_index_give_the_bytes_of_a_run_without_shards(dataset, unsharded, tmp_path):
    """Eight pods of a Kubernetes Indexed Job: the same command (with --resume, as the manifest has it,
    so that a restarted pod continues), each given its JOB_COMPLETION_INDEX; then the final Job."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "neva_pack.cli", *command(dataset, out, "--num_shards", SHARDS, "--resume")]
    pods = [
        subprocess.Popen(args, env={**os.environ, "JOB_COMPLETION_INDEX": str(i), "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(SHARDS)
    ]  # fmt: skip
    for index, pod in enumerate(pods):
        log = pod.communicate(timeout=300)[0]
        assert pod.returncode == 0 and f"shard {index} of {SHARDS}" in log, log
    assert finish(dataset, out) == 0
    assert outputs(out) == unsharded


def writer_steps(dataset, scratch, index, *extra) -> int:
    """How many writer steps shard ``index`` takes (counted in this process, on a scratch output)."""
    with pytest.MonkeyPatch.context() as patch:
        counter = install(None, patch.setattr)
        run_shards(dataset, scratch, [index], *extra)
    return counter[0]


ENGINES = {
    # the flags: --shard_index, resubmitted with --resume
    "flags": lambda i: ({}, ("--shard_index", i), ("--shard_index", i, "--resume")),
    # a SLURM array task: --num_shards given, the index from SLURM_ARRAY_TASK_ID; resubmitted with --resume
    "slurm": lambda i: ({"SLURM_ARRAY_TASK_ID": str(i), "SLURM_ARRAY_TASK_COUNT": "1"}, (), ("--resume",)),
    # a Kubernetes pod: the same command each time, --resume in it
    "kubernetes": lambda i: ({"JOB_COMPLETION_INDEX": str(i)}, ("--resume",), ("--resume",)),
}
"""engine -> shard index -> (its variables, the first run's flags, the restarted run's flags)."""


@pytest.mark.parametrize(  # the default run kills a Kubernetes pod (--resume from its first run on); the others with -m slow
    "engine", [engine if engine == "kubernetes" else pytest.param(engine, marks=pytest.mark.slow) for engine in sorted(ENGINES)]
)
def test_a_shard_killed_at_a_random_moment_and_restarted_gives_the_same_bytes(dataset, unsharded, tmp_path, monkeypatch, capsys, engine):
    rng = np.random.default_rng([32, *map(ord, engine)])
    victim = int(rng.integers(SHARDS))
    environ, first, again = ENGINES[engine](victim)
    steps = writer_steps(dataset, tmp_path / "scratch", victim)
    kill_at = int(rng.integers(1, steps + 1))
    out = tmp_path / "out"
    run_shards(dataset, out, [i for i in range(SHARDS) if i != victim])
    killed = killed_run(command(dataset, out, "--num_shards", SHARDS, *first), kill_at, environ)
    assert killed.returncode == -signal.SIGKILL, (kill_at, steps, killed.stdout, killed.stderr)
    capsys.readouterr()
    assert finish(dataset, out) == 2  # refused while the shard is not done, naming it
    err = capsys.readouterr().err
    assert f"part_{victim:05d}_of_00008" in err and f"sbatch --array={victim} " in err, err
    with monkeypatch.context() as restarted:  # the same index
        for name, value in environ.items():
            restarted.setenv(name, value)
        assert main(command(dataset, out, "--num_shards", SHARDS, *again)) == 0
    assert finish(dataset, out) == 0
    assert outputs(out) == unsharded


@pytest.fixture(scope="module")
def ray_session():
    """A Ray instance of this test's own (address="local": never one another process started)."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(ROOT))  # the workers import neva_pack and the tests' kill switch from here
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        yield ray
        ray.shutdown()


@pytest.mark.slow  # starts a Ray instance; run_shard + finish_shards run in-process in the default run (above)
def test_the_ray_recipe_gives_the_bytes_of_a_run_without_shards(ray_session, dataset, unsharded, tmp_path):
    """docs/sharding.md's recipe: eight Ray tasks calling run_shard, then finish_shards."""
    from neva_pack import PreprocessConfig, finish_shards, run_shard

    ray = ray_session
    config = PreprocessConfig(**settings(dataset, tmp_path / "out"), resume=True)
    encode = ray.remote(max_retries=3)(run_shard)
    results = ray.get([encode.remote(config, index, SHARDS, progress=False) for index in range(SHARDS)])
    assert [f"shard {i} of {SHARDS}" in result.notes[0] for i, result in enumerate(results)] == [True] * SHARDS
    finish_shards(config, SHARDS, progress=False)
    assert outputs(tmp_path / "out") == unsharded


@pytest.mark.slow
def test_a_ray_task_killed_at_a_random_moment_is_retried_and_gives_the_same_bytes(ray_session, dataset, unsharded, tmp_path):
    from neva_pack import PreprocessConfig, finish_shards

    ray = ray_session
    rng = np.random.default_rng(3207)
    victim = int(rng.integers(SHARDS))
    steps = writer_steps(dataset, tmp_path / "scratch", victim, "--resume")
    kill_at = int(rng.integers(1, steps + 1))
    config = PreprocessConfig(**settings(dataset, tmp_path / "out"), resume=True)
    marker = tmp_path / "first_attempt.pid"
    encode = ray.remote(max_retries=3)(killed_once)
    pids = ray.get([encode.remote(config, i, SHARDS, kill_at if i == victim else 0, marker) for i in range(SHARDS)])
    assert int(marker.read_text()) != pids[victim]  # the first attempt was killed, a retry finished it
    finish_shards(config, SHARDS, progress=False)
    assert outputs(tmp_path / "out") == unsharded
