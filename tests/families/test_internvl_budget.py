"""InternVL's own tile budget for a record of several images (``--image_reference internvl``): its
fine-tuning script (OpenGVLab/InternVL ``internvl_chat/internvl/train/internvl_chat_finetune.py``,
``multi_modal_multi_image_get_item``) tiles each of a record's n images with ``max_num = max(1,
max_dynamic_patch // n)``; the Hugging Face processor (the default reference) gives every image the whole
budget. The grids under a shared budget are ``dynamic_preprocess``'s with that ``max_num`` (golden for 6,
the reference loop for the others); a record's count, stored tiles, vision cost and model inputs follow it,
and a run records the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.families import ImageSource, dynamic_image_run, dynamic_processor, resolve_encoder, stored_vision_cost
from neva_pack.families.internvl import candidate_grids, closest_grid  # the family's own module
from neva_pack.files import paths
from neva_pack.reading import PackedSeqDataset
from neva_pack.records import RawRecord
from neva_pack.samples import SampleBuilder
from neva_pack.text import load_template, load_tokenizer
from tests.families.test_internvl import internvl_tokenizer
from tests.image_zoo import random_rgb

ENCODER = "OpenGVLab/InternVL3_5-8B-HF"
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "internvl" / "dynamic_preprocess_grids.npz"


def test_each_of_n_images_gets_max_1_12_over_n_tiles_and_the_processor_gives_each_12():
    internvl, hf = (dynamic_processor(resolve_encoder(ENCODER), arithmetic=a) for a in ("internvl", "transformers"))
    assert internvl.counts_images_per_sample and not hf.counts_images_per_sample
    assert [internvl.tile_budget(n) for n in range(1, 15)] == [12, 6, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert {hf.tile_budget(n) for n in range(1, 15)} == {12}
    assert (internvl.grid(10_000, 10), internvl.grid(10_000, 10, sample_images=2), internvl.grid(10_000, 10, sample_images=3)) == ((12, 1), (6, 1), (4, 1))
    assert internvl.tokens_for_size(10_000, 10, sample_images=7) == 256  # one tile, no thumbnail
    assert hf.grid(10_000, 10) == (12, 1)


def test_a_shared_budget_is_dynamic_preprocess_with_that_max_num():
    """Budget 6 (two images): InternVL's own grids, golden (every size 1..120 per side); budgets 4, 3 and 2 (three
    to six images): the reference's loop over its candidates, on random sizes and the ties."""
    golden = np.load(GOLDEN)
    internvl = dynamic_processor(resolve_encoder(ENCODER), arithmetic="internvl")
    for (width, height), expected in zip(golden["small_sizes"].tolist(), golden["grids_1_6"].tolist()):
        assert internvl.grid(width, height, sample_images=2) == tuple(expected), (width, height)
    rng = np.random.default_rng(3)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 6000, (500, 2))] + [(5, 2), (5, 1), (3, 1), (4, 3), (896, 448)]
    for n, budget in ((3, 4), (4, 3), (5, 2), (6, 2)):
        grids = candidate_grids(1, budget, "internvl")
        for width, height in sizes:
            assert internvl.grid(width, height, sample_images=n) == closest_grid(width, height, 448, grids), (n, width, height)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return internvl_tokenizer(tmp_path_factory.mktemp("internvl_budget_tok"))


@pytest.fixture(scope="module")
def wide_images(tmp_path_factory):
    """Images whose grid the budget decides: a 10:1 strip (10 x 1 of 12, 6 x 1 of 6, 4 x 1 of 4) and a 3:1 one."""
    folder = tmp_path_factory.mktemp("internvl_budget_images")
    for width, height in ((2000, 200), (1200, 400), (700, 500)):
        random_rgb(width, height, seed=width).save(folder / f"w{width}.png")
    return folder


