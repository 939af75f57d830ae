"""The files of an output and of its store are untrusted too: verify names a hostile meta, stats
or plan table (a device, a FIFO, a directory, not UTF-8, not an object) without reading it, and
--resume refuses a hostile store progress file with one line. The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from neva_pack.cli import main
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import GOOD, TOKENIZER, write_data


def _hostile_file(path: Path, kind: str) -> None:
    """Put something hostile where a file of the output was (same name)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "not_utf8":
        path.write_bytes(b"\xff\xfe{\x00\x80" * 64)
    elif kind == "not_an_object":
        path.write_text("[1, 2, 3]\n")


OUTPUT_HOSTILES = ("device", "fifo", "directory", "not_utf8", "not_an_object")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A complete output with its store kept: each test damages a copy."""
    root = tmp_path_factory.mktemp("published")
    data = write_data(root / "data.jsonl", GOOD, "jsonl")
    assert main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(SAMPLE_DATA / "images"),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(root / "out"), "--conv_template", "v1",
                 "--num_workers", "0"]) == 0  # fmt: skip
    return root


@pytest.mark.parametrize("kind", OUTPUT_HOSTILES)
@pytest.mark.parametrize("which", ["meta", "stats", "plan table"])
def test_verify_names_a_hostile_file_of_an_output_without_reading_it(published, tmp_path, capsys, which, kind):
    from neva_pack.files import paths

    out = tmp_path / "out"
    shutil.copytree(published / "out", out)
    prefix = paths.packed_prefix(out)
    target = {"meta": paths.meta_path(prefix), "stats": paths.stats_path_of(prefix), "plan table": paths.plan_path(prefix)}[which]
    _hostile_file(target, kind)
    capsys.readouterr()
    code = main(["verify", "--quiet", str(out), "--data_path", str(published / "data.jsonl")])
    said = capsys.readouterr()
    assert code in (1, 2) and "Traceback" not in said.err
    assert target.name in said.out + said.err, said


@pytest.mark.parametrize("kind", OUTPUT_HOSTILES)
def test_resume_refuses_a_hostile_store_progress_file_with_one_line(published, tmp_path, capsys, kind):
    from neva_pack.files import paths
    from neva_pack.sample_store import PROGRESS_FILE

    out = tmp_path / "out"
    shutil.copytree(published / "out", out, symlinks=True)
    paths.meta_path(paths.packed_prefix(out)).unlink()  # as if killed before publishing
    _hostile_file(paths.store_dir(out) / PROGRESS_FILE, kind)
    capsys.readouterr()
    run = run_on_output(published / "data.jsonl", out, "--resume")
    err = capsys.readouterr().err
    assert run == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert PROGRESS_FILE in err or "sample store" in err, err


def run_on_output(data: Path, out: Path, *extra) -> int:
    return main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(SAMPLE_DATA / "images"),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(out), "--conv_template", "v1",
                 "--num_workers", "0", *extra])  # fmt: skip
