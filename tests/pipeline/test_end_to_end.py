"""The whole run on sample_data, read back the way training reads it.

Invariants checked on every pack (DESIGN.md): 4 float32 items, cu_seqlens from 0 to
len(tokens), lengths <= max_seq_length, the k-th image belongs to the k-th image run,
labels are next-token targets or -1 and never cross samples, every sample exactly once.
"""

import json
import shutil
import tarfile
import warnings

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.reading import PackedSeqDataset, collate, position_ids_from_cu_seqlens
from neva_pack.families import decode_image, resolve_encoder
from neva_pack.families.fixed import ImagePreprocessor
from neva_pack.sample_store import SampleStore
from neva_pack.files import bin_path, idx_path, meta_path, packed_prefix, skipped_path, stats_path, store_dir
from neva_pack.formats import FORMATS

MAX = 2048


def megatron_indexed_dataset(prefix, multimodal=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix), multimodal=multimodal)


def run(capsys, *args):
    code = main(["preprocess", "--quiet", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def base_args(data, output_dir, *extra):
    return [
        "--data_path", data["data_path"], "--image_folder", data["image_folder"],
        "--tokenizer_path", data["tokenizer_path"], "--output_dir", output_dir,
        "--conv_template", "v1", "--image_aspect_ratio", "pad", "--max_seq_length", MAX,
        "--num_workers", "0", "--seed", "42", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """One v1/pad run over sample_data, shared by the read-back tests."""
    from tests.conftest import SAMPLE_DATA

    output_dir = tmp_path_factory.mktemp("out")
    data = {
        "data_path": SAMPLE_DATA / "llava_sample.json",
        "image_folder": SAMPLE_DATA / "images",
        "tokenizer_path": SAMPLE_DATA / "tokenizer.model",
    }
    assert main(["preprocess", "--quiet", *map(str, base_args(data, output_dir, "--global_batch_size", "64"))]) == 0
    return {"dir": output_dir, "prefix": packed_prefix(output_dir), "data": data}


def test_output_files_and_meta(packed):
    """The nemo format's files (.bin, .idx, the plan table, the meta), the sample store, the skipped
    list and the stats: nothing else."""
    out = packed["dir"]
    expected = [*FORMATS["nemo"].files(packed_prefix(out)).final, store_dir(out), skipped_path(out), stats_path(out)]
    assert sorted(out.iterdir()) == sorted(expected) and len(expected) == 7
    meta = json.loads(meta_path(packed_prefix(packed["dir"])).read_text())
    assert meta["crop_size"] == [336, 336] and meta["template"] == "v1"
    assert meta["algorithm"] == "first_fit_shuffle" and meta["seed"] == 42
    assert meta["counts"]["records"] == 20 and meta["counts"]["samples"] == 20
    stats = json.loads(stats_path(packed["dir"]).read_text())
    assert stats["records"]["skipped"] == 0 and skipped_path(packed["dir"]).read_text() == ""
    assert stats["packing"]["packs"] == meta["num_packs"]
    assert any(line.startswith("model.global_batch_size=") for line in stats["training_overrides"])


def test_nemo_layout_read_directly_with_megatron(packed):
    """What NeMo's NevaPackedSeqDatatset does: IndexedDataset(prefix), 4 items per document."""
    ds = megatron_indexed_dataset(packed["prefix"])
    docs = ds.document_indices
    assert np.all(np.diff(docs) == 4)
    multimodal = megatron_indexed_dataset(packed["prefix"], multimodal=True)  # keep it: its mmap backs the modes
    modes = multimodal.index.sequence_modes  # (the sequence_modes property asserts on an array)
    assert list(modes[:8]) == [0, 0, 0, 1, 0, 0, 0, 1]
    for p in range(len(docs) - 1):
        cu, tokens, labels, image = (ds[docs[p] + k] for k in range(4))
        assert cu.dtype == np.float32 and tokens.dtype == np.float32 and image.dtype == np.float32
        assert cu[0] == 0 and cu[-1] == len(tokens) == len(labels) <= MAX
        assert np.all(np.diff(cu) > 0)
        assert image.size % (3 * 336 * 336) == 0 and image.size > 0


def sample_store(packed):
    return SampleStore(store_dir(packed["dir"]))


def test_every_sample_is_packed_exactly_once(packed):
    store = sample_store(packed)
    expected = sorted(tuple(store.tokens_labels(i)[0].tolist()) for i in range(len(store)))
    got = []
    for pack in PackedSeqDataset(packed["prefix"]):
        cu = pack["cu_seqlens"].tolist()
        got += [tuple(pack["tokens"][a:b].tolist()) for a, b in zip(cu, cu[1:])]
    assert sorted(got) == expected and len(got) == 20


def test_labels_are_next_token_targets_within_each_sample(packed):
    for pack in PackedSeqDataset(packed["prefix"]):
        tokens, labels, cu = pack["tokens"].numpy(), pack["labels"].numpy(), pack["cu_seqlens"].tolist()
        for a, b in zip(cu, cu[1:]):
            inner = labels[a : b - 1]
            assert np.all((inner == -1) | (inner == tokens[a + 1 : b]))
            assert (labels[a:b] != -1).any()  # every sample trains on its answer
            assert labels[b - 1] != -1  # the final EOS of the sample's last answer


def test_kth_image_belongs_to_kth_image_run(packed):
    """Match each sample in each pack to its record and compare its images pixel for pixel."""
    records = json.loads(packed["data"]["data_path"].read_text())
    store = sample_store(packed)
    by_tokens = {tuple(store.tokens_labels(i)[0].tolist()): int(store.rows["record_index"][i]) for i in range(len(store))}
    pre = ImagePreprocessor(resolve_encoder("openai/clip-vit-large-patch14-336"), "pad")
    start_id = 4 + 3  # <extra_id_4> in the sample tokenizer: unk, bos, eos, then <extra_id_0..>
    seen_zero_image_pack = False
    for pack in PackedSeqDataset(packed["prefix"]):
        cu, tokens = pack["cu_seqlens"].tolist(), pack["tokens"].numpy()
        expected = []
        for a, b in zip(cu, cu[1:]):
            record = records[by_tokens[tuple(tokens[a:b].tolist())]]
            names = record.get("image", [])
            names = [names] if isinstance(names, str) else names
            expected += [pre.to_uint8(decode_image((packed["data"]["image_folder"] / n).read_bytes(), n)) for n in names]
        assert np.count_nonzero(tokens == start_id) == len(expected)
        if expected:
            assert np.array_equal(pack["image"].numpy(), pre.normalize(np.stack(expected)))
        else:
            seen_zero_image_pack = True
            assert pack["image"].shape == (1, 3, 336, 336) and not pack["image"].any()
    del seen_zero_image_pack  # sample_data packs always hold an image; the text-only test covers the other case


def test_training_reader_and_collate(packed):
    ds = PackedSeqDataset(packed["prefix"])
    assert ds.crop_size == (336, 336)
    item = ds[0]
    assert item["cu_seqlens"].dtype.is_floating_point is False and str(item["cu_seqlens"].dtype) == "torch.int32"
    assert str(item["tokens"].dtype) == "torch.int64" and item["image"].shape[1:] == (3, 336, 336)
    batch = collate([ds[0]])
    cu = item["cu_seqlens"]
    assert batch["position_ids"][0, : int(cu[1])].tolist() == list(range(int(cu[1])))
    assert batch["position_ids"][0, int(cu[1])] == 0
    assert batch["loss_mask"].sum() == (item["labels"] != -1).sum()
    assert batch["images_per_pack"].tolist() == [len(item["image"])] and "num_images" not in batch
    assert position_ids_from_cu_seqlens(__import__("torch").tensor([0, 3, 5])).tolist() == [0, 1, 2, 0, 1]


def test_same_output_bytes_for_any_number_of_workers(packed, tmp_path, capsys):
    code, _, _ = run(capsys, *base_args(packed["data"], tmp_path / "w2", "--global_batch_size", "64")[:-2],
                     "--num_workers", "2", "--global_batch_size", "64")  # fmt: skip
    assert code == 0
    for path_of in (bin_path, idx_path):
        a = path_of(packed_prefix(packed["dir"])).read_bytes()
        b = path_of(packed_prefix(tmp_path / "w2")).read_bytes()
        assert a == b


def test_tar_image_folder_gives_the_same_output(packed, tmp_path, capsys):
    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(packed["data"]["image_folder"], arcname=".")
    data = {**packed["data"], "image_folder": archive}
    code, _, _ = run(capsys, *base_args(data, tmp_path / "tar", "--global_batch_size", "64"))
    assert code == 0
    assert bin_path(packed_prefix(tmp_path / "tar")).read_bytes() == bin_path(packed_prefix(packed["dir"])).read_bytes()


# ---------------------------------------------------------------------------------------------
# Bad records and bad arguments


def test_bad_records_are_skipped_reported_and_counted(sample_dataset, tmp_path, capsys):
    root = sample_dataset["root"]
    (sample_dataset["image_folder"] / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (sample_dataset["image_folder"] / "notes.jpg").write_text("plain text named like a photo")
    good = {"id": "good", "image": "coffee.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Coffee."}]}
    bad = [
        ({**good, "id": "missing", "image": "nowhere.jpg"}, "missing_image"),
        ({**good, "id": "corrupt", "image": "corrupt.jpg"}, "unreadable_image"),
        ({**good, "id": "notimage", "image": "notes.jpg"}, "unreadable_image"),
        ({**good, "id": "empty", "conversations": []}, "empty_conversation"),
        ({**good, "id": "noconv", "conversations": None}, "malformed_record"),
        ({**good, "id": "alt", "conversations": [good["conversations"][0]] * 2}, "roles_not_alternating"),
        ({**good, "id": "role", "conversations": [{"from": "bot", "value": "x"}]}, "unknown_role"),
        ({**good, "id": "value", "conversations": [{"from": "human", "value": ["x"]}]}, "non_string_value"),
        ({**good, "id": "count", "image": ["coffee.jpg", "chelsea.jpg"]}, "placeholder_mismatch"),
    ]
    lines = [json.dumps(good)] + [json.dumps(r) for r, _ in bad] + ["{not json", json.dumps(good)]
    data_path = root / "bad.jsonl"
    data_path.write_text("\n".join(lines) + "\n")
    data = {**sample_dataset, "data_path": data_path}
    code, out, _ = run(capsys, *base_args(data, tmp_path / "o", "--max_skip_fraction", "1"))
    assert code == 0
    skipped = [json.loads(line) for line in skipped_path(tmp_path / "o").read_text().splitlines()]
    expected = [(i + 1, r["id"], reason) for i, (r, reason) in enumerate(bad)] + [(10, None, "malformed_json")]
    assert [(s["index"], s["id"], s["reason"]) for s in skipped] == expected
    assert all(s["detail"] for s in skipped)
    stats = json.loads(stats_path(tmp_path / "o").read_text())
    assert stats["records"] == {
        "total": 12, "packed": 2, "skipped": 10, "truncated": 0,
        "skipped_by_reason": {"missing_image": 1, "unreadable_image": 2, "empty_conversation": 1,
                              "malformed_record": 1, "roles_not_alternating": 1, "unknown_role": 1,
                              "non_string_value": 1, "placeholder_mismatch": 1, "malformed_json": 1},
    }  # fmt: skip
    assert "skipped: unreadable_image" in out
    code, _, err = run(capsys, *base_args(data, tmp_path / "strict", "--strict", "--max_skip_fraction", "1"))
    assert code == 1 and "--strict: 10 record(s) skipped" in err
    assert skipped_path(tmp_path / "strict").exists()


def test_text_only_packs_carry_one_zero_image_and_long_samples_are_truncated(sample_dataset, tmp_path, capsys):
    text = {"conversations": [{"from": "human", "value": "Tell me a long story. " * 10},
                              {"from": "gpt", "value": "Once upon a time. " * 60}]}  # fmt: skip
    short = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    data_path = sample_dataset["root"] / "text.json"
    data_path.write_text(json.dumps([text, short, short]))
    data = {**sample_dataset, "data_path": data_path}
    code, out, _ = run(capsys, *base_args(data, tmp_path / "t")[:-6], "--max_seq_length", "256",
                       "--num_workers", "0", "--conv_template", "v1")  # fmt: skip
    assert code == 0 and "truncated 1" in out
    for pack in PackedSeqDataset(packed_prefix(tmp_path / "t")):
        assert pack["image"].shape == (1, 3, 336, 336) and not pack["image"].any()
        assert len(pack["tokens"]) <= 256
    code, _, _ = run(capsys, *base_args(data, tmp_path / "nt")[:-6], "--max_seq_length", "256",
                     "--num_workers", "0", "--no_truncate")  # fmt: skip
    stats = json.loads(stats_path(tmp_path / "nt").read_text())
    assert stats["records"]["skipped_by_reason"] == {"too_long": 1}


@pytest.mark.parametrize(
    "change, message",
    [
        (("--data_path", "/nonexistent.json"), "--data_path /nonexistent.json: no such file"),
        (("--data_path", "/"), "--data_path /: not a regular file (a directory, device or FIFO)"),
        (("--tokenizer_path", "/nonexistent.model"), "--tokenizer_path /nonexistent.model: no such file"),
        (("--conv_template", "vicuna"), "--conv_template 'vicuna': unknown template"),
        (("--hf_vision_encoder", "facebook/dino"), "--hf_vision_encoder 'facebook/dino': not a local directory"),
        (("--max_seq_length", "1"), "--max_seq_length 1: must be between 2 and 16,777,216"),
        (("--image_folder", "/nonexistent"), "--image_folder /nonexistent: no such directory"),
        (("--tokenizer_path", "README.md"), "not a SentencePiece model"),
    ],
)
def test_bad_arguments_fail_at_once_with_one_line(sample_dataset, tmp_path, capsys, change, message):
    flag, value = change
    value = __file__ if value == "README.md" else value  # an existing file that is not a tokenizer
    code, _, err = run(capsys, *base_args(sample_dataset, tmp_path / "x"), flag, value)  # argparse: last one wins
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("neva-pack: error: ")
    assert message in err
    assert not store_dir(tmp_path / "x").exists()


def test_existing_output_is_refused_unless_overwrite(packed, tmp_path, capsys):
    target = tmp_path / "copy"
    shutil.copytree(packed["dir"], target)
    code, _, err = run(capsys, *base_args(packed["data"], target))
    assert code == 2 and "not empty" in err and "--resume" in err and "--overwrite" in err
    code, _, _ = run(capsys, *base_args(packed["data"], target, "--overwrite", "--global_batch_size", "64"))
    assert code == 0
    assert bin_path(packed_prefix(target)).read_bytes() == bin_path(packed_prefix(packed["dir"])).read_bytes()


def test_hparams_file_supplies_nemo_keys_and_flags_win(packed, tmp_path, capsys):
    hparams = tmp_path / "neva.yaml"
    hparams.write_text(
        "model:\n"
        "  encoder_seq_length: 4096\n"
        "  data:\n    conv_template: v1\n    image_aspect_ratio: pad\n"
        "  mm_cfg:\n    use_im_start_end: false\n"
        "    vision_encoder:\n      from_pretrained: openai/clip-vit-large-patch14-336\n"
        "      patch_dim: 14\n      crop_size: [336, 336]\n"
        "trainer:\n  devices: 8\n"
    )
    d = packed["data"]
    code, _, _ = run(capsys, "--hparams_file", hparams, "--data_path", d["data_path"], "--image_folder",
                     d["image_folder"], "--tokenizer_path", d["tokenizer_path"], "--output_dir", tmp_path / "h",
                     "--max_seq_length", MAX, "--seed", "42", "--num_workers", "0")  # fmt: skip
    assert code == 0
    meta = json.loads(meta_path(packed_prefix(tmp_path / "h")).read_text())
    assert meta["template"] == "v1" and meta["image_aspect_ratio"] == "pad" and meta["max_seq_length"] == MAX
    assert bin_path(packed_prefix(tmp_path / "h")).read_bytes() == bin_path(packed_prefix(packed["dir"])).read_bytes()
    hparams.write_text("model:\n  mm_cfg:\n    vision_encoder:\n      crop_size: [224, 224]\n")
    code, _, err = run(capsys, "--hparams_file", hparams, "--data_path", d["data_path"], "--tokenizer_path",
                       d["tokenizer_path"], "--output_dir", tmp_path / "h2")  # fmt: skip
    assert code == 2 and "crop_size [224, 224] disagrees" in err


def test_hugging_face_tokenizer_directory_end_to_end(sample_dataset, hf_tokenizer_dir, tmp_path, capsys):
    data = {**sample_dataset, "tokenizer_path": hf_tokenizer_dir}
    code, _, _ = run(capsys, *base_args(data, tmp_path / "hf")[:-8], "--conv_template", "chatml",
                     "--max_seq_length", MAX, "--num_workers", "0")  # fmt: skip
    assert code == 0
    ds = PackedSeqDataset(packed_prefix(tmp_path / "hf"))
    images = sum(len(p["image"]) for p in ds)
    assert images == 18  # no <extra_id_4>: 576 patch ids per image, runs counted through the images
