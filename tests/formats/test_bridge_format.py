"""Megatron Bridge's packed SFT files (--output_format bridge / bridge_parquet) against Bridge itself.

The golden data (tests/golden/bridge/packed_sft/, README there) is what Bridge's own packing wrote
for a tokenized dataset, the samples each pack holds, and what its GPTSFTPackedDataset + collate_fn
gave for each pack. Our writer, handed the same packs, writes the same rows and metadata; our reader
gives, on every pack, the tokens, labels, loss mask and cu_seqlens Bridge's collate gives.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from neva_pack.files import paths
from neva_pack.assembly import AssembledPack
from neva_pack.formats import (
    Counts, FORMATS, ImageTokenIds, META_VERSION, Normalisation, PackedMeta, PackingSettings, WriteSpec, open_packed,
    read_meta
)
from neva_pack.packing import PlanTable, padded_lengths
from neva_pack.commands import verify
from tests.conftest import SAMPLE_DATA

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "bridge" / "packed_sft"
INPUTS = json.loads((GOLDEN / "inputs.json").read_text())
CASES = json.loads((GOLDEN / "cases.json").read_text())
EOS = INPUTS["eos"]
IGNORE = -100
SHAPE = (3, 4, 4)
FORMAT_FILES = {"bridge": "training_{size}.npy", "bridge_parquet": "training_{size}.idx.parquet"}


def golden_pack(members: list[int], size: int, multiple: int) -> AssembledPack:
    """Bridge's samples as our packs hold them: tokens = ids[:-1], labels = ids[1:] where trained."""
    tokens, labels = [], []
    for index in members:
        sample = INPUTS["samples"][index]
        ids, trained = np.array(sample["input_ids"]), np.array(sample["loss_mask"])
        tokens.append(ids[:-1])
        labels.append(np.where(trained[1:], ids[1:], IGNORE))
    lengths = np.array([len(t) for t in tokens])
    padded = np.minimum(padded_lengths(lengths, multiple), size // multiple * multiple)
    return AssembledPack(
        lengths=lengths, padded_lengths=padded, tokens=np.concatenate(tokens).astype(np.int32),
        labels=np.concatenate(labels).astype(np.int32), record_indices=np.array(members),
        num_images=np.zeros(len(members), np.int64),
        image_indices=np.zeros(0, np.int64), image_starts=np.zeros(0, np.int64), pixels=None,
    )  # fmt: skip


def meta(size: int, multiple: int, packs: int) -> PackedMeta:
    return PackedMeta(
        format="?", version=META_VERSION, num_packs=packs, image_shape=SHAPE, dataset="inputs.json", template="chat",
        normalisation=Normalisation(rescale_factor=1 / 255, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
        tokenization="nemo", tokenizer="sample", vocab_size=32000, encoder="none", image_aspect_ratio="square", image_positions=1,
        image_token_ids=ImageTokenIds(patch=0, start=None, end=None), ignore_index=IGNORE, pad_id=EOS,
        packing=PackingSettings(pad_to_multiple_of=multiple, max_seq_length=size, algorithm="first_fit_shuffle", seed=0,
                                max_samples_per_pack=None, balance_data_parallel=None),
        counts=Counts(records=20, samples=20, skipped=0, truncated=0, packs=packs, images=0),
    )  # fmt: skip


def write_golden_packs(directory: Path, name: str, case: str) -> list[AssembledPack]:
    """Bridge's packs of ``case``, in its order, written by our writer into ``directory``."""
    spec_of = CASES[case]
    size, multiple = spec_of["pack_size"], spec_of["pad_seq_to_mult"]
    members = [[hits[0] for hits in pack] for pack in json.loads((GOLDEN / case / "collate.json").read_text())["pack_members"]]
    packs = [golden_pack(m, size, multiple) for m in members]
    spec = WriteSpec(image_shape=SHAPE, normalisation=meta(size, multiple, 0).normalisation, pad_id=EOS, ignore_index=IGNORE,
                     pool=(), plan_digest="golden", image_run=(0,))  # fmt: skip
    writer = FORMATS[name].writer(paths.packed_prefix(directory), spec)
    for pack in packs:
        writer.add(pack)
    table = PlanTable(
        offsets=np.concatenate([[0], np.cumsum([len(p.lengths) for p in packs])]),
        record_index=np.concatenate([p.record_indices for p in packs]), length=np.concatenate([p.lengths for p in packs]),
        padded_length=np.concatenate([p.padded_lengths for p in packs]),
        num_images=np.zeros(sum(len(p.lengths) for p in packs), np.int64),
    )  # fmt: skip
    writer.publish(table, [], meta(size, multiple, len(packs)))
    return packs


def values(tensor: dict) -> np.ndarray:
    return np.asarray(tensor["values"]).reshape(tensor["shape"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_and_metadata_are_bridges_for_the_same_packs(tmp_path, case):
    size = CASES[case]["pack_size"]
    write_golden_packs(tmp_path, "bridge", case)
    ours = np.load(tmp_path / f"training_{size}.npy", allow_pickle=True)
    theirs = np.load(GOLDEN / case / f"training_{size}.npy", allow_pickle=True)
    assert ours.dtype == object and len(ours) == len(theirs) == CASES[case]["packs"]
    for row, golden in zip(ours, theirs):
        assert list(row) == ["input_ids", "loss_mask", "seq_start_id"] == list(golden)
        assert row["input_ids"] == golden["input_ids"] and row["seq_start_id"] == golden["seq_start_id"]
        assert row["loss_mask"] == golden["loss_mask"]  # True == 1: Bridge's values, whichever of bool/int
        assert {type(v) for v in row["input_ids"] + row["seq_start_id"]} == {int}
        assert {type(v) for v in row["loss_mask"]} <= {bool, int}
        assert {type(v).__name__ for v in row["loss_mask"]} <= set(CASES[case]["loss_mask_types"])  # bools unless padded
    metadata = json.loads((tmp_path / f"{size}_metadata.jsonl").read_text())
    assert metadata == json.loads((GOLDEN / case / f"{size}_metadata.jsonl").read_text()) == [CASES[case]["metadata"]]
    assert list(metadata[0]) == list(CASES[case]["metadata"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_parquet_rows_are_bridges(tmp_path, case):
    import pyarrow.parquet as pq

    size = CASES[case]["pack_size"]
    write_golden_packs(tmp_path, "bridge_parquet", case)
    name = f"training_{size}.idx.parquet"
    ours, theirs = pq.read_table(tmp_path / name), pq.read_table(GOLDEN / case / name)
    assert ours.schema.equals(theirs.schema) and ours.column_names == ["input_ids", "loss_mask", "seq_start_id"]
    assert ours.to_pylist() == theirs.to_pylist()
    assert pq.ParquetFile(tmp_path / name).metadata.num_row_groups == 1  # groups of 500 rows


@pytest.mark.parametrize("name", ["bridge", "bridge_parquet"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_our_reader_gives_what_bridges_collate_gives_on_every_pack(tmp_path, case, name):
    """Bridge's collate_fn (on its files, whose rows ours equal): tokens, labels where trained, loss mask,
    cu_seqlens (with m > 1 the padded boundaries and the real lengths, cumulated)."""
    size = CASES[case]["pack_size"]
    packs = write_golden_packs(tmp_path, name, case)
    batches = json.loads((GOLDEN / case / "collate.json").read_text())["batches"]
    reader = open_packed(tmp_path)
    assert len(reader) == len(packs)
    our_metadata = json.loads((tmp_path / f"{size}_metadata.jsonl").read_text())[-1]
    for p, pack in enumerate(packs):
        got = reader.pack(p)
        n = int(got.cu_seqlens[-1])
        trained = got.labels != IGNORE
        for mode, per_pack in batches.items():
            batch = per_pack[p]
            tokens, labels, loss_mask = (values(batch[key])[0] for key in ("tokens", "labels", "loss_mask"))
            row = len(tokens)
            assert tokens[:n].tolist() == got.tokens.tolist() and np.all(tokens[n:] == EOS), (mode, p)
            assert loss_mask[:n].astype(bool).tolist() == trained.tolist() and not loss_mask[n:].any()
            assert labels[:n][trained].tolist() == got.labels[trained].tolist()
            boundaries = got.cu_seqlens.tolist() + ([row] if row > n else [])
            logical = got.cu_seqlens_unpadded.tolist() + ([int(got.cu_seqlens_unpadded[-1])] if row > n else [])
            if mode == "pad_cu_seqlens":  # extended to max_samples_per_bin + 2 entries from our metadata
                width = our_metadata["max_samples_per_bin"] + 2
                boundaries += [row] * (width - len(boundaries))
                logical += [logical[-1]] * (width - len(logical))
                longest = max(our_metadata["dataset_max_seqlen"], row - our_metadata["min_packed_seqlen"])
                assert values(batch["max_seqlen_q"]).tolist() == [longest]
            if "cu_seqlens_q_padded" in batch:
                assert values(batch["cu_seqlens_q_padded"])[0].tolist() == boundaries
                assert values(batch["cu_seqlens_q"])[0].tolist() == logical
            else:
                assert values(batch["cu_seqlens_q"])[0].tolist() == boundaries
    reader.close()
    assert verify(tmp_path, progress=False).ok


def test_a_run_writes_bridges_files_in_the_output_dir(tmp_path):
    """Through the command line on text data: the files where Bridge's config points, plain Python
    values, and a pipeline run's packs read back by the reader as the rows say."""
    from neva_pack.cli import main

    data = text_only_sample(tmp_path)
    out = tmp_path / "out"
    args = ["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
            "--output_dir", str(out), "--num_workers", "0", "--max_seq_length", "256", "--pad_to_multiple_of", "4",
            "--output_format", "bridge"]  # fmt: skip
    assert main(args) == 0
    rows = np.load(out / "training_256.npy", allow_pickle=True)
    metadata = json.loads((out / "256_metadata.jsonl").read_text())
    assert list(metadata[0]) == ["dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency",
                                 "pack_size", "min_packed_seqlen"]  # fmt: skip
    assert metadata[0]["pack_size"] == 256 and metadata[0]["dataset_max_seqlen"] % 4 == 0
    reader = open_packed(out)
    assert len(reader) == len(rows) == read_meta(paths.meta_path(paths.packed_prefix(out))).counts.packs
    for p, row in enumerate(rows):
        got = reader.pack(p)
        assert all(type(v) is int for v in row["input_ids"]) and all(type(v) in (int, bool) for v in row["loss_mask"])
        stored = np.array(row["input_ids"])
        starts = row["seq_start_id"] + [len(stored)]
        assert [b - a - 1 for a, b in zip(starts[:-1], starts[1:])] == np.diff(got.cu_seqlens).tolist()  # + its final id
        assert np.array_equal(np.concatenate([stored[a : b - 1] for a, b in zip(starts[:-1], starts[1:])])[got.labels != -1],
                              got.tokens[got.labels != -1])  # fmt: skip
        assert sum(row["loss_mask"]) == int(np.sum(got.labels != -1))
    reader.close()
    import torch

    from neva_pack.reading import PackedSeqDataset

    dataset = PackedSeqDataset(out)  # read in a DataLoader worker process (spawned: nothing inherited) as every format is
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    for p, item in enumerate(loader):
        assert item["tokens"].tolist() == open_packed(out).pack(p).tokens.tolist()


def text_only_sample(directory: Path) -> Path:
    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    for record in records:
        record.pop("image", None)
        for turn in record["conversations"]:
            turn["value"] = turn["value"].replace("<image>", "").strip()
    path = directory / "text.json"
    path.write_text(json.dumps(records))
    return path


def test_records_with_images_are_skipped_with_their_reason_and_only_images_stop_the_run(tmp_path, capsys):
    from neva_pack.cli import main

    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    text = json.loads(text_only_sample(tmp_path).read_text())
    mixed, images = tmp_path / "mixed.json", tmp_path / "images.json"
    mixed.write_text(json.dumps(records[:4] + text[4:]))
    images.write_text(json.dumps([record for record in records if "image" in record]))
    common = ["preprocess", "--quiet", "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path",
              str(SAMPLE_DATA / "tokenizer.model"), "--num_workers", "0", "--max_seq_length", "512", "--max_skip_fraction", "1",
              "--output_format", "bridge_parquet"]  # fmt: skip
    assert main([*common, "--data_path", str(mixed), "--output_dir", str(tmp_path / "mixed")]) == 0
    skipped = [json.loads(line) for line in (tmp_path / "mixed" / paths.SKIPPED_FILE).read_text().splitlines()]
    assert sorted(s["index"] for s in skipped if s["reason"] == "images_not_held") == [0, 1, 2, 3]  # records[:4] have images
    capsys.readouterr()
    assert main([*common, "--data_path", str(images), "--output_dir", str(tmp_path / "images")]) == 2
    error = capsys.readouterr().err.strip()
    assert "has images" in error and "--output_format bridge_parquet" in error and "compact" in error and "\n" not in error


def test_a_rows_file_that_would_run_code_is_refused_with_one_line(tmp_path):
    """Our reader unpickles only an object array of dicts (as Bridge's restricted unpickler does)."""
    import pickle

    from neva_pack.core import InputError

    write_golden_packs(tmp_path, "bridge", "size256_mult1")
    path = tmp_path / "training_256.npy"
    header = path.read_bytes()[: path.read_bytes().index(b"\n") + 1]
    path.write_bytes(header + pickle.dumps(print))
    with pytest.raises(InputError, match="training_256.npy: damaged .*builtins.print"):
        open_packed(tmp_path)


def _rows_file_with(tmp_path, payload: bytes):
    write_golden_packs(tmp_path, "bridge", "size256_mult1")
    path = tmp_path / "training_256.npy"
    header = path.read_bytes()[: path.read_bytes().index(b"\n") + 1]
    path.write_bytes(header + payload)
    return path


def test_a_rows_file_whose_pickle_would_run_a_command_never_runs_it(tmp_path):
    """A pickle calls whatever global it names: ``os.system`` here, refused before it is called."""
    import pickle

    from neva_pack.core import InputError

    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            import os

            return os.system, (f"touch {marker}",)

    _rows_file_with(tmp_path, pickle.dumps([{"input_ids": Exploit()}], protocol=2))
    with pytest.raises(InputError) as error:
        open_packed(tmp_path)
    assert "training_256.npy: damaged" in str(error.value) and "system is not part of a packed SFT file" in str(error.value)
    assert "\n" not in str(error.value) and not marker.exists()


def test_a_rows_file_asking_numpy_for_a_huge_array_is_refused_before_allocating(tmp_path):
    """numpy's own ``_reconstruct`` allocates the shape it is handed: 10**12 elements from a few bytes."""
    import pickle
    import time

    from neva_pack.core import InputError

    class Huge:
        def __reduce__(self):
            from numpy._core.multiarray import _reconstruct

            return _reconstruct, (np.ndarray, (10**12,), b"b")

    _rows_file_with(tmp_path, pickle.dumps(Huge(), protocol=3))
    started = time.perf_counter()
    with pytest.raises(InputError, match=r"training_256.npy: damaged .*not as np.save writes one"):
        open_packed(tmp_path)
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("spec", ["V1000000000", "U8", [("a", "O")]])
def test_a_rows_file_with_another_dtype_is_refused(tmp_path, spec):
    import pickle

    from neva_pack.core import InputError

    class Odd:
        def __reduce__(self):
            return np.dtype, (spec, False, True)

    _rows_file_with(tmp_path, pickle.dumps(Odd(), protocol=2))
    with pytest.raises(InputError, match=r"training_256.npy: damaged .*is not part of a packed SFT file"):
        open_packed(tmp_path)
