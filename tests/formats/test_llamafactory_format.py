"""--output_format llamafactory against LLaMA-Factory's own preprocessing, packing and collator.

tests/golden/llamafactory/{qwen2_5_vl,qwen3_vl}.npz were made by running LLaMA-Factory 0.9.5 (README there): its
own sft preprocessing and neat packing of the sample records, in our plan's grouping, and its
collator over each of its rows and each row of our directory, which it found equal. Here, without
LLaMA-Factory: our rows are its rows, column by column; the directory loads with ``load_from_disk``
as its ``tokenized_path`` does; the images our rows carry give its collator's ``pixel_values`` (bit
for bit: the sha256 of the float32 bytes) and ``image_grid_thw``, and the samples its mRoPE
``position_ids`` (all four rows).
"""

import hashlib
import itertools

import numpy as np
import pytest

from neva_pack.core import ConfigError
from neva_pack.families.native import mrope_position_ids
from neva_pack.files import paths
from neva_pack.formats import FORMATS, open_packed, read_meta
from tests.conftest import SAMPLE_DATA
from tests.llamafactory_workload import build

GOLDEN = SAMPLE_DATA.parent / "tests" / "golden" / "llamafactory"
IMAGE_PAD = 5
"""``<|image_pad|>`` in the stand-in Qwen2 tokenizer (tests/golden/dynamic)."""


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory):
    """Our output of the case (Qwen2.5-VL, Qwen3-VL) and LLaMA-Factory's golden data of it."""
    return build(tmp_path_factory.mktemp(request.param), request.param), np.load(GOLDEN / f"{request.param}.npz"), request.param


def test_rows_are_llamafactorys_own_packed_rows(qwen):
    out, golden, _ = qwen
    meta = read_meta(paths.meta_path(paths.packed_prefix(out)))
    assert meta.layout["cutoff_len"] == int(golden["cutoff_len"])
    reader = open_packed(out)
    assert len(reader) == sum(name.endswith("_right_padding_length") for name in golden.files) > 1
    for p in range(len(reader)):
        row = reader.row(p)
        for column in ("input_ids", "attention_mask", "position_ids", "labels"):
            assert row[column] == golden[f"row{p}_{column}"].tolist(), (p, column)
        params = row["packing_params"]
        assert params["sequence_boundaries"] == golden[f"row{p}_sequence_boundaries"].tolist()
        assert params["image_subseq_ids"] == golden[f"row{p}_image_subseq_ids"].tolist()
        assert params["right_padding_length"] == int(golden[f"row{p}_right_padding_length"])
        assert params["video_subseq_ids"] == params["audio_subseq_ids"] == [2**32]
        assert row["videos"] is None and row["audios"] is None
        assert len(row["images"]) == len(golden[f"batch{p}_image_grid_thw"])
        # its collator pads to a multiple of 8: the rows already are, so its ids and labels are the rows'
        assert golden[f"batch{p}_input_ids"][0].tolist() == row["input_ids"] and golden[f"batch{p}_labels"][0].tolist() == row["labels"]
    reader.close()


def test_the_directory_is_what_load_from_disk_reads_as_tokenized_path(qwen):
    from datasets import load_from_disk

    out, _, _ = qwen
    dataset = load_from_disk(str(out / "packed_seq_dataset.llamafactory"))
    reader = open_packed(out)
    assert len(dataset) == len(reader)
    assert dataset.column_names == ["input_ids", "attention_mask", "position_ids", "labels", "images", "videos", "audios", "packing_params"]
    assert dataset[3] == reader.row(3)
    assert isinstance(dataset[0]["images"][0], bytes)  # what LLaMA-Factory's _regularize_images opens


def test_images_give_llamafactorys_pixel_values_and_grids_and_samples_its_mrope(qwen):
    from neva_pack.reading import PackedSeqDataset

    out, golden, _ = qwen
    items, reader = PackedSeqDataset(out), open_packed(out)
    for p in range(len(reader)):
        item = items[p]
        pixels = item["pixel_values"].numpy()
        assert list(pixels.shape) == golden[f"batch{p}_pixel_values_shape"].tolist()
        assert hashlib.sha256(pixels.astype(np.float32).tobytes()).hexdigest() == str(golden[f"batch{p}_pixel_values_sha256"])
        grids = item["image_grid_thw"].numpy()
        assert grids.tolist() == golden[f"batch{p}_image_grid_thw"].tolist()
        row = reader.row(p)
        ids, bounds = np.asarray(row["input_ids"]), row["packing_params"]["sequence_boundaries"]
        counts = np.bincount(row["packing_params"]["image_subseq_ids"], minlength=len(bounds) - 1)
        starts = np.concatenate([[0], np.cumsum(counts)])
        expected = golden[f"batch{p}_position_ids"][:, 0]
        for k, (b0, b1) in enumerate(itertools.pairwise(bounds[:-1])):  # each sample alone, as its collator computes it
            positions = mrope_position_ids(ids[b0:b1] == IMAGE_PAD, grids[starts[k] : starts[k + 1]])
            assert np.array_equal(expected[1:, b0:b1], positions) and np.array_equal(expected[0, b0:b1], positions[0])
        pad = bounds[-1] - bounds[-2]
        assert np.array_equal(expected[:, bounds[-2] :], np.broadcast_to(np.arange(pad), (4, pad)))  # the padding: 0, 1, ...
    reader.close()


