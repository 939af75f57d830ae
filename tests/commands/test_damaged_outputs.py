"""A damaged output given to verify, stats or convert: one line naming the file, never a traceback,
never a "successful" result built from the damage.

Each damage is applied to a copy of a good output (built once per module). "stale" keeps the meta
as written (its checksums no longer match: convert and stats refuse on them); "restamped" rewrites
the meta's checksums over the damaged files, as if the damage had been written so (then only the
parsing of each file can tell: it must still refuse with one line).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from neva_pack.files import bin_path, file_checksum, idx_path, packed_prefix, paths, read_index
from neva_pack.cli import main
from neva_pack.formats import FORMATS, compact, read_meta
from neva_pack.sample_store import pool_images_path, segment_name
from tests.conftest import SAMPLE_DATA
pytestmark = [
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),  # Megatron's __del__ on a broken file
    pytest.mark.filterwarnings("error::RuntimeWarning"),  # numpy casting damaged values
]


@pytest.fixture()
def neva_pack(capsys):
    """The CLI in this process (a traceback is an exception the test sees); its exit code and output."""

    def run(*args):
        capsys.readouterr()
        code = main([str(arg) for arg in args])
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run


def preprocess(data_path, out, *extra):
    args = [
        "preprocess", "--quiet", "--data_path", data_path, "--image_folder", SAMPLE_DATA / "images",
        "--tokenizer_path", SAMPLE_DATA / "tokenizer.model", "--output_dir", out, "--conv_template", "v1",
        "--image_aspect_ratio", "pad", "--max_seq_length", "2048", "--num_workers", "0", *extra,
    ]  # fmt: skip
    assert main([str(arg) for arg in args]) == 0


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """nemo and compact outputs of the sample data, every other record malformed (skipped.jsonl is not empty)."""
    root = tmp_path_factory.mktemp("damaged")
    records = []
    for k, record in enumerate(json.loads((SAMPLE_DATA / "llava_sample.json").read_text())):
        records += [record] + ([{"id": f"bad{k}", "conversations": []}] if k % 2 == 0 else [])
    data = root / "data.json"
    data.write_text(json.dumps(records))
    for fmt in ("nemo", "compact"):
        preprocess(data, root / fmt, "--output_format", fmt)
    assert paths.skipped_path(root / "nemo").stat().st_size > 1000
    return {"root": root, "data": data}


def flip(offset):
    def damage(path):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    return damage


def cut(size=None):
    """Truncate to ``size`` bytes (default: half)."""
    return lambda path: os.truncate(path, path.stat().st_size // 2 if size is None else size)


def add_one_to_float(offset):
    def damage(path):
        data = bytearray(path.read_bytes())
        struct.pack_into("<f", data, offset, struct.unpack_from("<f", data, offset)[0] + 1.0)
        path.write_bytes(bytes(data))

    return damage


def append(path):
    with open(path, "a") as f:
        f.write("garbage")


def rename_min(path):
    path.write_text(path.read_text().replace('"min"', '"mim"', 1))


def delete(path):
    path.unlink()


def bin_file(out):
    return bin_path(packed_prefix(out))


def idx_file(out):
    return idx_path(packed_prefix(out))


def plan_file(out):
    return paths.plan_path(packed_prefix(out))


def pool_file(out):
    return pool_images_path(paths.store_dir(out), segment_name(0))


def compact_file(suffix):
    return lambda out: paths.prefix_file(packed_prefix(out), suffix)


stats_file, skipped_file = paths.stats_path, paths.skipped_path

DAMAGES = {
    "nemo": {
        "bin +1.0 at byte 100": (bin_file, add_one_to_float(100)),
        "bin byte 9 flipped": (bin_file, flip(9)),
        "bin cut to 1000 bytes": (bin_file, cut(1000)),
        "bin deleted": (bin_file, delete),
        "idx byte 134 flipped": (idx_file, flip(134)),
        "idx cut to 201 bytes": (idx_file, cut(201)),
        "idx deleted": (idx_file, delete),
        "plan table cut": (plan_file, cut()),
        "stats empty": (stats_file, cut(0)),
        "stats cut": (stats_file, cut()),
        "stats appended": (stats_file, append),
        "stats key changed": (stats_file, rename_min),
        "skipped list cut mid-line": (skipped_file, cut(1000)),
    },
    "compact": {
        "pool image byte flipped": (pool_file, flip(1000)),
        "tokens cut": (compact_file(compact.TOKENS), cut()),
        "labels cut": (compact_file(compact.LABELS), cut()),
        "index cut": (compact_file(compact.INDEX), cut()),
        "index byte 5 flipped": (compact_file(compact.INDEX), flip(5)),
        "stats cut": (stats_file, cut()),
        "skipped list cut mid-line": (skipped_file, cut(1000)),
    },
}
CASES = [(fmt, name) for fmt, damages in DAMAGES.items() for name in damages]
UNDETECTABLE_ONCE_RESTAMPED = {
    ("nemo", "bin +1.0 at byte 100"),  # a token id one higher: a valid pack
    ("compact", "pool image byte flipped"),  # other pixels
}
"""Damage that makes another valid output when the meta vouches for it: nothing can refuse it."""


def damaged_copy(outputs, fmt, name, tmp_path, restamp):
    out = tmp_path / fmt
    shutil.copytree(outputs["root"] / fmt, out)
    file_of, damage = DAMAGES[fmt][name]
    file = file_of(out)
    damage(file)
    if restamp:
        meta_file = paths.meta_path(packed_prefix(out))
        meta = read_meta(meta_file)
        checksums = {n: file_checksum(out / n) if (out / n).is_file() else c for n, c in meta.checksums.items()}
        paths.write_json_atomic(meta_file, meta.replace(checksums=checksums).to_json())
    return out, file


def assert_clean(result):
    """Nothing but our own lines on stderr."""
    assert all(line.startswith("neva-pack: error: ") for line in result.stderr.splitlines()), result.stderr


def assert_one_line_refusal(result, file: str):
    """Refused (exit 2) with one line naming ``file`` (or the meta that vouches for it)."""
    assert_clean(result)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("neva-pack: error: "), result.stderr
    assert file in lines[0] or paths.meta_path(packed_prefix(".")).name in lines[0], lines[0]


@pytest.mark.parametrize("restamp", [False, True], ids=["stale", "restamped"])
@pytest.mark.parametrize("fmt, name", CASES)
def test_verify_fails_with_fail_lines(neva_pack, outputs, tmp_path, fmt, name, restamp):
    out, file = damaged_copy(outputs, fmt, name, tmp_path, restamp)
    result = neva_pack("verify", "--quiet", out, "--data_path", outputs["data"])
    assert_clean(result)
    if restamp and (fmt, name) in UNDETECTABLE_ONCE_RESTAMPED:
        return
    assert result.returncode == 1, result.stdout
    assert result.stdout.splitlines()[-1].startswith("FAILED")
    named = [line for line in result.stdout.splitlines() if line.startswith("FAIL ") and file.name in line]
    assert named or restamp, result.stdout  # restamped: the problem may be a pack's, found by its invariants


@pytest.mark.parametrize("restamp", [False, True], ids=["stale", "restamped"])
@pytest.mark.parametrize("fmt, name", CASES)
def test_convert_refuses_and_writes_nothing(neva_pack, outputs, tmp_path, fmt, name, restamp):
    out, file = damaged_copy(outputs, fmt, name, tmp_path, restamp)
    dest = tmp_path / "converted"
    result = neva_pack("convert", "--quiet", out, dest, "--to", "compact" if fmt == "nemo" else "nemo")
    if restamp and (fmt, name) in UNDETECTABLE_ONCE_RESTAMPED:
        assert_clean(result)
        return
    if restamp and name == "skipped list cut mid-line":  # copied as is, not parsed: verify of the copy says so
        assert result.returncode == 0
        return
    if restamp and name == "bin byte 9 flipped":  # a token changed: a pack whose lengths disagree with its plan
        assert_clean(result)
        return  # not refused by convert (it reads packs, it does not check their invariants): see the report
    assert_one_line_refusal(result, file.name)
    if not restamp:
        assert "checksum mismatch" in result.stderr or "missing" in result.stderr
        assert not dest.exists()  # refused before anything was written


@pytest.mark.parametrize("fmt, name", CASES)
def test_stats_refuses_what_it_reads_damaged(neva_pack, outputs, tmp_path, fmt, name):
    out, file = damaged_copy(outputs, fmt, name, tmp_path, restamp=False)
    result = neva_pack("stats", out)
    prefix_files = FORMATS[fmt].files(packed_prefix(out)).final
    read_by_stats = file == stats_file(out) or (file in prefix_files and file != bin_file(out))  # the .bin's values: not read
    if read_by_stats or name in ("bin deleted", "bin cut to 1000 bytes"):
        assert_one_line_refusal(result, file.name)
    else:  # stats is not verify: the pixels, the .bin's values and the skipped list are not read
        assert_clean(result)
        assert result.returncode == 0


@pytest.mark.parametrize("name", ["stats empty", "stats appended", "stats key changed", "plan table cut"])
def test_stats_refuses_a_damaged_file_even_when_the_meta_vouches_for_it(neva_pack, outputs, tmp_path, name):
    out, file = damaged_copy(outputs, "nemo", name, tmp_path, restamp=True)
    assert_one_line_refusal(neva_pack("stats", out), file.name)


@pytest.fixture(scope="module")
def foreign(outputs, tmp_path_factory):
    """A prefix as NeMo's own script writes it: .bin/.idx only."""
    directory = tmp_path_factory.mktemp("foreign")
    for file_of in (bin_file, idx_file):
        shutil.copy(file_of(outputs["root"] / "nemo"), file_of(directory))
    return directory


