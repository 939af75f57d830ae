"""Proof on a real model: LLaVA-OneVision tiles an image only when it is its sample's only one, and
its model (``LlavaOnevisionForConditionalGeneration``) tells the two kinds apart by
``batch_num_images`` alone, one count per sample. A run of the command line (a tiny randomly
initialised OneVision checkpoint as ``--hf_vision_encoder``, the shipped ``anyres_max_9`` settings,
the stand-in tokenizer) with a two-image sample, one-image samples of several sizes (one pooled)
and a text-only sample reads back with each sample's count, in pack order, in the pack items, the
one-sample items, ``hf_batch`` and ``thd_batch``; the packs as one ``hf_batch`` row give the model
(float64, CPU) the samples' one-by-one summed loss and every gradient, vision tower included, within
1e-9 relative. Without the counts, or with wrong ones, the model refuses the batch."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from neva_pack.cli import main
from neva_pack.reading import PackedSamples, PackedSeqDataset, dynamic_pack_item
from neva_pack.formats import open_packed
from neva_pack.text import load_tokenizer
from neva_pack.training import hf_batch, hf_collate, thd_collate
from tests.dynamic_models import TOLERANCE, difference, loss_and_gradients, onevision_model, samples_alone
from tests.dynamic_references import stand_in_tokenizer
from tests.image_zoo import MPL, SKIMAGE, random_rgb

RECORDS = [
    ("Compare them.", ["coffee.png", "text.png"]),
    ("Who is this?", ["grace_hopper.jpg"]),
    ("No image here, just a longer question about things.", []),
    ("And this noise?", ["r1200x900.png"]),
    ("Tiny?", ["r30x40.png"]),
]
"""Prompts and their images: two together (each untiled), three alone (2 x 2 tiles; 3 x 4 tiles,
pooled by anyres_max_9; one tile), none."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onevision_run")
    (folder / "img").mkdir()
    shutil.copy(MPL / "grace_hopper.jpg", folder / "img")
    for name in ("coffee.png", "text.png"):
        shutil.copy(SKIMAGE / name, folder / "img" / name)
    for width, height in ((1200, 900), (30, 40)):
        random_rgb(width, height, seed=width).save(folder / "img" / f"r{width}x{height}.png")
    (folder / "tok").mkdir()
    stand_in_tokenizer(folder / "tok", "qwen")
    tokenizer = load_tokenizer(folder / "tok")
    (folder / "model").mkdir()
    model = onevision_model(folder / "model", vocab_size=tokenizer.vocab_size, image=tokenizer.token_to_id("<image>"))
    records = [{"id": str(k), "conversations": [{"from": "human", "value": "<image>\n" * len(names) + prompt},
                                                {"from": "gpt", "value": f"An answer of {k + 2} words " * (k + 2)}],
                **({"image": names} if names else {})} for k, (prompt, names) in enumerate(RECORDS)]  # fmt: skip
    (folder / "data.json").write_text(json.dumps(records))
    output = folder / "out"
    assert main(["preprocess", "--quiet", "--data_path", str(folder / "data.json"), "--image_folder", str(folder / "img"),
                 "--tokenizer_path", str(folder / "tok"), "--hf_vision_encoder", str(folder / "model"),
                 "--conv_template", "qwen_1_5", "--output_format", "compact", "--max_seq_length", "1024",
                 "--pad_to_multiple_of", "8", "--output_dir", str(output), "--num_workers", "0"]) == 0  # fmt: skip
    dataset = PackedSeqDataset(output)
    assert dataset.meta.counts.skipped == 0 and len(dataset) > 1
    return model, dataset, tokenizer.token_to_id("<image>")


def per_sample_images(dataset) -> list[int]:
    """Each sample's images in pack order, as the run's plan records them (by record)."""
    table = open_packed(dataset.prefix).plan_table()
    return [len(RECORDS[int(record)][1]) for record in table.record_index]


