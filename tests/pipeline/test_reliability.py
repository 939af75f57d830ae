"""Resume after SIGKILL, atomic outputs, checksums + verify, determinism, skip policy, faults.

The kill tests run the real command in a subprocess and SIGKILL it when it has reached a
stage (seen from the files it writes), then resume and compare bytes with an uninterrupted run.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neva_pack.files import (
    bin_path, idx_path, meta_path, packed_prefix, paths, plan_path, relative_name, skipped_path, stats_path
)
from neva_pack.cli import main
from neva_pack.sample_store import PROGRESS_FILE
from tests.conftest import SAMPLE_DATA

RECORDS = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory):
    """120 records (the sample records six times): long enough to be killed mid-stage."""
    root = tmp_path_factory.mktemp("big")
    path = root / "records.json"
    path.write_text(json.dumps(RECORDS * 6))
    return path


def command(data_path, output_dir, *extra):
    return [
        "--data_path", str(data_path), "--image_folder", str(SAMPLE_DATA / "images"),
        "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--output_dir", str(output_dir),
        "--conv_template", "v1", "--max_seq_length", "2048", "--packing_algorithm", "near_optimal",
        "--seed", "3", "--checkpoint_every", "10", "--num_workers", "0", "--quiet", *extra,
    ]  # fmt: skip


def run_cli(args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neva_pack.cli", "preprocess", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def uninterrupted(big_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    assert main(["preprocess", *command(big_dataset, out)]) == 0
    return out


def output_bytes(output_dir: Path) -> tuple[bytes, bytes]:
    prefix = paths.packed_prefix(output_dir)
    return bin_path(prefix).read_bytes(), idx_path(prefix).read_bytes()


def progress(output_dir: Path) -> dict:
    try:
        return json.loads((paths.store_dir(output_dir) / PROGRESS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


STAGES = {  # killed at packing (the store complete, nothing written) resumes as at writing does, less the checkpoint: -m slow
    "encoding": lambda out: len(progress(out).get("shards", [])) >= 3 and not progress(out).get("complete"),
    "packing": lambda out: progress(out).get("complete") is True,
    "writing": lambda out: paths.checkpoint_paths(paths.packed_prefix(out))[0].exists(),
}


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s == "packing" else s for s in sorted(STAGES)])
def test_sigkill_then_resume_gives_the_same_bytes(big_dataset, uninterrupted, tmp_path, stage):
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "neva_pack.cli", "preprocess", *command(big_dataset, out)])
    deadline = time.monotonic() + 120
    while not STAGES[stage](out):
        assert process.poll() is None, f"the run ended before reaching {stage}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    # a killed run never leaves the pair at its final name, nor a meta
    assert not meta_path(packed_prefix(out)).exists()
    assert not (bin_path(packed_prefix(out)).exists() and idx_path(packed_prefix(out)).exists())
    assert main(["preprocess", *command(big_dataset, out)]) == 2  # not empty: refused without --resume
    assert main(["preprocess", *command(big_dataset, out, "--resume")]) == 0
    assert output_bytes(out) == output_bytes(uninterrupted)
    assert skipped_path(out).read_bytes() == skipped_path(uninterrupted).read_bytes()


def test_resume_with_other_settings_is_refused(uninterrupted, big_dataset, tmp_path, capsys):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    meta_path(packed_prefix(out)).unlink()  # as if the run had died at the very end
    assert main(["preprocess", *command(big_dataset, out, "--resume", "--image_aspect_ratio", "pad")]) == 2
    assert "--resume: the output was started with image_aspect_ratio='square'" in capsys.readouterr().err
    assert (paths.store_dir(out) / PROGRESS_FILE).is_file()


def test_refusing_a_non_empty_output_dir_touches_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code = main(["preprocess", *command(SAMPLE_DATA / "llava_sample.json", out)])
    assert code == 2 and "not empty (notes.txt)" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_overwrite_removes_only_what_a_run_writes(uninterrupted, big_dataset, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    (out / "notes.txt").write_text("mine")
    assert main(["preprocess", *command(big_dataset, out, "--overwrite")]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert output_bytes(out) == output_bytes(uninterrupted)


# ---------------------------------------------------------------------------------------------
# Checksums and verify


def verify(capsys, *args) -> tuple[int, str]:
    code = main(["verify", "--quiet", *map(str, args)])
    return code, capsys.readouterr().out


def test_verify_passes_on_a_good_output_and_accounts_for_every_record(uninterrupted, big_dataset, capsys):
    code, out = verify(capsys, uninterrupted, "--data_path", big_dataset)
    assert code == 0 and out.startswith("OK: checked 5 files") and "120 records" in out
    meta = json.loads(meta_path(packed_prefix(uninterrupted)).read_text())
    assert meta["checksums"]["algorithm"] == "xxh3_128"
    prefix = packed_prefix(uninterrupted)
    checksummed = (bin_path(prefix), idx_path(prefix), plan_path(prefix), skipped_path(uninterrupted), stats_path(uninterrupted))
    assert sorted(meta["checksums"]["files"]) == sorted(relative_name(uninterrupted, path) for path in checksummed)


@pytest.mark.parametrize("path_of", [bin_path, idx_path])
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_a_single_flipped_byte_is_caught(uninterrupted, tmp_path, capsys, path_of, where):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    path = path_of(packed_prefix(out))
    name = path.name
    data = bytearray(path.read_bytes())
    position = min(int(len(data) * where), len(data) - 1)
    data[position] ^= 0x01
    path.write_bytes(bytes(data))
    code, report = verify(capsys, out)
    assert code == 1
    assert f"FAIL {name}: checksum mismatch" in report


def test_verify_finds_records_neither_packed_nor_skipped(uninterrupted, big_dataset, tmp_path, capsys):
    more = tmp_path / "more.json"
    more.write_text(json.dumps(RECORDS * 6 + RECORDS[:2]))
    code, report = verify(capsys, uninterrupted, "--data_path", more)
    assert code == 1 and "2 input record(s) neither packed nor skipped (first: [120, 121])" in report


def test_verify_checks_invariants_beyond_checksums(uninterrupted, tmp_path, capsys):
    """A wrong label written consistently (checksums recomputed) is still caught."""
    import shutil

    import numpy as np

    from neva_pack.files import paths
    from neva_pack.files import file_checksum
    from neva_pack.formats import nemo
    from neva_pack.formats import read_meta

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    reader = nemo.Reader(packed_prefix(out))
    first, _ = reader.items_of(0)
    label_offset = int(reader.dataset.index.sequence_pointers[first + nemo.ITEM_LABELS])
    tokens = reader.pack(0).tokens
    reader.close()
    data = bytearray(bin_path(packed_prefix(out)).read_bytes())
    data[label_offset : label_offset + 4] = np.float32(tokens[0] + 1).tobytes()  # label 0 := not the next token
    bin_path(packed_prefix(out)).write_bytes(bytes(data))
    meta = read_meta(meta_path(packed_prefix(out)))
    checksums = {**meta.checksums, relative_name(out, bin_path(packed_prefix(out))): file_checksum(bin_path(packed_prefix(out)))}
    paths.write_json_atomic(meta_path(packed_prefix(out)), meta.replace(checksums=checksums).to_json())
    code, report = verify(capsys, out)
    assert code == 1 and "pack 0: label at position 0" in report


def test_verify_reports_checksums_first_and_counts_every_problem(uninterrupted, tmp_path, monkeypatch):
    """The files are hashed while the reader checks the packs: the report keeps its order
    (checksums, then packs) and counts the problems it does not list."""
    import shutil

    import numpy as np

    import neva_pack.commands.verification as verification
    from neva_pack.formats import nemo

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    reader = nemo.Reader(packed_prefix(out))
    packs = len(reader)
    data = bytearray(bin_path(packed_prefix(out)).read_bytes())
    wrong = [int(reader.pack(p).tokens[0]) + 1 for p in range(packs)]
    for p in range(packs):  # label 0 of every pack := not the next token (checksum left stale)
        first, _ = reader.items_of(p)
        offset = int(reader.dataset.index.sequence_pointers[first + nemo.ITEM_LABELS])
        data[offset : offset + 4] = np.float32(wrong[p]).tobytes()
    reader.close()
    bin_path(packed_prefix(out)).write_bytes(bytes(data))
    monkeypatch.setattr(verification, "MAX_REPORTED", 2)
    result = verification.verify(out, progress=False)
    assert packs > 2 and result.problem_count == 1 + packs
    assert result.problems == [
        f"{bin_path(packed_prefix(out)).name}: checksum mismatch (the file was changed or corrupted)",
        f"pack 0: label at position 0 is {wrong[0]}, neither the next token nor -1",
    ]
    assert list(result.checked) == ["files", "packs", "samples"]


def test_verify_stops_at_a_structure_it_cannot_read(uninterrupted, tmp_path, monkeypatch):
    """The structure is checked beside the packs, yet reported as if first: when it cannot be
    read, nothing the pack checks found is reported, and the packs do not count as checked."""
    import shutil

    import neva_pack.commands.verification as verification
    from neva_pack.formats import nemo

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)

    def unreadable(reader, result):
        result.add("pack 0: a structure problem")
        raise OSError("disk gone")

    monkeypatch.setattr(nemo.FORMAT, "check", unreadable)  # the registry's nemo format object
    monkeypatch.setattr(verification, "verify_packs", lambda *args, **kwargs: args[3].add("a pack problem"))
    result = verification.verify(out, progress=False)
    assert result.problems == ["pack 0: a structure problem", "cannot read the packed dataset: OSError: disk gone"]
    assert list(result.checked) == ["files"]


def test_verify_of_something_that_is_not_an_output(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "not a complete neva_pack output" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Determinism, skip policy, faults


@pytest.mark.slow  # 0 vs 2 workers and a repeated run: pipeline/test_end_to_end.py (default run)
def test_same_bytes_for_0_1_and_4_workers_and_repeated_runs(big_dataset, uninterrupted, tmp_path):
    for workers in ("1", "4", "0"):
        out = tmp_path / f"w{workers}"
        args = command(big_dataset, out)
        args[args.index("--num_workers") + 1] = workers
        assert main(["preprocess", *args]) == 0
        assert output_bytes(out) == output_bytes(uninterrupted)


def test_max_skip_fraction_aborts_early_with_the_report_so_far(tmp_path, capsys):
    bad = {"image": "missing.jpg", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}
    good = RECORDS[14]  # text-only
    data = tmp_path / "mostly_bad.jsonl"
    data.write_text("".join(json.dumps(bad if i % 4 else good) + "\n" for i in range(3000)))
    out = tmp_path / "out"
    code = main(["preprocess", *command(data, out)])
    err = capsys.readouterr().err
    assert code == 2 and "750 of the first 1000 records were skipped (> --max_skip_fraction 0.5)" in err
    assert err.count("\n") == 1 and "750 missing_image (first: missing.jpg" in err  # the cause, without opening the list
    lines = skipped_path(out).read_text().splitlines()
    assert len(lines) == 750 and json.loads(lines[0])["reason"] == "missing_image"


def test_the_skip_stop_names_the_commonest_reasons_with_their_counts(tmp_path, capsys):
    """A first run without --image_folder: the line says why, not only where the reasons are listed."""
    args = ["preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"), "--tokenizer_path",
            str(SAMPLE_DATA / "tokenizer.model"), "--output_dir", str(tmp_path / "out"), "--conv_template", "v1",
            "--num_workers", "0"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "16 of the first 20 records were skipped" in err and "16 missing_image (first: " in err
    assert "no --image_folder was given" in err and str(tmp_path / "out" / "skipped.jsonl") in err


def test_unreadable_tar_member_is_a_counted_skip(tmp_path, capsys):
    import io
    import tarfile

    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in (("ok.jpg", (SAMPLE_DATA / "images" / "coffee.jpg").read_bytes()), ("bad.jpg", b"garbage")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    record = {"conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Coffee."}]}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({**record, "image": "ok.jpg"}) + "\n" + json.dumps({**record, "image": "bad.jpg"}) + "\n")
    args = command(data, tmp_path / "out", "--max_skip_fraction", "1")
    args[args.index("--image_folder") + 1] = str(archive)
    assert main(["preprocess", *args]) == 0
    skipped = json.loads(skipped_path(tmp_path / "out").read_text())
    assert skipped["index"] == 1 and skipped["reason"] == "unreadable_image"


FAULTS = {
    "output dir under a file": lambda tmp: ["--output_dir", str(_file(tmp) / "out")],
    "output dir not writable": lambda tmp: ["--output_dir", "/proc/neva_pack_out"],
    "tokenizer that is not one": lambda tmp: ["--tokenizer_path", str(_file(tmp))],
    "hparams with an unknown key": lambda tmp: ["--hparams_file", str(_yaml(tmp, "model:\n  data:\n    conv_templat: v1\n"))],
    "hparams that is not YAML": lambda tmp: ["--hparams_file", str(_yaml(tmp, "model: [unclosed\n"))],
    "image folder that is a file": lambda tmp: ["--image_folder", str(_file(tmp))],
}


def _file(tmp: Path) -> Path:
    path = tmp / "plain.txt"
    path.write_text("not what you think")
    return path


def _yaml(tmp: Path, text: str) -> Path:
    path = tmp / "neva.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_faults_give_one_line_and_no_traceback(tmp_path, capsys, fault):
    args = command(SAMPLE_DATA / "llava_sample.json", tmp_path / "o") + FAULTS[fault](tmp_path)
    assert main(["preprocess", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("neva-pack: error: ")
    if fault == "hparams with an unknown key":
        assert "unknown key model.data.conv_templat (did you mean conv_template?)" in err


def test_no_traceback_unless_debug(tmp_path):
    args = command(SAMPLE_DATA / "llava_sample.json", tmp_path / "o") + FAULTS["hparams with an unknown key"](tmp_path)
    plain = run_cli(args)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and plain.stderr.count("\n") == 1
    debug = subprocess.run(
        [sys.executable, "-m", "neva_pack.cli", "--debug", "preprocess", *args], capture_output=True, text=True
    )
    assert "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_permission_denied_output_dir(tmp_path, capsys, monkeypatch):
    """An output directory the user may not create is one line naming it, exit 2, nothing made. The
    file system's refusal (EACCES from mkdir) is given by os.mkdir itself, for every user: root
    writes through permission bits (a 0o500 folder stops no one in CI, which runs as root)."""
    locked = tmp_path / "locked"
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).is_relative_to(locked):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    code = main(["preprocess", *command(SAMPLE_DATA / "llava_sample.json", locked / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--output_dir {locked / 'out'}: cannot write (Permission denied)" in err, err
    assert not locked.exists()
