"""Sharded preprocessing: parts encoded separately, joined by the final step, give the bytes of a
run without shards; a missing, duplicated or differently-configured part is refused by name."""

import json
import shutil

import numpy as np
import pytest

from neva_pack.files import (
    bin_path, idx_path, meta_path, packed_prefix, paths, plan_path, skipped_path, stats_path, store_dir
)
from neva_pack.cli import main
from neva_pack.core import ConfigError
from neva_pack.formats import declared_files
from neva_pack.sample_store import (
    PROGRESS_FILE, part_dir, pool_images_path, pool_keys_path, segment_name, segment_rows_path, segment_skipped_path,
    segment_text_prefix
)
from neva_pack.records import resolve_shards, shard_range
from tests.conftest import SAMPLE_DATA

RECORDS = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
MISSING_IMAGE = {"id": "bad", "image": "no_such.jpg", "conversations": [
    {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Nothing."}]}  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """41 records: the sample records twice (images and text-only) and one skipped in the middle."""
    path = tmp_path_factory.mktemp("data") / "records.json"
    path.write_text(json.dumps(RECORDS + [MISSING_IMAGE] + RECORDS))
    return path


def command(data_path, output_dir, *extra):
    return [
        "preprocess", "--data_path", str(data_path), "--image_folder", str(SAMPLE_DATA / "images"),
        "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--output_dir", str(output_dir),
        "--conv_template", "v1", "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--max_seq_length", "1024",
        "--packing_algorithm", "near_optimal", "--checkpoint_every", "4", "--num_workers", "0", "--quiet", *extra,
    ]  # fmt: skip


def outputs(output_dir):
    prefix = packed_prefix(output_dir)
    files = (bin_path(prefix), idx_path(prefix), plan_path(prefix), skipped_path(output_dir))
    return {path.name: path.read_bytes() for path in files}


@pytest.fixture(scope="module")
def unsharded(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("unsharded")
    assert main(command(dataset, out)) == 0
    return out


def run_parts(dataset, out, num_shards, indices=None, *extra):
    for index in range(int(num_shards)) if indices is None else indices:
        assert main(command(dataset, out, "--num_shards", num_shards, "--shard_index", str(index), *map(str, extra))) == 0


@pytest.fixture(scope="module")
def three_parts(dataset, tmp_path_factory):
    """The three parts of a --num_shards 3 run, encoded once for the module: the tests that join,
    damage, resume or remove them each work on a copy (parts_copied)."""
    out = tmp_path_factory.mktemp("three_parts") / "out"
    run_parts(dataset, out, "3")
    return out


def parts_copied(parts, out):
    """What run_parts(dataset, out, "3") leaves: a copy of the module's three parts."""
    shutil.copytree(parts, out, symlinks=True)
    return out


@pytest.mark.parametrize("num_shards", [1, 3, pytest.param(7, marks=pytest.mark.slow)])
def test_joined_parts_give_the_bytes_of_a_run_without_shards(dataset, unsharded, tmp_path, num_shards, capsys):
    out = tmp_path / "out"
    run_parts(dataset, out, str(num_shards))
    assert "once every shard is done" in capsys.readouterr().out
    assert main(command(dataset, out, "--num_shards", str(num_shards))) == 0
    assert outputs(out) == outputs(unsharded)
    stats, expected = (json.loads(stats_path(d).read_text())["records"] for d in (out, unsharded))
    assert stats == expected and stats["skipped"] == 1
    assert not list(packed_prefix(out).glob("part_*"))  # joined, then removed
    assert main(command(dataset, out, "--num_shards", str(num_shards), "--resume")) == 0  # final step again: a no-op
    assert outputs(out) == outputs(unsharded)


def pool_bytes(output_dir):
    """The sample store's image pool, its segments concatenated in order (what compact outputs index)."""
    segments = json.loads((paths.store_dir(output_dir) / PROGRESS_FILE).read_text())["shards"]
    return b"".join(pool_images_path(paths.store_dir(output_dir), segment["name"]).read_bytes()
                    for segment in segments if segment["pool_images"])  # fmt: skip


@pytest.mark.parametrize(
    "extra", [("--output_format", "compact", "--pad_to_multiple_of", "8"), ("--pad_to_multiple_of", "8")], ids=["compact", "nemo"]
)
def test_compact_and_padded_outputs_joined_from_parts_are_those_of_a_run_without_shards(dataset, tmp_path, extra):
    """Every image of the records is in parts 0, 1 and 2 alike (the sample records twice): each part
    stores it, the join keeps the first, and the pool is the unsharded run's, index for index."""
    from neva_pack.commands import verify

    plain, out = tmp_path / "plain", tmp_path / "out"
    assert main(command(dataset, plain, *extra)) == 0
    run_parts(dataset, out, "3", None, *extra)
    part_pools = [p for p in store_dir(out).glob("part_*/shard_*.images")]
    assert len({p.parent for p in part_pools}) == 3  # each part stored the images it uses
    assert main(command(dataset, out, "--num_shards", "3", *extra)) == 0
    prefix = packed_prefix(plain)
    files = sorted(p.name for p in declared_files(prefix) if p.is_file() and p != meta_path(prefix)) + [skipped_path(plain).name]
    assert len(files) >= 4 and all((out / name).read_bytes() == (plain / name).read_bytes() for name in files), files
    assert pool_bytes(out) == pool_bytes(plain)
    metas = [json.loads(meta_path(packed_prefix(d)).read_text()) for d in (plain, out)]
    assert metas[0]["pad_to_multiple_of"] == 8
    # the metas differ only where they list files (the pool's parts: the store is split at other places)
    # and checksums (stats.json holds the run's duration)
    for meta in metas:
        meta.get("layout", {}).pop("pool", None)
        del meta["checksums"], meta["meta_checksum"]
    assert metas[0] == metas[1]
    assert verify(out, data_path=dataset, progress=False).ok


@pytest.mark.slow
def test_parts_run_with_workers_and_any_order(dataset, unsharded, tmp_path):
    out = tmp_path / "out"
    run_parts(dataset, out, "3", [2, 0, 1], "--num_workers", "2")
    assert main(command(dataset, out, "--num_shards", "3")) == 0
    assert outputs(out) == outputs(unsharded)


def test_a_missing_part_is_named(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run_parts(dataset, out, "3", [0, 2])
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "3")) == 2
    err = capsys.readouterr().err
    assert "part_00001_of_00003" in err and "missing" in err and "--shard_index 1" in err
    assert not bin_path(packed_prefix(out)).exists()


def test_a_duplicated_part_is_named(dataset, three_parts, tmp_path, capsys):
    out = parts_copied(three_parts, tmp_path / "out")
    store = paths.store_dir(out)
    shutil.rmtree(store / "part_00001_of_00003")
    shutil.copytree(store / "part_00000_of_00003", store / "part_00001_of_00003")  # part 0 twice
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "3")) == 2
    err = capsys.readouterr().err
    assert "part_00001_of_00003" in err and "duplicated" in err and "records 0..12" in err