def write_cu_seqlens_value(directory, position, value):
    index = read_index(idx_file(directory))
    with open(bin_file(directory), "r+b") as f:
        f.seek(int(index.sequence_pointers[0]) + 4 * position)
        f.write(struct.pack("<f", value))


FOREIGN_DAMAGES = {
    "bin cut to 1000 bytes": lambda d: os.truncate(bin_file(d), 1000),
    "1e30 in cu_seqlens[1]": lambda d: write_cu_seqlens_value(d, 1, 1e30),
    "nan in cu_seqlens[1]": lambda d: write_cu_seqlens_value(d, 1, float("nan")),
    "cu_seqlens[1] not whole": lambda d: write_cu_seqlens_value(d, 1, 3.5),
    "cu_seqlens[0] not 0": lambda d: write_cu_seqlens_value(d, 0, 7.0),
    "cu_seqlens falling": lambda d: write_cu_seqlens_value(d, 1, -5.0),
    "idx cut to 201 bytes": lambda d: os.truncate(idx_file(d), 201),
}


@pytest.mark.parametrize("name", FOREIGN_DAMAGES)
def test_stats_of_a_damaged_prefix_without_meta_refuses(neva_pack, foreign, tmp_path, name):
    copy = tmp_path / "foreign"
    shutil.copytree(foreign, copy)
    FOREIGN_DAMAGES[name](copy)
    result = neva_pack("stats", packed_prefix(copy), "--crop_size", "336", "336")
    assert_one_line_refusal(result, packed_prefix(copy).name + ".")
    assert "-9,223,372,036,854,775,808" not in result.stdout


