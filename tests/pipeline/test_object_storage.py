"""Runs on object storage: --data_path, --image_folder (a prefix or a .tar) and --output_dir as s3://
URLs on a real S3-protocol server (moto's, on loopback; s3fs talks HTTP to it, nothing is mocked),
credentials and endpoint from the environment only.

- A single run and a 4-shard run give the bytes of the POSIX run (the packs, the plan table, and the
  skipped lines, whose detail names the image folder where it is).
- A shard killed (SIGKILL) mid-way on one "pod" and run again on another (an empty staging disk)
  continues from the last segment committed in the bucket.
- The bucket never holds an output that looks complete before it is: verify and stats on an
  unfinished s3:// output refuse it; after the final step they pass.
- Two runs given the same shard at once: the second is refused in one line naming the first (the part's
  lock object in the bucket), ``shards status`` shows the shard running, and once the first is killed
  the shard is taken over and resumed.
- No output of a failing run shows a credential."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neva_pack.cli import main
from tests.conftest import SAMPLE_DATA
from tests.object_storage import BUCKET, SECRET, s3_server
from tests.shard_faults import (
    ROOT,
    command,
    install,
    killed_run,
    outputs,
    paused_run,
    write_dataset,
)

IMAGES = SAMPLE_DATA / "images"
SHARDS = 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "records.json")


@pytest.fixture(scope="module")
def server(tmp_path_factory, dataset):
    scratch = tmp_path_factory.mktemp("s3")
    with s3_server(scratch / "staging") as server:
        server.put_tree(IMAGES, f"{BUCKET}/images")
        server.put_tar(IMAGES, f"{BUCKET}/archives/images.tar", scratch)
        server.put_file(dataset, f"{BUCKET}/in/records.json")
        yield server


POSIX_STEPS = []
"""The writer's steps of the POSIX run (``shard_faults.install``): what a run from the start takes."""


@pytest.fixture(scope="module")
def posix(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("posix") / "out"
    with pytest.MonkeyPatch.context() as patch:
        counter = install(None, patch=patch.setattr)
        assert main(command(dataset, out)) == 0
    POSIX_STEPS.append(counter[0])
    return outputs(out)


DATA = f"s3://{BUCKET}/in/records.json"


def remote_command(output: str, images: str = f"s3://{BUCKET}/images", *extra) -> list[str]:
    args = command(DATA, output, *extra)
    args[args.index("--image_folder") + 1] = images
    return args


def fetched(server, url: str, into) -> dict[str, bytes]:
    """The output's files that must match, as the bucket holds them."""
    server.fs().invalidate_cache()
    server.fs().get(url.removeprefix("s3://") + "/", str(into), recursive=True)
    return outputs(into)


def same_as_posix(posix: dict[str, bytes], remote: dict[str, bytes], images: str) -> None:
    """The packs and the plan table byte for byte; the skipped lines too, but for the detail of a missing
    image, which names the image folder where it is (a POSIX run from another folder differs there too)."""
    assert remote.keys() == posix.keys()
    for name, expected_bytes in posix.items():
        if name != "skipped.jsonl":
            assert remote[name] == expected_bytes, name
    lines = [json.loads(line) for line in remote["skipped.jsonl"].splitlines()]
    expected = [json.loads(line) for line in posix["skipped.jsonl"].splitlines()]
    assert [{**line, "detail": None} for line in lines] == [{**line, "detail": None} for line in expected]
    assert all(line["detail"].startswith("no_such.jpg: not ") and line["detail"].endswith(images) for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("images", [f"s3://{BUCKET}/images", f"s3://{BUCKET}/archives/images.tar"])
def test_a_run_on_s3_gives_the_bytes_of_the_posix_run(server, posix, images, tmp_path, capsys):
    out = f"s3://{BUCKET}/single_{images.rsplit('/', 1)[-1].replace('.', '_')}"
    assert main(remote_command(out, images)) == 0
    printed = capsys.readouterr().out
    assert f"{out}/packed_seq_dataset" in printed and str(server.environ["NEVA_PACK_STAGING_DIR"]) not in printed
    same_as_posix(posix, fetched(server, out, tmp_path / "got"), images)
    held = server.listing(out)
    assert not [name for name in held if name.endswith((".lock", ".tmp"))], held
    staging = Path(server.environ["NEVA_PACK_STAGING_DIR"])
    assert not list(staging.glob("outputs/*/run-*"))  # the run's staging directory is gone with it
    assert main(["verify", out, "--data_path", DATA]) == 0
    assert main(["stats", out]) == 0
    assert SECRET not in capsys.readouterr().out


@pytest.mark.slow
def test_four_shards_on_s3_give_the_bytes_of_the_posix_run_and_look_complete_only_at_the_end(server, posix, tmp_path, capsys):
    out = f"s3://{BUCKET}/sharded"
    for index in (2, 0, 3, 1):
        assert main(remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS, "--shard_index", index)) == 0
    assert main(["shards", "status", out]) == 0  # every part done, read from the bucket
    assert f"{SHARDS} done" in capsys.readouterr().out
    assert main(["verify", out]) != 0  # parts only: nothing published yet
    assert main(["stats", out]) != 0
    server.fs().pipe(f"{BUCKET}/sharded/NOTES.txt", b"a user's object beside the output")
    capsys.readouterr()
    assert main(remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS)) == 2  # as a local directory
    assert f"--output_dir {out}: not empty (NOTES.txt)" in capsys.readouterr().err
    assert not [name for name in server.listing(out) if name.endswith(".lock")]  # released on the refusal too
    assert main(remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS, "--resume")) == 0
    got = tmp_path / "got"
    same_as_posix(posix, fetched(server, out, got), f"s3://{BUCKET}/images")
    assert (got / "NOTES.txt").read_bytes() == b"a user's object beside the output"  # never copied, never deleted
    assert not [name for name in server.listing(out) if "part_" in name]  # joined, then removed from the bucket
    assert main(["verify", out]) == 0