@pytest.mark.slow
def test_parts_of_another_split_are_refused(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run_parts(dataset, out, "3")
    run_parts(dataset, out, "2", [1])
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "3")) == 2
    assert "part_00001_of_00002" in capsys.readouterr().err


def test_a_part_with_other_settings_is_named_with_the_setting(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run_parts(dataset, out, "2", [0])
    assert main(command(dataset, out, "--num_shards", "2", "--shard_index", "1", "--ignore_index", "-100")) == 0
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "2")) == 2
    err = capsys.readouterr().err
    assert "part_00001_of_00002" in err and "ignore_index differs" in err


def test_an_interrupted_part_resumes_on_its_own(dataset, three_parts, unsharded, tmp_path, capsys):
    out = parts_copied(three_parts, tmp_path / "out")
    part = part_dir(paths.store_dir(out), 3, 1)
    progress = json.loads((part / PROGRESS_FILE).read_text())
    # what a kill after the part's first committed segment leaves behind
    progress["shards"], progress["complete"] = progress["shards"][:1], False
    (part / PROGRESS_FILE).write_text(json.dumps(progress))
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "3")) == 2
    assert "incomplete" in capsys.readouterr().err
    assert main(command(dataset, out, "--num_shards", "3", "--shard_index", "1")) == 2  # refused without --resume
    run_parts(dataset, out, "3", [1], "--resume")
    assert main(command(dataset, out, "--num_shards", "3")) == 0
    assert outputs(out) == outputs(unsharded)


