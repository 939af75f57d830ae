"""Packs assembled in DataLoader workers (parallel_assembly) are the packs the main process
would assemble, in the same order: the output bytes do not change, a bad pack still stops the run
before anything is published, and no worker outlives it.

The default sizes send only large plans to workers; here MIN_PACKS_PER_WORKER and
PACKS_PER_MESSAGE are made tiny so that the small golden workloads go through them (the workers
are forked, so they see the patched values)."""

from __future__ import annotations

import hashlib
import multiprocessing
from pathlib import Path

import pytest

from neva_pack.assembly import parallel as parallel_assembly

from neva_pack.samples import stream as sample_stream
from neva_pack.cli import main
from neva_pack.formats import declared_files
from neva_pack.files import meta_path, packed_prefixes
from tests.pipeline.test_throughput import GOLDEN, run_golden


@pytest.fixture()
def packs_in_workers(monkeypatch):
    monkeypatch.setattr(parallel_assembly, "MIN_PACKS_PER_WORKER", 1)
    monkeypatch.setattr(parallel_assembly, "PACKS_PER_MESSAGE", 3)


@pytest.mark.parametrize("name", ["image_v1_pad_clip336", "text_v1"])
def test_packs_assembled_in_workers_give_the_golden_bytes(
    name, packs_in_workers, workloads, tmp_path, sample_tokenizer_path, mistral_tokenizer_path
):
    got = run_golden(name, 2, workloads, tmp_path / "out", sample_tokenizer_path, mistral_tokenizer_path)
    assert got == GOLDEN[name][2]


def _files(directory: Path) -> dict[str, bytes]:
    """Every prefix's files but its meta (which holds the run's duration), whatever the format."""
    return {path.name: path.read_bytes() for prefix in packed_prefixes(directory) for path in declared_files(prefix)
            if path.is_file() and path != meta_path(prefix)}  # fmt: skip


def test_compact_output_is_the_same_from_workers(workloads, tmp_path, sample_tokenizer_path, monkeypatch):
    def run(output_dir: Path) -> dict[str, bytes]:
        code = main(["preprocess", "--quiet", *map(str, workloads["image"]), "--tokenizer_path", str(sample_tokenizer_path),
                     "--conv_template", "v1", "--image_aspect_ratio", "pad", "--max_seq_length", "2048",
                     "--output_dir", str(output_dir), "--num_workers", "3", "--output_format", "compact"])  # fmt: skip
        assert code == 0
        return _files(output_dir)

    in_main = run(tmp_path / "main")
    monkeypatch.setattr(parallel_assembly, "MIN_PACKS_PER_WORKER", 1)
    monkeypatch.setattr(parallel_assembly, "PACKS_PER_MESSAGE", 2)
    assert len(in_main) == 3  # tokens, labels, the pack index
    assert run(tmp_path / "workers") == in_main


@pytest.mark.parametrize("per_read, per_handoff", [(1, 1), (2, 3)])
@pytest.mark.parametrize("name", ["image_v1_pad_clip336", "text_v1"])
def test_packs_read_and_handed_to_the_writer_in_groups_of_any_size_give_the_golden_bytes(
    name, per_read, per_handoff, workloads, tmp_path, sample_tokenizer_path, mistral_tokenizer_path, monkeypatch
):
    from neva_pack.assembly import assemble
    from neva_pack.formats import nemo

    monkeypatch.setattr(assemble, "PACKS_PER_READ", per_read)
    monkeypatch.setattr(nemo, "TEXT_PACKS_PER_HANDOFF", per_handoff)
    # no encoding workers: the groups are read and handed over in this process whatever their number
    got = run_golden(name, 0, workloads, tmp_path / "out", sample_tokenizer_path, mistral_tokenizer_path)
    assert got == GOLDEN[name][2]


def test_cut_and_padded_samples_read_in_groups_give_the_packs_read_one_by_one(
    workloads, tmp_path, sample_tokenizer_path, monkeypatch
):
    """Samples cut for the smaller pack size and padded to a multiple, read a pack at a time and
    in groups (PACKS_PER_READ 3 straddles packs with and without images): the same bytes."""
    from neva_pack.assembly import assemble

    def run(output_dir: Path) -> dict[str, bytes]:
        code = main(["preprocess", "--quiet", *map(str, workloads["image"]), "--tokenizer_path", str(sample_tokenizer_path),
                     "--conv_template", "v1", "--image_aspect_ratio", "pad", "--pack_sizes", "700", "2048",
                     "--pad_to_multiple_of", "8", "--output_dir", str(output_dir), "--num_workers", "0"])  # fmt: skip
        assert code == 0
        return _files(output_dir)

    monkeypatch.setattr(assemble, "PACKS_PER_READ", 1)
    one_by_one = run(tmp_path / "one")
    assert any("700" in name for name in one_by_one) and any("2048" in name for name in one_by_one)
    monkeypatch.setattr(assemble, "PACKS_PER_READ", 3)
    assert run(tmp_path / "groups") == one_by_one