def test_stats_of_a_prefix_without_meta_and_another_crop_size_refuses(neva_pack, foreign):
    result = neva_pack("stats", packed_prefix(foreign), "--crop_size", "300", "300")
    assert_one_line_refusal(result, idx_file(foreign).name)
    assert "--crop_size" in result.stderr


def test_good_outputs_still_convert_and_verify(neva_pack, outputs, tmp_path):
    for fmt, to in (("nemo", "compact"), ("compact", "nemo")):
        result = neva_pack("convert", "--quiet", outputs["root"] / fmt, tmp_path / to, "--to", to)
        assert result.returncode == 0 and not result.stderr, result.stderr
        assert neva_pack("verify", "--quiet", tmp_path / to, "--data_path", outputs["data"]).returncode == 0


@pytest.mark.parametrize("fmt", ["nemo", "compact"])
def test_stats_of_a_moved_output_names_where_it_is_now(neva_pack, outputs, tmp_path, fmt):
    moved = tmp_path / "moved"
    shutil.copytree(outputs["root"] / fmt, moved)
    original = str(outputs["root"] / fmt)
    result = neva_pack("stats", moved, "--global_batch_size", "64")
    assert result.returncode == 0, result.stderr
    assert original not in result.stdout
    assert f"model.data.data_prefix={packed_prefix(moved if fmt == 'nemo' else tmp_path / 'moved_nemo')}" in result.stdout
    if fmt == "compact":
        assert f"neva-pack convert {moved} {tmp_path / 'moved_nemo'} --to nemo" in result.stdout
    report = json.loads(neva_pack("stats", moved, "--json").stdout)
    assert report["data_prefix"] == str(packed_prefix(moved))
    assert report["packing"] == json.loads(stats_file(moved).read_text())["packing"]
    assert np.isfinite(report["packing"]["efficiency"])


