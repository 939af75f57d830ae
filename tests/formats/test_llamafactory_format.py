"""--output_format llamafactory against LLaMA-Factory's own preprocessing, packing and collator.

tests/golden/llamafactory/{qwen2_5_vl,qwen3_vl,llava}.npz were made by running LLaMA-Factory 0.9.5 (README there): its
own sft preprocessing and neat packing of the sample records, in our plan's grouping, and its
collator over each of its rows and each row of our directory, which it found equal. Here, without
LLaMA-Factory (its pins, transformers <= 5.6 and datasets <= 4.0, exclude it from this project's
environment): our rows are its rows, column by column; the directory loads with ``load_from_disk``
as its ``tokenized_path`` does; the images our rows carry give its collator's ``pixel_values`` (bit
for bit: the sha256 of the float32 bytes), and for Qwen its ``image_grid_thw`` and the samples its
mRoPE ``position_ids`` (all four rows); a tiny model's loss on its batches is our proof's.

LLaVA-1.5 (``template: llava``, its LlavaPlugin: 576 ``<image>`` ids an image, CLIP ViT-L/14-336 crops)
is the fixed-crop case; LLaVA-NeXT / OneVision (anyres) is refused in one line (``test_a_llava_next_run_is_refused_in_one_line``
says why).
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


LLAVA_IMAGE = 990
"""``<image>`` in the LLaVA tokenizer (tests/golden/llamafactory/llava_tokenizer)."""


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory):
    """Our output of the case (Qwen2.5-VL, Qwen3-VL) and LLaMA-Factory's golden data of it."""
    return build(tmp_path_factory.mktemp(request.param), request.param), np.load(GOLDEN / f"{request.param}.npz"), request.param


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """Our output of the LLaVA-1.5 case (6 packs of 2 to 4 samples, 16 images) and LLaMA-Factory's golden data of it."""
    return build(tmp_path_factory.mktemp("llava"), "llava"), np.load(GOLDEN / "llava.npz"), "llava"


def test_rows_are_llamafactorys_own_packed_rows(qwen):
    check_rows(qwen)


def test_llava_rows_are_llamafactorys_own_packed_rows(llava):
    """v1 under the default --tokenization renders what LLaMA-Factory's ``llava`` template tokenizes, one call per
    element: no BOS, the system, ``USER: ... ASSISTANT:``, the answer and EOS trained, a space before each later
    round, each image 576 ``<image>`` ids (its LlavaPlugin: (336 / 14)² + 1 - 1 for the CLS feature dropped)."""
    check_rows(llava)
    reader = open_packed(llava[0])
    row = reader.row(0)
    ids = np.asarray(row["input_ids"])
    assert np.count_nonzero(ids == LLAVA_IMAGE) == 576 * len(row["images"]) and ids[0] != 1  # no BOS
    reader.close()


def check_rows(case) -> None:
    out, golden, kind = case
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
        assert len(row["images"]) == int(golden[f"batch{p}_pixel_values_shape"][0] if kind == "llava" else len(golden[f"batch{p}_image_grid_thw"]))
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


def test_llava_crops_give_llamafactorys_pixel_values_and_its_positions(llava):
    """Its collator re-runs CLIP's processor on our 336 x 336 PNG crops (a resize to the size they have, a centre
    crop of all of them): the pixel values of the crop our run made from the original, bit for bit, which are
    what its own preprocessing makes from the original (the samples' images are under its image_max_pixels,
    which would otherwise shrink them first); its position_ids are the rows' (restarting per sample)."""
    from neva_pack.reading import PackedSeqDataset

    out, golden, _ = llava
    items, reader = PackedSeqDataset(out), open_packed(out)
    for p in range(len(reader)):
        pixels = items[p]["image"].numpy()  # the crops, normalised as the processor does
        assert list(pixels.shape) == golden[f"batch{p}_pixel_values_shape"].tolist() and pixels.shape[1:] == (3, 336, 336)
        assert hashlib.sha256(pixels.astype(np.float32).tobytes()).hexdigest() == str(golden[f"batch{p}_pixel_values_sha256"])
        assert golden[f"batch{p}_position_ids"][0].tolist() == reader.row(p)["position_ids"]
    reader.close()


