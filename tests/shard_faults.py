"""What the shard engine tests share: a small dataset, the command of its run, the bytes to compare, and
a kill switch that SIGKILLs the process at a chosen step of a shard's encoding.

The kill switch counts the sample store writer's steps (a batch appended, a segment closed, a commit,
the progress file written, the part finished) and kills the process before the n-th: a kill between
a segment's files and the progress file that commits them, or in the middle of a batch, as a node lost
at any moment would. The step is drawn from a seeded generator, so the test is the same every time.

    python -m tests.shard_faults ARGS...    the neva-pack command line, killed before step $KILL_AT_STEP
                                            (or, with $PAUSE_AT_STEP=N:FILE, paused there: FILE written)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

from tests.conftest import SAMPLE_DATA

ROOT = Path(__file__).resolve().parent.parent
RECORDS = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
MISSING_IMAGE = {"id": "bad", "image": "no_such.jpg", "conversations": [
    {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Nothing."}]}  # fmt: skip
KILL_VARIABLE = "KILL_AT_STEP"
PAUSE_VARIABLE = "PAUSE_AT_STEP"
STEPS = (
    ("neva_pack.sample_store.writer", "SampleStoreWriter", "append_stored"),
    ("neva_pack.sample_store.writer", "_OpenSegment", "close"),
    ("neva_pack.sample_store.writer", "SampleStoreWriter", "commit"),
    ("neva_pack.sample_store.writer", "SampleStoreWriter", "_write_progress"),
    ("neva_pack.sample_store.writer", "SampleStoreWriter", "finish"),
)
"""The writer's steps the kill switch counts (module, class, method)."""


def write_dataset(path: Path) -> Path:
    """41 records: the sample records twice (images and text-only) and one skipped in the middle."""
    path.write_text(json.dumps(RECORDS + [MISSING_IMAGE] + RECORDS))
    return path


def settings(data_path, output_dir) -> dict:
    """The run's settings by name (``PreprocessConfig(**settings)``), as ``command`` gives them."""
    return {
        "data_path": data_path, "image_folder": SAMPLE_DATA / "images", "tokenizer_path": SAMPLE_DATA / "tokenizer.model",
        "output_dir": output_dir, "conv_template": "v1", "hf_vision_encoder": "openai/clip-vit-base-patch32",
        "max_seq_length": 1024, "packing_algorithm": "near_optimal", "checkpoint_every": 2, "num_workers": 0,
    }  # fmt: skip


def command(data_path, output_dir, *extra) -> list[str]:
    """``neva-pack preprocess`` with ``settings``' flags (checkpoints every 2 records: a shard of 5 has
    several commits to be killed between)."""
    flags = []
    for name, value in settings(data_path, output_dir).items():
        flags += [f"--{name}", str(value)]
    return ["preprocess", *flags, "--quiet", *map(str, extra)]


def outputs(output_dir: Path) -> dict[str, bytes]:
    """The files a sharded run must give byte for byte: the packs (.bin, .idx), the plan table and the
    skipped lines."""
    from neva_pack.files import bin_path, idx_path, packed_prefix, plan_path, skipped_path

    prefix = packed_prefix(output_dir)
    files = (bin_path(prefix), idx_path(prefix), plan_path(prefix), skipped_path(output_dir))
    return {path.name: path.read_bytes() for path in files}


def install(kill_at: int | None, patch=setattr, pause: tuple[int, Path] | None = None) -> list[int]:
    """Count the writer's steps (the returned list holds the count) and, with ``kill_at``, SIGKILL this
    process before step ``kill_at`` (1-based). ``patch``: how to replace a method (``monkeypatch.setattr``
    to count in a test's own process). ``pause`` (step, file): before that step, write the file and sleep
    (a run caught in the middle, until the test kills it)."""
    counter = [0]
    for module, owner_name, name in STEPS:
        owner = getattr(import_module(module), owner_name)
        original = getattr(owner, name)

        def step(*args, _original=original, **kwargs):
            counter[0] += 1
            if counter[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if pause is not None and counter[0] == pause[0]:
                Path(pause[1]).write_text(str(os.getpid()))
                time.sleep(600)
            return _original(*args, **kwargs)

        patch(owner, name, step)
    return counter


def killed_run(args: list[str], kill_at: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command line in a child process (with ``env`` added to this one's), killed before step
    ``kill_at``."""
    environ = {**os.environ, **(env or {}), KILL_VARIABLE: str(kill_at), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tests.shard_faults", *args], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def paused_run(args: list[str], pause_at: int, marker: Path) -> subprocess.Popen:
    """The command line in a child process, paused before step ``pause_at`` (``marker`` is written
    then); the caller kills it."""
    environ = {**os.environ, PAUSE_VARIABLE: f"{pause_at}:{marker}", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.shard_faults", *args], env=environ, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def killed_once(config, index: int, num_shards: int, kill_at: int, marker: Path) -> int:
    """A Ray task: ``run_shard``, killed before step ``kill_at`` the first time (``marker`` records the
    pid of that first attempt); Ray retries the task in a new worker, which runs it whole. Returns the
    pid of the worker that finished it."""
    from neva_pack import run_shard

    marker = Path(marker)
    if kill_at and not marker.exists():
        marker.write_text(str(os.getpid()))
        install(kill_at)
    run_shard(config, index, num_shards, progress=False)
    return os.getpid()


def main() -> int:
    from neva_pack.cli import main as cli

    if PAUSE_VARIABLE in os.environ:
        step, marker = os.environ[PAUSE_VARIABLE].split(":", 1)
        install(None, pause=(int(step), Path(marker)))
    else:
        install(int(os.environ[KILL_VARIABLE]))
    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