def test_every_onevision_batch_carries_each_samples_image_count_in_pack_order(run):
    _, dataset, image = run
    counts = per_sample_images(dataset)
    packs = [dataset[p] for p in range(len(dataset))]
    assert torch.equal(torch.cat([item["batch_num_images"] for item in packs]), torch.tensor(counts))
    assert all(item["batch_num_images"].dtype == torch.int64 for item in packs)
    # the two-image sample shares a pack with another sample; its images are one tile, the others more
    [mixed] = [item for item in packs if 2 in item["batch_num_images"].tolist()]
    assert len(mixed["batch_num_images"]) > 1
    tiles = (mixed["pixel_values"].flatten(2).abs().sum(-1) > 0).sum(1)
    untiled = np.repeat(mixed["batch_num_images"].numpy() == 2, mixed["batch_num_images"].numpy())
    assert (tiles[untiled] == 1).all() and (tiles[~untiled] > 1).all()
    row = hf_collate(dataset, image)(packs)
    assert torch.equal(row["batch_num_images"], torch.tensor(counts)) and int(row["batch_num_images"].sum()) == len(row["pixel_values"])
    thd = thd_collate(dataset, with_packed_seq_params=False)(packs)
    assert torch.equal(thd["batch_num_images"], torch.tensor(counts)) and torch.equal(thd["pixel_values"], row["pixel_values"])
    samples = PackedSamples(dataset)
    ones = [samples[j] for j in range(len(samples))]
    assert [item["batch_num_images"].tolist() for item in ones] == [[n] for n in counts]
    assert torch.equal(hf_batch(ones, image, image_patch_id=image)["batch_num_images"], torch.tensor(counts))


def test_a_tiny_onevision_trained_on_packs_gets_the_samples_loss_and_gradients(run):
    model, dataset, image = run
    reader = open_packed(dataset.prefix)
    row = hf_batch([dataset[p] for p in range(len(dataset))], image, image_patch_id=image)
    alone = [one for p in range(len(dataset)) for one in samples_alone(reader.pack(p), dataset.sample_images(p), dataset.processor, "anyres", image)]
    assert sum(len(batch.get("pixel_values", ())) for batch, _ in alone) == 5
    reference = loss_and_gradients(model, alone)
    assert any(name.startswith("model.vision_tower") for name in reference[1])
    assert difference(loss_and_gradients(model, [(row, row["shift_labels"][0])]), reference) < TOLERANCE


def test_onevision_batches_without_the_counts_or_with_wrong_ones_fail_clearly(run):
    model, dataset, image = run
    row = hf_batch([dataset[p] for p in range(len(dataset))], image, image_patch_id=image)
    targets = row["shift_labels"][0]
    counts = row["batch_num_images"]
    without = {key: value for key, value in row.items() if key != "batch_num_images"}  # every image taken as tiled
    one_each = torch.ones(int(counts.sum()), dtype=torch.long)  # per image, not per sample
    shifted = torch.roll(counts, 1)  # another sample's count at each sample
    assert not torch.equal(shifted, counts)
    for wrong in (without, {**row, "batch_num_images": one_each}, {**row, "batch_num_images": shifted}):
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            loss_and_gradients(model, [(wrong, targets)])
    # a pack read with counts other than those its images were stored for is refused before the model
    p = next(p for p in range(len(dataset)) if 2 in dataset.sample_images(p).tolist())
    with pytest.raises(ValueError, match=r"image \d+ of the pack is stored (un)?tiled in a sample of"):
        dynamic_pack_item(open_packed(dataset.prefix).pack(p), moved_count(dataset.sample_images(p)), dataset.processor, image)


def moved_count(counts: np.ndarray) -> np.ndarray:
    """The same images, the two-image sample counting one of them and the next sample one more."""
    changed = counts.copy()
    k = int(np.flatnonzero(changed == 2)[0])
    changed[k] -= 1
    changed[(k + 1) % len(changed)] += 1
    return changed