def test_a_tiny_model_gives_llamafactorys_loss_on_our_own_batches(qwen):
    """The tiny model LLaMA-Factory's loss was computed with (saved beside the golden data), on our own
    training batches of the same packs (``hf_collate``: next-token pairs, 4-row positions, no padding), each
    sample kept to itself by a block-diagonal mask made from the batch's ``cu_seq_lens_q``: the same loss,
    pack by pack (its rows' extra last id per sample and its padding change no trained position's logits)."""
    import torch
    import transformers

    from neva_pack.reading import PackedSeqDataset
    from neva_pack.training import hf_collate

    out, golden, case = qwen
    model_class = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration, "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}
    model = model_class[case].from_pretrained(GOLDEN / f"{case}_model").eval()
    items = PackedSeqDataset(out)
    collate = hf_collate(items, image_token_id=IMAGE_PAD)
    for p in range(len(items)):
        batch = collate([items[p]])
        bounds = batch["cu_seq_lens_q"].long()
        segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds.diff())
        keep = (segment[:, None] == segment[None, :]) & torch.ones(len(segment), len(segment), dtype=torch.bool).tril()
        inputs = {key: value for key, value in batch.items() if not key.startswith(("max_length", "cu_seq_lens"))}
        with torch.no_grad():
            loss = model(**inputs, attention_mask=torch.where(keep, 0.0, torch.finfo(torch.float32).min)[None, None]).loss
        assert loss.item() == pytest.approx(float(golden[f"batch{p}_loss"]), rel=1e-6), p


def test_convert_of_a_compact_run_writes_the_same_rows(qwen, tmp_path):
    """``neva-pack convert --to llamafactory`` of the same run written as compact: the same rows, byte for byte."""
    from neva_pack.cli import main

    out, _, case = qwen
    compact = build(tmp_path / "compact", case, output_format="compact")
    assert main(["convert", "--quiet", str(compact), str(tmp_path / "converted"), "--to", "llamafactory"]) == 0
    assert main(["verify", "--quiet", str(tmp_path / "converted")]) == 0
    for name in ("data-00000-of-00001.arrow", "state.json", "dataset_info.json"):
        converted = tmp_path / "converted" / "packed_seq_dataset.llamafactory" / name
        assert converted.read_bytes() == (out / "packed_seq_dataset.llamafactory" / name).read_bytes(), name


def test_settings_llamafactory_would_resize_again_say_so_in_one_line():
    from neva_pack.formats.llamafactory import resize_profile_warning

    assert resize_profile_warning(None) is None
    assert resize_profile_warning({"family": "native", "min_pixels": 3136, "max_pixels": 768 * 768}) is None
    line = resize_profile_warning({"family": "native", "min_pixels": 3136, "max_pixels": 12845056})
    assert "image_max_pixels: 12845056" in line and "--max_pixels 589824" in line and "\n" not in line
    line = resize_profile_warning({"family": "native", "min_pixels": 256, "max_pixels": 768 * 768})
    assert "image_min_pixels: 256" in line and "\n" not in line


def test_a_run_with_the_encoders_own_max_pixels_warns_in_one_line(tmp_path, capsys):
    """Qwen2.5-VL's own bound (12,845,056 pixels) is above LLaMA-Factory's image_max_pixels default: the
    run says so once, with the YAML line that trains its output."""
    from neva_pack.formats import llamafactory

    llamafactory.WARNED.clear()  # said once a process: another test's run may have said it
    build(tmp_path, "qwen2_5_vl", max_pixels=None)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "image_max_pixels: 12845056" in lines[0], lines


def test_anyres_images_are_refused_in_one_line(tmp_path):
    from neva_pack.core import ImageRun
    from neva_pack.formats import WriteSpec
    from neva_pack.formats.meta import Normalisation

    spec = WriteSpec(image_shape=None, normalisation=Normalisation(rescale_factor=1 / 255, mean=(0.5,) * 3, std=(0.5,) * 3),
                     pad_id=0, ignore_index=-1, pool=(), plan_digest="x", image_run=ImageRun(positions=None, patch_id=7, start_id=None),
                     image_processor={"family": "anyres", "encoder": "llava-hf/llava-v1.6-mistral-7b-hf"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--output_format llamafactory: cannot hold the images of llava-hf/llava-v1.6-mistral-7b-hf"):
        FORMATS["llamafactory"].writer(paths.packed_prefix(tmp_path), spec)
