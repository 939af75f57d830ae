"""--resume proves by content that it continues the same input and an undamaged store.

An input edited in place keeps its size and mtime (``cp -p``, a restore from a backup, ``rsync -t``):
resuming on it must be refused, never publish a mix of old and new samples; a store file damaged
after it was committed must be refused naming the file, never packed nor a traceback; and a
published output whose input changed since is stale for ``verify --data_path``.
"""

import json
import os
import shutil
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neva_pack.files import bin_path, idx_path, paths
from neva_pack.cli import main
from neva_pack.sample_store import (
    PROGRESS_FILE, part_dir, pool_images_path, pool_keys_path, segment_image_refs_path, segment_name,
    segment_rows_path, segment_skipped_path, segment_text_prefix
)
from neva_pack.commands import verify
from tests.conftest import SAMPLE_DATA

RECORDS = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
MISSING_IMAGE = {"id": "gone", "image": "no_such_image.jpg",
                 "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Nothing."}]}  # fmt: skip
INPUT = [MISSING_IMAGE] + RECORDS * 2
"""Two passes over the sample records, one skipped first (so that the first segment lists a skip)."""


def command(data_path, output_dir, *extra):
    return [
        "preprocess", "--data_path", str(data_path), "--image_folder", str(SAMPLE_DATA / "images"),
        "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--output_dir", str(output_dir),
        "--conv_template", "v1", "--max_seq_length", "2048", "--packing_algorithm", "near_optimal",
        "--seed", "3", "--checkpoint_every", "8", "--num_workers", "0", "--quiet", *extra,
    ]  # fmt: skip


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(INPUT, indent=1))
    return path


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A complete run whose store is kept, and a pristine copy of it (mtimes kept) that each test
    puts back in its place before damaging it (a resume must name the same paths)."""
    root = tmp_path_factory.mktemp("packed")
    live = root / "live"
    live.mkdir()
    data = live / "records.json"
    data.write_text(json.dumps(INPUT, indent=1))
    assert main(command(data, live / "out")) == 0
    shutil.copytree(live, root / "pristine")
    return root


def edit_in_place(path, position: int) -> None:
    """Change one letter's case at or after ``position``: same size, and the mtime put back."""
    before = os.stat(path)
    raw = bytearray(path.read_bytes())
    at = next(k for k in range(position, len(raw)) if chr(raw[k]).isalpha())
    raw[at] ^= 0x20
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def as_if_killed_before_publishing(out) -> None:
    """What a run killed after its store was complete and before its meta leaves behind."""
    paths.meta_path(paths.packed_prefix(out)).unlink()


def one_line_refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "--overwrite" in err, err
    return err


def restored(packed):
    """The packed run as it was: (its input, its output directory)."""
    live = packed / "live"
    shutil.rmtree(live)
    shutil.copytree(packed / "pristine", live)
    return live / "records.json", live / "out"


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0, 0.95))
def test_resume_on_an_input_edited_in_place_is_refused(packed, capsys, fraction):
    data, out = restored(packed)
    as_if_killed_before_publishing(out)
    edit_in_place(data, int(fraction * data.stat().st_size))
    capsys.readouterr()
    assert main(command(data, out, "--resume")) == 2
    err = one_line_refusal(capsys)
    assert "--data_path" in err and "size and mtime" in err
    assert not paths.meta_path(paths.packed_prefix(out)).exists()  # nothing was published


def test_the_same_input_resumes_and_publishes_what_an_uninterrupted_run_does(packed):
    data, out = restored(packed)
    before = bin_path(paths.packed_prefix(out)).read_bytes()
    as_if_killed_before_publishing(out)
    backup = data.with_suffix(".bak")
    shutil.copy2(data, backup)
    data.unlink()
    shutil.copy2(backup, data)  # a restore from a backup: another inode, the same bytes, size and mtime
    assert main(command(data, out, "--resume")) == 0
    assert bin_path(paths.packed_prefix(out)).read_bytes() == before


def test_a_store_written_before_the_digests_were_recorded_still_resumes(packed):
    data, out = restored(packed)
    before = bin_path(paths.packed_prefix(out)).read_bytes()
    as_if_killed_before_publishing(out)
    progress_file = paths.store_dir(out) / PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    del progress["input_digest"]
    for segment in progress["shards"]:
        del segment["checksums"]
    progress_file.write_text(json.dumps(progress))
    assert main(command(data, out, "--resume")) == 0
    assert bin_path(paths.packed_prefix(out)).read_bytes() == before


def store_files():
    """Each kind of file of a committed store segment (segment 0: its images are all new)."""
    name = segment_name(0)
    return {
        "rows": lambda d: segment_rows_path(d, name),
        "text values": lambda d: bin_path(segment_text_prefix(d, name)),
        "text index": lambda d: idx_path(segment_text_prefix(d, name)),
        "image refs": lambda d: segment_image_refs_path(d, name),
        "images": lambda d: pool_images_path(d, name),
        "image keys": lambda d: pool_keys_path(d, name),
        "skipped": lambda d: segment_skipped_path(d, name),
    }