def test_repacking_the_joined_store_needs_no_parts(dataset, three_parts, tmp_path, capsys):
    out = parts_copied(three_parts, tmp_path / "out")
    assert main(command(dataset, out, "--num_shards", "3")) == 0
    capsys.readouterr()
    assert main(["plan", str(out), "--pack_sizes", "1024", "4096"]) == 0
    assert "4096" in capsys.readouterr().out
    # the final command again with another algorithm: packs the joined store, encodes nothing
    repack = command(dataset, out, "--num_shards", "3", "--overwrite")
    repack[repack.index("near_optimal")] = "first_fit_decreasing"
    assert main(repack) == 0
    assert json.loads(meta_path(packed_prefix(out)).read_text())["algorithm"] == "first_fit_decreasing"


def test_shard_ranges_tile_the_records():
    for total in (0, 1, 5, 41, 1000):
        for num_shards in (1, 3, 7):
            ranges = [shard_range(total, num_shards, i) for i in range(num_shards)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert np.ptp([end - first for first, end in ranges]) <= 1


def test_slurm_job_array_variables_are_the_defaults():
    array = {"SLURM_ARRAY_TASK_COUNT": "7", "SLURM_ARRAY_TASK_ID": "4"}
    assert resolve_shards(None, None, array) == (7, 4)  # --array=0-6: task 4 is shard 4
    assert resolve_shards(7, 0, array) == (7, 0)  # explicit flags win
    resubmitted = {"SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_ID": "5"}  # --array=3,5 --num_shards 7
    assert resolve_shards(7, None, resubmitted) == (7, 5)
    with pytest.raises(ConfigError, match="--shard_index 5"):
        resolve_shards(None, None, resubmitted)  # without --num_shards the resubmitted array is misread: refused
    assert resolve_shards(None, None, {}) == (None, None)
    assert resolve_shards(3, None, {}) == (3, None)  # the final step
    for bad in ((None, 1), (0, None), (3, 3), (3, -1)):
        with pytest.raises(ConfigError):
            resolve_shards(*bad, {})


def test_the_final_step_checks_the_skip_fraction_of_the_whole_run(tmp_path, capsys):
    """A part checks only its own records: the whole run's fraction is checked when they are joined."""
    data = tmp_path / "records.json"
    data.write_text(json.dumps(RECORDS[:4] + [MISSING_IMAGE] * 6))  # part 0: 4 good, 1 skipped; part 1: 5 skipped
    out = tmp_path / "out"
    assert main(command(data, out, "--num_shards", "2", "--shard_index", "0")) == 0
    assert main(command(data, out, "--num_shards", "2", "--shard_index", "1", "--max_skip_fraction", "1")) == 0
    capsys.readouterr()
    assert main(command(data, out, "--num_shards", "2")) == 2
    assert "6 of the 10 records were skipped" in capsys.readouterr().err
    assert skipped_path(out).read_text().count("missing_image") == 6



def test_a_part_locks_only_itself_and_overwrite_removes_only_what_a_part_holds(dataset, tmp_path, capsys):
    """Shards of one run write the same output directory at once: a part must not take its lock."""
    from neva_pack.pipeline import OutputLock

    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out):  # e.g. another node's process holding the directory
        run_parts(dataset, out, "3", [0])
    part = part_dir(paths.store_dir(out), 3, 0)
    with OutputLock(part):
        capsys.readouterr()
        assert main(command(dataset, out, "--num_shards", "3", "--shard_index", "0", "--resume")) == 2
        assert "in use by another neva-pack run" in capsys.readouterr().err
    (part / "notes.txt").write_text("mine")
    assert main(command(dataset, out, "--num_shards", "3", "--shard_index", "0", "--overwrite")) == 2
    assert "notes.txt" in capsys.readouterr().err and (part / "notes.txt").read_text() == "mine"
    (part / "notes.txt").unlink()
    assert main(command(dataset, out, "--num_shards", "3", "--shard_index", "0", "--overwrite")) == 0