def test_a_tiny_llava_through_llamafactorys_collator_gives_our_proofs_loss(llava):
    """The tiny LlavaForConditionalGeneration (CLIP-L/14-336 geometry, 1 layer; saved beside the golden data)
    LLaMA-Factory computed each batch's loss with: our packed-equals-unpacked proof gives it, each sample of
    the pack run alone (``PackedSamples``, float64), their summed next-token loss over their trained targets
    divided by the targets' count, pack by pack (its loss is the mean over the pack's trained labels)."""
    import torch
    import torch.nn.functional as F
    import transformers

    from neva_pack.reading import PackedSamples, PackedSeqDataset
    from neva_pack.training import HF_IGNORE_INDEX, hf_collate

    out, golden, _ = llava
    model = transformers.LlavaForConditionalGeneration.from_pretrained(GOLDEN / "llava_model").double().eval()
    assert model.config.image_token_id == LLAVA_IMAGE
    packs = PackedSeqDataset(out)
    samples, collate = PackedSamples(packs), hf_collate(packs, image_token_id=LLAVA_IMAGE)
    for p in range(len(packs)):
        total, targets = 0.0, 0
        with torch.no_grad():
            for j in range(int(samples.offsets[p]), int(samples.offsets[p + 1])):
                row = collate([samples[j]])
                inputs = {key: row[key] for key in ("input_ids", "position_ids", "pixel_values") if key in row}
                logits = model(**inputs, use_cache=False).logits[0]
                total += float(F.cross_entropy(logits, row["shift_labels"][0], ignore_index=HF_IGNORE_INDEX, reduction="sum"))
                targets += int(row["shift_labels"].ne(HF_IGNORE_INDEX).sum())
        assert total / targets == pytest.approx(float(golden[f"batch{p}_loss"]), rel=1e-6), p


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
    check_convert(qwen, tmp_path)


def test_convert_of_a_compact_llava_run_writes_the_same_rows(llava, tmp_path):
    """The same for fixed crops (read back from compact as one uint8 array, not as stored images)."""
    check_convert(llava, tmp_path)


def check_convert(built, tmp_path) -> None:
    from neva_pack.cli import main

    out, _, case = built
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


def test_a_llava_next_run_is_refused_in_one_line(tmp_path, capsys):
    """LLaVA-NeXT (anyres) does not apply: LLaMA-Factory's llava_next plugin counts an image's tokens as
    transformers' processor does, from the original's size, but its collator re-runs that processor on the
    image a row holds, and our store keeps only the base image and the tiles cut from the original, from which
    the processor cannot make them again (and its 0.9.5 has no OneVision plugin at all)."""
    import json

    from neva_pack.cli import main
    from tests.llamafactory_workload import LLAVA_TOKENIZER

    record = {"id": "a", "image": "coffee.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                                                  {"from": "gpt", "value": "Coffee."}]}  # fmt: skip
    (tmp_path / "data.json").write_text(json.dumps([record]))
    code = main(["preprocess", "--quiet", "--data_path", str(tmp_path / "data.json"), "--image_folder", str(SAMPLE_DATA / "images"),
                 "--tokenizer_path", str(LLAVA_TOKENIZER), "--hf_vision_encoder", "llava-hf/llava-v1.6-vicuna-7b-hf",
                 "--conv_template", "v1", "--output_format", "llamafactory", "--output_dir", str(tmp_path / "out"),
                 "--num_workers", "0"])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("neva-pack: error: --output_format llamafactory: cannot hold the images of llava-hf/llava-v1.6-vicuna-7b-hf")
    assert "re-runs the model's processor on each original image" in errors[0]
    assert not (tmp_path / "out" / "packed_seq_dataset.llamafactory").exists()


def test_the_docs_llava_lines_are_the_ones_tested():
    """docs/training_llamafactory.md's LLaVA-1.5 section: the flags and the YAML template of the case above."""
    import re

    from tests.llamafactory_workload import ENCODERS

    page = (SAMPLE_DATA.parent / "docs" / "training_llamafactory.md").read_text(encoding="utf-8")
    section = page.split("## 3. LLaVA-1.5", 1)[1].split("\n## ", 1)[0]
    command, yaml = re.findall(r"```(?:yaml)?\n(.*?)```", section, flags=re.S)[:2]
    encoder, template = ENCODERS["llava"]
    assert f"--hf_vision_encoder {encoder}" in command and f"--conv_template {template}" in command
    assert "--output_format llamafactory" in command and "--image_patch_id" in command and "--tokenization" not in command
    assert re.search(r"^template: llava\b", yaml, flags=re.M) and re.search(r"^neat_packing: true\b", yaml, flags=re.M)
    assert re.search(r"^tokenized_path: out/packed_seq_dataset\.llamafactory\b", yaml, flags=re.M)