@pytest.mark.parametrize("arithmetic", ["internvl", "transformers"])
def test_a_record_of_three_images_is_counted_stored_and_read_with_its_share(tokenizer_dir, wide_images, arithmetic):
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = resolve_encoder(ENCODER)
    processor = dynamic_processor(encoder, arithmetic=arithmetic)
    builder = SampleBuilder(
        tokenizer=tokenizer, template=load_template("internvl"), image_source=ImageSource(wide_images),
        preprocessor=processor, image_run=dynamic_image_run(tokenizer, encoder.family), max_seq_length=100_000,
    )  # fmt: skip
    names = ["w2000.png", "w1200.png", "w700.png"]
    record = {"id": "r", "image": names, "conversations": [{"from": "human", "value": "<image>\n<image>\n<image>\nCompare."},
                                                          {"from": "gpt", "value": "Three."}]}  # fmt: skip
    sample = builder.build(RawRecord(index=0, value=record))
    alone = builder.build(RawRecord(index=1, value={**record, "image": names[:1], "conversations": [
        {"from": "human", "value": "<image>\nOne."}, {"from": "gpt", "value": "One."}]}))  # fmt: skip
    budget = 4 if arithmetic == "internvl" else 12
    sizes = [(2000, 200), (1200, 400), (700, 500)]
    grids = [closest_grid(w, h, 448, candidate_grids(1, budget, arithmetic)) for w, h in sizes]
    tiles = [c * r + (c * r > 1) for c, r in grids]
    assert sample.image_tokens.tolist() == [256 * t + 2 for t in tiles]
    assert alone.image_tokens.tolist() == [256 * (10 + 1) + 2]  # alone, the whole budget under either reference
    assert [image.parts[0].shape[1:] for image in sample.images] == [(448 * r, 448 * c) for c, r in grids]
    assert sample.vision_cost == sum(stored_vision_cost(processor, image) for image in sample.images) == sum(tiles) * 1024**2
    inputs = processor.model_inputs(list(sample.images))
    assert inputs["pixel_values"].shape == (sum(tiles), 3, 448, 448)


def test_a_run_shares_the_budget_and_records_the_reference(tmp_path, tokenizer_dir, wide_images):
    """A -HF checkpoint directory (16 positions a tile), ``--image_reference internvl``: the two-image record's
    strips are 6 x 1 (+ thumbnail), the one-image record's 10 x 1; verify finds the packs sound."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(resolve_encoder(ENCODER).preprocessor_config))
    (checkpoint / "processor_config.json").write_text(json.dumps({"image_seq_length": 16}))
    (checkpoint / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14}}))
    records = [{"id": "two", "image": ["w2000.png", "w2000.png"], "conversations": [
                   {"from": "human", "value": "<image>\n<image>\nSame?"}, {"from": "gpt", "value": "Yes."}]},
               {"id": "one", "image": "w2000.png", "conversations": [
                   {"from": "human", "value": "<image>\nWide?"}, {"from": "gpt", "value": "Very."}]}]  # fmt: skip
    (tmp_path / "data.json").write_text(json.dumps(records))
    out = tmp_path / "out"
    assert main(["preprocess", "--quiet", "--data_path", str(tmp_path / "data.json"), "--image_folder", str(wide_images),
                 "--tokenizer_path", str(tokenizer_dir), "--hf_vision_encoder", str(checkpoint), "--conv_template", "internvl",
                 "--image_reference", "internvl", "--output_format", "compact", "--max_seq_length", "600",
                 "--output_dir", str(out)]) == 0  # fmt: skip
    assert not verify(paths.packed_prefix(out), progress=False).problems
    dataset = PackedSeqDataset(out)
    assert dataset.meta.image_processor["arithmetic"] == "internvl"
    tiles = sorted(len(dataset[p]["pixel_values"]) for p in range(len(dataset)))
    assert sum(tiles) == 2 * (6 + 1) + (10 + 1)
    image = load_tokenizer(tokenizer_dir).token_to_id("<IMG_CONTEXT>")
    assert sum(int((dataset[p]["tokens"] == image).sum()) for p in range(len(dataset))) == 16 * sum(tiles)