@pytest.mark.parametrize("environ, named", [
    ({"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": "abc"}, "SLURM_ARRAY_TASK_ID='abc'"),
    ({"SLURM_ARRAY_TASK_COUNT": "x"}, "SLURM_ARRAY_TASK_COUNT='x'"),
    ({"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": ""}, "SLURM_ARRAY_TASK_ID=''"),
])  # fmt: skip
def test_a_slurm_variable_that_is_not_a_number_is_named(dataset, tmp_path, monkeypatch, capsys, environ, named):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(command(dataset, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err and "is not a number" in err, err
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_is_compared_by_content_not_by_file_name(dataset, unsharded, tmp_path):
    out = tmp_path / "out"
    copy = tmp_path / "elsewhere" / "renamed.model"
    copy.parent.mkdir()
    shutil.copyfile(SAMPLE_DATA / "tokenizer.model", copy)
    run_parts(dataset, out, "2", [0])
    renamed = command(dataset, out, "--num_shards", "2", "--shard_index", "1")
    renamed[renamed.index("--tokenizer_path") + 1] = str(copy)
    assert main(renamed) == 0
    assert main(command(dataset, out, "--num_shards", "2")) == 0
    assert outputs(out) == outputs(unsharded)


def test_parts_left_by_a_final_step_stopped_while_removing_them_are_removed_by_the_next(dataset, three_parts, unsharded, tmp_path, monkeypatch):
    out = parts_copied(three_parts, tmp_path / "out")
    store = paths.store_dir(out)
    removed = []

    def stopped_after_one(path, *args, **kwargs):
        if removed:
            raise KeyboardInterrupt  # Ctrl-C (or a kill) after the first part was removed
        removed.append(path)
        real_rmtree(path)

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", stopped_after_one)
    assert main(command(dataset, out, "--num_shards", "3")) == 130
    monkeypatch.undo()
    (part_dir(store, 3, 2) / PROGRESS_FILE).unlink()  # a part half removed
    (store / "part_00009_of_00010").mkdir()  # not a part of this run: kept
    assert main(command(dataset, out, "--num_shards", "3", "--resume")) == 0
    assert [p.name for p in store.glob("part_*")] == ["part_00009_of_00010"]
    assert outputs(out) == outputs(unsharded)


@pytest.mark.parametrize("damage", ["truncate text", "truncate rows", "lose skipped line", "flip pool key", "flip pool image"])
def test_a_damaged_part_is_named_before_anything_is_joined_or_deleted(dataset, three_parts, unsharded, tmp_path, capsys, damage):
    out = parts_copied(three_parts, tmp_path / "out")
    part = part_dir(paths.store_dir(out), 3, 1)
    progress = json.loads((part / PROGRESS_FILE).read_text())
    images = next(s["name"] for s in progress["shards"] if s["pool_images"])
    skipping = next(s["name"] for s in progress["shards"] if s["skipped_by_reason"])
    target, how = {
        "truncate text": (bin_path(segment_text_prefix(part, segment_name(1))), "truncate"),
        "truncate rows": (segment_rows_path(part, segment_name(0)), "truncate"),
        "lose skipped line": (segment_skipped_path(part, skipping), "empty"),
        "flip pool key": (pool_keys_path(part, images), "flip"),
        "flip pool image": (pool_images_path(part, images), "flip"),
    }[damage]
    data = bytearray(target.read_bytes())
    if how == "truncate":
        data = data[:-8]
    elif how == "empty":
        data = bytearray()
    else:
        data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    parts = lambda: sorted((str(p.relative_to(out)), p.stat().st_size) for p in store_dir(out).glob("part_*/*"))  # noqa: E731
    before = parts()
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "3")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "part_00001_of_00003 (records 13..26) is damaged" in err, err
    assert target.name in err and "--shard_index 1 --overwrite" in err, err
    assert parts() == before  # every part kept, as it was (a pool image's damage shows as it is joined)
    assert not meta_path(packed_prefix(out)).exists()
    run_parts(dataset, out, "3", [1], "--overwrite")  # what the line says
    assert main(command(dataset, out, "--num_shards", "3")) == 0
    assert outputs(out) == outputs(unsharded)


def test_the_final_step_resumed_with_other_packing_settings_is_refused(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run_parts(dataset, out, "2")
    assert main(command(dataset, out, "--num_shards", "2")) == 0
    before = outputs(out)
    capsys.readouterr()
    assert main(command(dataset, out, "--num_shards", "2", "--resume", "--seed", "7")) == 2
    assert "--resume: the output was started with seed=0, this run has 7" in capsys.readouterr().err
    assert outputs(out) == before