@pytest.mark.parametrize("kind", sorted(store_files()))
def test_a_flipped_byte_in_any_store_file_is_refused_naming_it(packed, capsys, kind):
    data, out = restored(packed)
    as_if_killed_before_publishing(out)
    target = store_files()[kind](paths.store_dir(out))
    raw = bytearray(target.read_bytes())
    assert raw, f"{target.name} is empty: nothing to damage"
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(command(data, out, "--resume")) == 2
    err = one_line_refusal(capsys)
    assert target.name in err and "damaged" in err
    assert not paths.meta_path(paths.packed_prefix(out)).exists()


def test_verify_with_the_data_path_reports_an_output_whose_input_changed_as_stale(packed):
    data, out = restored(packed)
    assert verify(out, data_path=data, progress=False).ok
    edit_in_place(data, data.stat().st_size // 2)
    result = verify(out, data_path=data, progress=False)
    assert not result.ok and any(problem.startswith("stale:") and str(data) in problem for problem in result.problems)
    assert verify(out, progress=False).ok  # on its own the output is whole


def test_a_signal_after_publishing_says_what_was_published(data, tmp_path, capsys, monkeypatch):
    import neva_pack.pipeline

    def terminated_while_dropping_the_store(*args):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(neva_pack.pipeline, "drop_store", terminated_while_dropping_the_store)
    out = tmp_path / "out"
    assert main(command(data, out, "--drop_store")) == 143
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing was published" not in err
    assert "packed_seq_dataset" in err and "published" in err and "--resume" in err


def test_resume_after_drop_store_on_a_complete_output_reports_it(data, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(command(data, out, "--drop_store")) == 0
    first = capsys.readouterr().out
    published = bin_path(paths.packed_prefix(out)).read_bytes()
    assert main(command(data, out, "--drop_store", "--resume")) == 0
    assert capsys.readouterr().out.splitlines()[:3] == first.splitlines()[:3]
    assert bin_path(paths.packed_prefix(out)).read_bytes() == published
    assert not paths.store_dir(out).exists()
    edit_in_place(data, 10)  # the published output is of another input now: no longer "done"
    assert main(command(data, out, "--drop_store", "--resume")) == 2
    assert "edited" in one_line_refusal(capsys)


# ---------------------------------------------------------------------------------------------
# the final step of a sharded run, and a shard's part


def test_the_sharded_final_step_resumed_on_an_edited_input_is_refused(data, tmp_path, capsys):
    out = tmp_path / "out"
    for index in range(2):
        assert main(command(data, out, "--num_shards", "2", "--shard_index", str(index))) == 0
    assert main(command(data, out, "--num_shards", "2")) == 0
    as_if_killed_before_publishing(out)
    edit_in_place(data, data.stat().st_size // 3)
    capsys.readouterr()
    assert main(command(data, out, "--num_shards", "2", "--resume")) == 2
    assert "--data_path" in one_line_refusal(capsys)
    assert not paths.meta_path(paths.packed_prefix(out)).exists()


def test_a_shard_resumes_from_another_mount_point_of_the_same_files(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (real / "records.json").write_text(json.dumps(RECORDS * 2))
    mount = tmp_path / "mount"
    mount.symlink_to(real, target_is_directory=True)
    assert main(command(real / "records.json", real / "out", "--num_shards", "2", "--shard_index", "1")) == 0
    part = part_dir(paths.store_dir(real / "out"), 2, 1)
    progress = json.loads((part / PROGRESS_FILE).read_text())
    progress["shards"], progress["complete"] = progress["shards"][:1], False  # killed after one segment
    (part / PROGRESS_FILE).write_text(json.dumps(progress))
    resumed = command(mount / "records.json", mount / "out", "--num_shards", "2", "--shard_index", "1", "--resume")
    assert main(resumed) == 0, capsys.readouterr().err
    assert json.loads((part / PROGRESS_FILE).read_text())["complete"] is True
    assert main(command(mount / "records.json", mount / "out", "--num_shards", "2", "--shard_index", "0")) == 0
    assert main(command(mount / "records.json", mount / "out", "--num_shards", "2")) == 0
    assert verify(mount / "out", data_path=real / "records.json", progress=False).ok


def test_the_sharded_final_step_resumed_after_drop_store_reports_the_published_output(data, tmp_path, capsys):
    out = tmp_path / "out"
    for index in range(2):
        assert main(command(data, out, "--num_shards", "2", "--shard_index", str(index))) == 0
    assert main(command(data, out, "--num_shards", "2", "--drop_store")) == 0
    published = bin_path(paths.packed_prefix(out)).read_bytes()
    capsys.readouterr()
    assert main(command(data, out, "--num_shards", "2", "--drop_store", "--resume")) == 0
    said = capsys.readouterr()
    assert "part" not in said.err and "records" in said.out
    assert bin_path(paths.packed_prefix(out)).read_bytes() == published