def test_a_bad_pack_found_by_a_worker_stops_the_run_and_its_workers(
    packs_in_workers, workloads, tmp_path, sample_tokenizer_path, monkeypatch, capsys
):
    sound = parallel_assembly.pack_problem
    seen = []

    def fails_late(pack, checks):  # runs in the workers, forked after this patch
        seen.append(1)
        return "a planted problem" if len(seen) > 2 else sound(pack, checks)

    monkeypatch.setattr(parallel_assembly, "pack_problem", fails_late)
    out = tmp_path / "out"
    code = main(["preprocess", "--quiet", *map(str, workloads["text"]), "--tokenizer_path", str(sample_tokenizer_path),
                 "--conv_template", "v1", "--max_seq_length", "1024", "--output_dir", str(out), "--num_workers", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "a planted problem; nothing was published" in err
    assert not list(out.glob("*.meta.json"))
    assert multiprocessing.active_children() == []


def test_a_plan_too_small_for_workers_is_assembled_in_this_process(
    workloads, tmp_path, sample_tokenizer_path, mistral_tokenizer_path, monkeypatch
):
    """The golden text run (a few dozen packs) starts no assembling worker: they would cost more than the packs."""

    def no_workers(*args, **kwargs):
        raise AssertionError("a DataLoader was started to assemble packs")

    monkeypatch.setattr(parallel_assembly, "worker_messages", no_workers)
    got = run_golden("text_v1", 2, workloads, tmp_path / "out", sample_tokenizer_path, mistral_tokenizer_path)
    assert got == GOLDEN["text_v1"][2]


def test_a_write_interrupted_while_workers_assemble_resumes_to_the_golden_bytes(
    packs_in_workers, workloads, tmp_path, sample_tokenizer_path, mistral_tokenizer_path, monkeypatch
):
    from neva_pack.cli import EXIT_INTERRUPTED
    from neva_pack.formats import nemo

    add = nemo.Writer.add_prepared
    written = []

    def interrupted_after_two_messages(self, prepared, pixels):  # 6 packs (3 a message), checkpointed
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(1)
        add(self, prepared, pixels)

    out = tmp_path / "out"
    _, flags, expected = GOLDEN["image_v1_pad_clip336"]
    args = ["preprocess", "--quiet", *map(str, workloads["image"]), *flags, "--tokenizer_path", str(sample_tokenizer_path),
            "--output_dir", str(out), "--num_workers", "2", "--checkpoint_every", "20"]  # a writer checkpoint every 2 packs
    monkeypatch.setattr(nemo.Writer, "add_prepared", interrupted_after_two_messages)
    assert main(args) == EXIT_INTERRUPTED
    assert multiprocessing.active_children() == []
    assert not list(out.glob("*.meta.json")) and list(out.glob("*.checkpoint.npz"))
    monkeypatch.setattr(nemo.Writer, "add_prepared", add)
    assert main([*args, "--resume"]) == 0
    assert {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in expected} == expected


@pytest.mark.parametrize("shm_free, shared", [(64 << 20, False), (64 << 30, True)])
def test_images_cross_in_shared_memory_only_where_dev_shm_has_room(
    shm_free, shared, workloads, tmp_path, sample_tokenizer_path, mistral_tokenizer_path, monkeypatch
):
    """A container's 64 MB /dev/shm would kill torch's workers with a bus error: there the images go
    through the pipe. Either way the bytes are the golden ones."""
    from collections import namedtuple

    from neva_pack.pipeline import encode

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(encode.shutil, "disk_usage", lambda path: usage(shm_free, 0, shm_free))
    arrived = []
    monkeypatch.setattr(encode, "received", lambda batch: arrived.append(type(batch.images).__name__) or sample_stream.received(batch))
    got = run_golden("image_v1_pad_clip336", 2, workloads, tmp_path / "out", sample_tokenizer_path, mistral_tokenizer_path)
    assert got == GOLDEN["image_v1_pad_clip336"][2]
    assert ("Tensor" in arrived) == shared and ("ndarray" in arrived)  # text-only messages are never shared
