"""A bad argument (a flag or an hparams value) fails before any work with one line naming it;
Ctrl-C and SIGTERM end a run with one line of resume advice, and no worker outlives it (SIGKILL
too). The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neva_pack.cli import main
from neva_pack.files import store_dir
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import GOOD, TOKENIZER, conversation, images, write_data  # noqa: F401 (images: the fixture)


def hparams(tmp_path, body: str) -> str:
    path = tmp_path / "hparams.yaml"
    path.write_text(body)
    return str(path)


BAD_ARGUMENTS = {
    "scalar crop_size": (lambda t: ("--hparams_file", hparams(t, "model:\n  mm_cfg:\n    vision_encoder:\n      crop_size: 336\n")),
                         "hparams model.mm_cfg.vision_encoder.crop_size 336: expected a list of 2 integers (height, width), got int"),
    "list image_folder": (lambda t: ("--hparams_file", hparams(t, "model:\n  data:\n    image_folder: [a, b]\n")),
                          "--image_folder (or hparams model.data.image_folder) ['a', 'b']: expected a path, got list"),
    "string sequence length": (lambda t: ("--hparams_file", hparams(t, "model:\n  encoder_seq_length: '4096'\n")),
                               "--max_seq_length (or hparams model.encoder_seq_length) '4096': expected an integer, got str"),
    "negative seed": (lambda t: ("--seed=-1",), "--seed -1: must be between 0 and 2**63 - 1"),
    "huge seed": (lambda t: ("--seed", str(2**64)), "--seed 18446744073709551616: must be between 0 and 2**63 - 1"),
    "huge capacity": (lambda t: ("--max_seq_length=2147483648",), "--max_seq_length 2147483648: must be between 2 and 16,777,216"),
    "a thousand workers": (lambda t: ("--num_workers", "1000"), "--num_workers 1000: must be between 0 and"),
    "depth beyond the parser": (lambda t: ("--max_record_depth", "100000"), "--max_record_depth 100000: at most 500"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_fails_before_any_work_with_one_line(tmp_path, capsys, images, case):
    make, message = BAD_ARGUMENTS[case]
    data = write_data(tmp_path / "data.jsonl", GOOD, "jsonl")
    out = tmp_path / "out"
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path", str(TOKENIZER),
                 "--output_dir", str(out), *make(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_a_list_data_path_in_hparams_fails_with_one_line(tmp_path, capsys):
    path = hparams(tmp_path, "model:\n  data:\n    data_path: [a.json, b.json]\n")
    code = main(["preprocess", "--hparams_file", path, "--tokenizer_path", str(TOKENIZER), "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err == "neva-pack: error: --data_path (or hparams model.data.data_path) ['a.json', 'b.json']: expected a path, got list\n"


@pytest.mark.parametrize("command", ["stats", "plan"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_global_batch_size_that_counts_nothing_fails_with_one_line(tmp_path, capsys, command, value):
    """0 or -5 advised a packed GBS of 1 (stats) or filled the GBS column with it (plan)."""
    extra = ["--pack_sizes", "2048"] if command == "plan" else []
    with pytest.raises(SystemExit) as exited:
        main([command, str(tmp_path), *extra, "--global_batch_size", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert f"argument --global_batch_size: {value}: must be a positive integer" in err


def children_of(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _as_in_a_terminal() -> None:
    """The run starts as a terminal's foreground job does, Ctrl-C not ignored: a job started in the
    background by a non-interactive shell (``cmd &``, as some CI runners do) inherits SIGINT ignored,
    and Python then never raises KeyboardInterrupt (the run ends normally, exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "signum, code, word",
    [(signal.SIGINT, 130, "interrupted"), pytest.param(signal.SIGTERM, 143, "terminated", marks=pytest.mark.slow),
     (signal.SIGKILL, -signal.SIGKILL, None)],
)  # SIGTERM unwinds the run as Ctrl-C does (an exception from the handler): -m slow
def test_a_signal_exits_with_one_line_resume_advice_and_no_orphans(tmp_path, signum, code, word):
    slow = {"id": "slow", "image": ["chelsea.jpg"] * 4,
            "conversations": conversation("<image>" * 4 + "\nWhat?", "Cats.")}  # fmt: skip
    data = write_data(tmp_path / "data.jsonl", [slow] * 400, "jsonl")
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "neva_pack.cli", "preprocess", "--quiet", "--data_path", str(data), "--image_folder",
         str(SAMPLE_DATA / "images"), "--tokenizer_path", str(TOKENIZER), "--output_dir", str(out), "--num_workers", "2"],
        stderr=subprocess.PIPE, text=True, preexec_fn=_as_in_a_terminal,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    workers: set[int] = set()
    rows = store_dir(out) / "shard_00000.rows"  # records stored: the run is past its start-up (the workers' fork)
    while len(workers) < 2 or not (rows.exists() and rows.stat().st_size > 0):
        assert process.poll() is None and time.monotonic() < deadline
        workers |= children_of(process.pid)
        time.sleep(0.05)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code
    if word is not None:  # SIGKILL leaves no word; the workers die with the main process all the same
        assert err.count("\n") == 1 and f"neva-pack: {word};" in err and "--resume" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if alive(w)]