# A FIFO in place of any file of an output: opening it for reading waits for a writer forever. Every
# reader of an output (verify, stats, open_packed / PackedSeqDataset) looks at what a path is before
# it opens it. Each format's sweep runs in a process of its own, so a hang anywhere (a thread
# included) is a timeout of that process, not of the test session.

_FIFO_SWEEP = r"""
import contextlib, io, json, os, shutil, signal, sys
from pathlib import Path
from neva_pack.cli import main
from neva_pack.core import NevaPackError
from neva_pack.reading import PackedSeqDataset

class Hung(BaseException):
    pass

def hung(signum, frame):
    raise Hung()

signal.signal(signal.SIGALRM, hung)
source, work = Path(sys.argv[1]), Path(sys.argv[2])

def outcome(run):
    signal.alarm(30)
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = run()
        return {"code": code, "err": err.getvalue()}
    except Hung:
        return {"hung": True}
    except NevaPackError as error:
        return {"refused": str(error)}
    except BaseException as error:
        return {"traceback": f"{type(error).__name__}: {error}"}
    finally:
        signal.alarm(0)

def read_all():
    dataset = PackedSeqDataset(work)
    for p in range(len(dataset)):
        dataset[p]
    return 0

results = {}
for path in sorted(p for p in source.rglob("*") if p.is_file()):
    name = path.relative_to(source).as_posix()
    if name.startswith("packed_seq_dataset/"):
        continue  # the sample store: the run's intermediate, not what the readers read
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    (work / name).unlink()
    os.mkfifo(work / name)
    results[name] = {
        "verify": outcome(lambda: main(["verify", "--quiet", str(work)])),
        "stats": outcome(lambda: main(["stats", str(work)])),
        "reader": outcome(read_all),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def every_format(outputs, tmp_path_factory):
    """nemo and compact from ``outputs``; energon of the same data; bridge of text-only records."""
    root = outputs["root"]
    if importlib.util.find_spec("megatron.energon") is not None and not (root / "energon").exists():
        preprocess(outputs["data"], root / "energon", "--output_format", "energon")
    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    for record in records:
        record.pop("image", None)
        record["conversations"][0]["value"] = record["conversations"][0]["value"].replace("<image>", "").strip() or "Hi"
    text_only = root / "text_only.json"
    text_only.write_text(json.dumps(records))
    if not (root / "bridge").exists():
        preprocess(text_only, root / "bridge", "--output_format", "bridge")
    return root


@pytest.mark.parametrize("fmt", ["nemo", "compact", "energon", "bridge"])
def test_a_fifo_in_place_of_any_output_file_is_refused_not_waited_on(every_format, tmp_path, fmt):
    import subprocess
    import sys

    from tests.conftest import ROOT

    if not (every_format / fmt).exists():
        pytest.skip(f"{fmt} needs its library")
    result = subprocess.run([sys.executable, "-c", _FIFO_SWEEP, str(every_format / fmt), str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results
    for name, by_tool in results.items():
        for tool, seen in by_tool.items():
            assert "hung" not in seen and "traceback" not in seen, (name, tool, seen)
            message = seen.get("refused") or seen.get("err", "")
            assert message.count("\n") <= 1 or tool == "verify", (name, tool, message)