@pytest.mark.slow
def test_a_shard_killed_midway_resumes_from_its_last_segment_in_the_bucket(server, posix, tmp_path, monkeypatch):
    out = f"s3://{BUCKET}/killed"
    shard = remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS, "--shard_index", 1)
    part = f"{out}/packed_seq_dataset/part_00001_of_00004"
    counter = install(None, patch=monkeypatch.setattr)  # the writer's steps of an uninterrupted shard
    assert main([*shard, "--overwrite"]) == 0
    whole = counter[0]
    monkeypatch.undo()
    server.fs().rm(part.removeprefix("s3://"), recursive=True)
    kill_at = int(np.random.default_rng(32).integers(whole // 3, 2 * whole // 3))
    killed = killed_run(shard, kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    progress = json.loads(server.read(f"{part}/progress.json"))
    committed = progress["shards"]
    assert committed and not progress["complete"]  # committed segments are in the bucket, the part is not done
    shutil.rmtree(server.environ["NEVA_PACK_STAGING_DIR"])  # the restarted pod has an empty disk
    counter = install(None, patch=monkeypatch.setattr)
    assert main([*shard, "--resume"]) == 0
    assert 0 < counter[0] < whole  # continued, not started again
    monkeypatch.undo()
    resumed = json.loads(server.read(f"{part}/progress.json"))
    assert resumed["complete"] and resumed["shards"][: len(committed)] == committed
    for index in (0, 2, 3):
        assert main(remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS, "--shard_index", index)) == 0
    assert main(remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS)) == 0
    same_as_posix(posix, fetched(server, out, tmp_path / "got"), f"s3://{BUCKET}/images")


@pytest.mark.slow
def test_a_second_run_of_the_same_shard_is_refused_naming_the_first_which_status_shows_running(server, tmp_path, capsys):
    import socket
    import time

    out = f"s3://{BUCKET}/contended"
    shard = remote_command(out, f"s3://{BUCKET}/images", "--num_shards", SHARDS, "--shard_index", 2)
    marker = tmp_path / "paused"
    first = paused_run(shard, 6, marker)  # a pod caught mid-way, after its first commits
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-2000:] if first.stderr else ""
            time.sleep(0.1)
        holder = f"pid {first.pid} on {socket.gethostname()}, started "
        capsys.readouterr()
        assert main([*shard, "--resume"]) == 2
        refused = capsys.readouterr().err
        assert refused.count("\n") == 1 and f"--output_dir {out} (shard 2): in use by another neva-pack run ({holder}" in refused
        assert main(["shards", "status", out, "--json"]) == 1
        states = {shard["index"]: shard for shard in json.loads(capsys.readouterr().out)["shards"]}
        assert states[2]["state"] == "running" and states[2]["detail"].startswith(holder), states[2]
        assert {states[i]["state"] for i in (0, 1, 3)} == {"missing"}
    finally:
        first.kill()
        first.wait()
    assert main(["shards", "status", out, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["shards"][2]["state"] == "stale"  # its holder is gone
    assert main([*shard, "--resume"]) == 0  # a dead holder's lock (this host, its pid gone) is taken over
    assert not [name for name in server.listing(out) if name.endswith(".lock")]  # released at the end


@pytest.mark.slow
def test_a_run_killed_midway_resumes_from_the_bucket_once_its_input_is_proved_the_same(server, posix, dataset, tmp_path,
                                                                                        capsys, monkeypatch):  # fmt: skip
    """Killed (SIGKILL) while encoding: the bucket holds committed segments and no meta (verify and stats
    refuse it). On an empty disk, --resume with an input object edited in place (same size) is refused;
    with the input as it was, it continues from the bucket's last commit and gives the POSIX bytes."""
    out = f"s3://{BUCKET}/killed_single"
    kill_at = int(np.random.default_rng(3).integers(30, 60))
    killed = killed_run(remote_command(out), kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    progress = json.loads(server.read(f"{out}/packed_seq_dataset/progress.json"))
    assert progress["shards"] and not progress["complete"]
    assert not [name for name in server.listing(out) if name.endswith(".meta.json")]
    capsys.readouterr()
    assert main(["verify", out]) != 0 and main(["stats", out]) != 0
    from neva_pack import open_packed
    from neva_pack.core import InputError

    server.fs().get(out.removeprefix("s3://") + "/", str(tmp_path / "copy"), recursive=True)  # e.g. aws s3 sync
    with pytest.raises(InputError, match="not a complete neva_pack output"):
        open_packed(tmp_path / "copy")
    shutil.rmtree(server.environ["NEVA_PACK_STAGING_DIR"])
    original = dataset.read_bytes()
    edited = original.replace(b"What", b"Whaz", 1)
    assert len(edited) == len(original) and edited != original
    server.fs().pipe(DATA.removeprefix("s3://"), edited)
    assert main([*remote_command(out), "--resume"]) == 2
    assert "built from other content" in capsys.readouterr().err
    server.fs().pipe(DATA.removeprefix("s3://"), original)
    shutil.rmtree(server.environ["NEVA_PACK_STAGING_DIR"])
    counter = install(None, patch=monkeypatch.setattr)
    assert main([*remote_command(out), "--resume"]) == 0
    resumed_steps = counter[0]
    monkeypatch.undo()
    assert 0 < resumed_steps < POSIX_STEPS[0] - len(progress["shards"])  # the committed segments were not redone
    resumed = json.loads(server.read(f"{out}/packed_seq_dataset/progress.json"))
    assert resumed["shards"][: len(progress["shards"])] == progress["shards"]
    same_as_posix(posix, fetched(server, out, tmp_path / "got"), f"s3://{BUCKET}/images")
    assert main(["verify", out, "--data_path", DATA]) == 0


@pytest.mark.slow
def test_a_failing_run_never_shows_a_credential(server, dataset, tmp_path):
    """The endpoint refuses connections and its URL carries the secret (as a careless config might), so
    the storage client's error quotes it: the run fails in one line, and no output shows the secret."""
    env = {**server.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:9/{SECRET}", "AWS_MAX_ATTEMPTS": "1",
           "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}  # fmt: skip
    args = command(dataset, f"s3://{BUCKET}/never")
    ran = subprocess.run([sys.executable, "-m", "neva_pack.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert ran.stderr.count("\n") == 1 and "s3://neva-bucket/never" in ran.stderr, ran.stderr
    assert SECRET not in ran.stdout + ran.stderr and "***" in ran.stderr  # the endpoint is named, its secret blanked


def test_a_path_flag_that_cannot_be_remote_is_refused_in_one_line(dataset, tmp_path):
    from neva_pack import PreprocessConfig
    from neva_pack.core import ConfigError

    with pytest.raises(ConfigError, match=r"--tokenizer_path .*s3://bucket/tok.model: a local path is needed here"):
        PreprocessConfig(data_path=DATA, tokenizer_path="s3://bucket/tok.model", output_dir=tmp_path / "out")
