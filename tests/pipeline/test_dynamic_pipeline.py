"""A Qwen2-VL run end to end: records with images of several sizes -> the sample store -> a compact
output that verifies, reads back through PackedSeqDataset with the processor its meta records, is the
same for 0 and 2 workers, and that convert refuses to turn into NeMo's fixed-crop format."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from neva_pack.files import paths
from neva_pack.cli import main
from neva_pack.reading import PackedSeqDataset
from neva_pack.families import processor_from_record, processor_record, resolve_encoder
from neva_pack.formats import FORMATS, open_packed
from neva_pack.commands import explore, load_lengths, verify
from neva_pack.text import load_tokenizer
from neva_pack.training import hf_collate, thd_collate
from tests.dynamic_models import (
    TOLERANCE,
    difference,
    loss_and_gradients,
    packed,
    qwen_model,
    samples_alone,
)

TOKENIZER = Path(__file__).resolve().parent.parent / "golden" / "dynamic" / "tokenizer.json"
ENCODER = resolve_encoder("Qwen/Qwen2-VL-7B-Instruct")
SIZES = [(120, 90), (300, 200), (60, 400), (120, 90)]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_run")
    (folder / "tok").mkdir()
    shutil.copy(TOKENIZER, folder / "tok" / "tokenizer.json")
    (folder / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "img").mkdir()
    rng = np.random.default_rng(0)
    for k, (width, height) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / "img" / f"i{k}.png")
    records = []
    for k in range(8):
        turns = [{"from": "human", "value": "<image>\nWhat is this?" if k % 3 else "Hello there"},
                 {"from": "gpt", "value": "A picture of things " * (k + 1)}]  # fmt: skip
        records.append({"id": str(k), "conversations": turns, **({"image": f"i{k % 4}.png"} if k % 3 else {})})
    records.append({"id": "two", "image": ["i0.png", "i1.png"],
                    "conversations": [{"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "two"}]})  # fmt: skip
    (folder / "data.json").write_text(json.dumps(records))
    return folder


def run(workload: Path, output_dir: Path, workers: int, *extra: str, max_seq_length: int = 256) -> int:
    return main(["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "img"),
                 "--tokenizer_path", str(workload / "tok"), "--hf_vision_encoder", "Qwen/Qwen2-VL-7B-Instruct",
                 "--conv_template", "qwen2_vl", "--output_format", "compact", "--max_seq_length", str(max_seq_length),
                 "--max_pixels", "50176", "--output_dir", str(output_dir), "--num_workers", str(workers), *extra])  # fmt: skip


def output_files(output_dir: Path) -> dict[str, bytes]:
    """The packed output's files by name (the meta, which records the run's settings and times, left out)."""
    prefix = paths.packed_prefix(output_dir)
    return {path.name: path.read_bytes() for path in sorted(prefix.parent.glob("packed_seq_dataset*"))
            if path.is_file() and path.suffix != ".json"}  # fmt: skip


@pytest.fixture(scope="module")
def unsharded(workload, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("unsharded")
    assert run(workload, output_dir, 0) == 0
    return output_dir


def test_a_qwen2_vl_run_writes_a_compact_output_that_reads_back_through_its_processor(workload, unsharded, tmp_path, capsys):
    shutil.copytree(unsharded, tmp_path / "zero")
    assert run(workload, tmp_path / "two", 2) == 0
    prefix = paths.packed_prefix(tmp_path / "zero")
    assert output_files(tmp_path / "two") == output_files(tmp_path / "zero")  # whatever the number of workers
    assert verify(prefix, progress=False).ok
    reader = open_packed(tmp_path / "zero")
    meta = reader.meta
    assert meta.image_shape is None and meta.image_processor["family"] == "native" and meta.image_processor["max_pixels"] == 50176
    processor = processor_from_record(meta.image_processor)
    packs = [reader.pack(p) for p in range(len(reader))]
    assert sum(pack.num_images for pack in packs) == 7
    for pack in packs:  # each image's run is its stored image's tokens plus <|vision_start|> and <|vision_end|>
        assert pack.image_lengths.tolist() == [image.tokens + 2 for image in pack.stored_images]
    dataset = PackedSeqDataset(tmp_path / "zero")  # its processor from the meta, no argument needed
    assert processor_record(ENCODER, dataset.processor) == meta.image_processor
    assert PackedSeqDataset(tmp_path / "zero", processor=processor).processor is processor  # an explicit one wins
    for p, pack in enumerate(packs):
        item = dataset[p]
        assert item["position_ids"].shape == (3, len(pack.tokens))
        assert item["image_grid_thw"].shape == (pack.num_images, 3)
    items = [dataset[p] for p in range(len(dataset))]
    for collate in (hf_collate(dataset), thd_collate(dataset, with_packed_seq_params=False)):
        batch = collate(items)  # the collates know a dynamic output from its meta
        assert torch.equal(batch["pixel_values"], torch.cat([item["pixel_values"] for item in items]))
        assert torch.equal(batch["image_grid_thw"], torch.cat([item["image_grid_thw"] for item in items]))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "zero"), str(tmp_path / "nemo"), "--to", "nemo"]) == 2
    assert "cannot hold" in capsys.readouterr().err


def test_a_sharded_qwen2_vl_run_gives_the_bytes_of_the_unsharded_one(workload, unsharded, tmp_path):
    """Each shard encodes its records (the part's fingerprint names the processor by its record),
    the final step joins the parts: the output is the unsharded run's, byte for byte."""
    for index in ("0", "1"):
        assert run(workload, tmp_path, 0, "--num_shards", "2", "--shard_index", index) == 0
    assert run(workload, tmp_path, 0, "--num_shards", "2") == 0
    assert output_files(tmp_path) == output_files(unsharded)
    assert verify(paths.packed_prefix(tmp_path), progress=False).ok


def test_a_shard_made_with_other_processor_settings_is_refused_by_the_join(workload, tmp_path, capsys):
    assert run(workload, tmp_path, 0, "--num_shards", "2", "--shard_index", "0") == 0
    assert main(["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "img"),
                 "--tokenizer_path", str(workload / "tok"), "--hf_vision_encoder", "Qwen/Qwen2-VL-7B-Instruct",
                 "--conv_template", "qwen2_vl", "--output_format", "compact", "--max_seq_length", "256",
                 "--max_pixels", "25088", "--output_dir", str(tmp_path), "--num_workers", "0",
                 "--num_shards", "2", "--shard_index", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert run(workload, tmp_path, 0, "--num_shards", "2") == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize("size", [64, 100])
def test_plan_from_a_dynamic_store_cuts_samples_as_a_run_at_that_size(workload, unsharded, tmp_path, size):
    """The store was built at 256; ``neva-pack plan`` at a size that cuts samples cuts each one before
    the first image run that does not fit whole (per-image run lengths), as a run built at that size."""
    sample_lengths = load_lengths(unsharded)
    assert np.any(sample_lengths.lengths > size) and sample_lengths.image_positions is None
    [row] = explore(sample_lengths, [size], ["first_fit_shuffle"])
    assert run(workload, tmp_path, 0, max_seq_length=size) == 0
    meta = open_packed(tmp_path).meta
    assert (row.packs, row.skipped) == (meta.num_packs, meta.counts.skipped)
    assert row.clipped == meta.counts.truncated



def test_a_tiny_qwen2_vl_trained_on_packs_of_a_real_output_gets_the_samples_loss_and_gradients(workload, unsharded):
    """The run's packs, read back (processor from the meta) and laid end to end in one ``hf_batch`` row,
    give a tiny randomly initialised Qwen2-VL (the stand-in tokenizer's vocabulary and special ids,
    float64) the summed loss and every gradient, vision tower included, of the samples run one by one."""
    tokenizer = load_tokenizer(workload / "tok")
    image, video, start, end = (tokenizer.token_to_id(token) for token in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    model = qwen_model(vocab_size=tokenizer.vocab_size, image=image, video=video, vision_start=start, vision_end=end)
    dataset = PackedSeqDataset(unsharded)
    reader = open_packed(unsharded)
    packs = [p for p in range(len(dataset)) if dataset.sample_images(p).sum()][:3]  # packs with images (several, of several sizes)
    assert sum(int(dataset.sample_images(p).sum()) for p in packs) >= 3 and any(len(dataset.sample_images(p)) > 1 for p in packs)
    alone = [run for p in packs for run in samples_alone(reader.pack(p), dataset.sample_images(p), dataset.processor, "native", image)]
    assert difference(packed(model, [dataset[p] for p in packs], image), loss_and_gradients(model, alone)) < TOLERANCE


@pytest.mark.parametrize("fmt", [name for name, f in FORMATS.items() if not f.holds_dynamic_images])
def test_a_format_without_dynamic_images_refuses_a_dynamic_encoder_in_one_line(workload, tmp_path, capsys, fmt):
    """NeMo's float crops and the text-only formats (bridge, bridge_parquet) cannot hold images of their own
    sizes: the run stops before reading a record, naming the formats that can."""
    capsys.readouterr()
    assert run(workload, tmp_path, 0, "--output_format", fmt) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    able = [name for name, other in FORMATS.items() if other.holds_dynamic_images]
    assert len(lines) == 1 and f"--output_format {fmt}" in lines[0] and all(name in lines[0] for name in able)
    assert not paths.packed_prefix(tmp_path).parent.joinpath("packed_seq_dataset").exists()


def test_verify_finds_a_stored_image_whose_token_count_disagrees_with_its_run(unsharded, tmp_path):
    """An image record edited after the run (its tokens no longer the run's length less the
    delimiters) is reported for the pack that uses it, besides the checksum that changed."""
    from neva_pack.sample_store import POOL_IMAGE_ROW

    shutil.copytree(unsharded, tmp_path / "out")
    records_file = next(paths.store_dir(tmp_path / "out").glob("*.image_shapes"))
    records = np.fromfile(records_file, dtype=POOL_IMAGE_ROW)
    records["tokens"][0] += 1
    records.tofile(records_file)
    problems = verify(paths.packed_prefix(tmp_path / "out"), progress=False).problems
    assert any("the stored images take" in problem for problem in problems), problems
