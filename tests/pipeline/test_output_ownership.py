"""One run per output directory; --overwrite deletes only our own files (never an input, a
stranger's file or a user's file inside our store); a pack that breaks an invariant is never
published; the accounting must add up. The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import os
import shutil

from neva_pack.cli import main
from neva_pack.files import stats_path, store_dir
from neva_pack.packing import accounting_problem
from neva_pack.pipeline import LOCK_FILE, OutputLock
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import GOOD, TOKENIZER, adjacent_images_record, images, run_on, run_with, write_data  # noqa: F401 (images: the fixture)


def test_a_second_run_on_a_locked_output_dir_exits_2_naming_the_holder(tmp_path, capsys, images):
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out):
        run = run_with(tmp_path, capsys, images, GOOD[0], "--resume")
    assert run.code == 2 and run.err.count("\n") == 1
    assert f"in use by another neva-pack run (pid {os.getpid()} on " in run.err
    assert not store_dir(out).exists()
    again = run_with(tmp_path, capsys, images, GOOD[0], "--resume")  # the lock is gone with its holder
    assert again.code == 0 and not (out / LOCK_FILE).exists()
    assert again.verified


def test_overwrite_refuses_to_delete_an_input_or_a_stranger(tmp_path, capsys):
    out = tmp_path / "out"
    user_images = store_dir(out)  # the reported case: an image folder with our store's name
    user_images.mkdir(parents=True)
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", user_images)
    run = run_with(tmp_path, capsys, user_images, GOOD[0], "--overwrite")
    assert run.code == 2 and run.err.count("\n") == 1 and "nothing was deleted" in run.err
    assert (user_images / "chelsea.jpg").is_file()


def test_overwrite_refuses_an_input_inside_what_it_would_delete(tmp_path, capsys, images):
    first = run_with(tmp_path, capsys, images, GOOD[0])
    assert first.code == 0
    data = store_dir(first.out) / "mine.jsonl"  # a user's file inside our own store
    shutil.copy(first.data, data)
    run = run_on(tmp_path, capsys, data, images, "--overwrite")
    assert run.code == 2 and "--data_path" in run.err and "which --overwrite would delete" in run.err
    assert data.is_file()


def test_overwrite_keeps_a_foreign_file_with_one_of_our_names(tmp_path, capsys, images):
    out = tmp_path / "out"
    out.mkdir()
    stats_path(out).write_text('{"my": "notes"}')
    run = run_with(tmp_path, capsys, images, GOOD[0], "--overwrite")
    assert run.code == 2 and "stats.json is not a neva_pack report" in run.err
    assert stats_path(out).read_text() == '{"my": "notes"}'


def test_overwrite_keeps_a_users_file_inside_our_store_directory(tmp_path, capsys, images):
    first = run_with(tmp_path, capsys, images, GOOD[0])
    assert first.code == 0
    mine = store_dir(first.out) / "shard_0001.tar"  # named like a shard, but not a store file
    mine.write_bytes(b"user data")
    run = run_with(tmp_path, capsys, images, GOOD[0], "--overwrite")
    assert run.code == 2 and "shard_0001.tar" in run.err and "nothing was deleted" in run.err
    assert mine.read_bytes() == b"user data"


def test_overwrite_replaces_a_converted_compact_output(tmp_path, capsys, images):
    first = run_with(tmp_path, capsys, images, GOOD[0])
    assert first.code == 0
    converted = tmp_path / "converted"
    assert main(["convert", str(first.out), str(converted), "--to", "compact"]) == 0
    assert any(p.name.startswith("pool_") for p in store_dir(converted).iterdir())
    capsys.readouterr()
    code = main(["preprocess", "--quiet", "--data_path", str(first.data), "--image_folder", str(images),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(converted), "--conv_template", "v1",
                 "--num_workers", "0", "--overwrite", "--output_format", "compact"])  # fmt: skip
    assert code == 0, capsys.readouterr().err


def test_a_pack_violating_an_invariant_is_never_published(tmp_path, capsys, images, monkeypatch):
    import neva_pack.samples as samples  # assemble asks the samples package for its cut

    def buggy_truncation(image_starts, run_length, max_seq_length):  # the old off-by-one
        cut, kept = max_seq_length + 1, 0
        while kept < len(image_starts) and image_starts[kept] + run_length <= cut:
            kept += 1
        return (min(cut, int(image_starts[kept])) if kept < len(image_starts) else cut), kept

    monkeypatch.setattr(samples, "truncation", buggy_truncation)  # the cut assemble.rows_at makes per size
    record = adjacent_images_record()
    out = tmp_path / "multi"
    data = write_data(tmp_path / "data.jsonl", [record, GOOD[0]], "jsonl")
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(images), "--tokenizer_path",
                 str(TOKENIZER), "--output_dir", str(out), "--conv_template", "v1", "--num_workers", "0",
                 "--pack_sizes", "700", "4096"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "incomplete image run" in err and "nothing was published" in err
    assert not list(out.glob("*.meta.json"))


def test_accounting_must_add_up():
    assert accounting_problem(records=4, packed=3, skipped=1) is None
    assert accounting_problem(records=2112, packed=480, skipped=0) == "480 packed + 0 skipped != 2112 records"
