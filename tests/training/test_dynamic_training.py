"""Proof on real models: tiny randomly initialised ``Qwen2VLForConditionalGeneration`` and
``LlavaNextForConditionalGeneration`` (CPU, float64) trained on a packed ``hf_batch`` of
dynamic-resolution samples (real photos at the shipped processors' settings, several images of
different sizes, a text-only sample, alignment padding) give the samples' summed loss and every
gradient, vision tower included, as the samples run one by one, within 1e-9 relative. The
unpacked reference is the model's own: Qwen computes its mRoPE ids itself (``get_rope_index``).
Wrong batches (positions not restarting per sample, text positions in place of mRoPE's, images
out of order, one image's grid transposed, Qwen's 3-row positions without the text row) move them
by far more. (The mRoPE rows of one sample shifted by a constant change nothing: rotary attention
sees differences only; what restarting buys is the packed mask, built from the text row.)"""

from __future__ import annotations

import json

import pytest
import torch

from neva_pack.reading import dynamic_pack_item
from neva_pack.families import dynamic_processor, resolve_encoder
from neva_pack.families.native import mrope_position_ids
from neva_pack.training import cp_partition_index, cp_slice, hf_batch, thd_batch
from tests.dynamic_models import (
    TEXT,
    TOLERANCE,
    difference,
    loss_and_gradients,
    one_by_one,
    packed,
    qwen_model,
    samples_alone,
)
from tests.dynamic_packs import IMAGE, build_pack, photo

WRONG = 1e-6
"""A wrong batch must move the loss or some gradient by more than this, relative."""


def next_model_and_processor(directory):
    """A tiny LLaVA-NeXT (CLIP tower: 336 px tiles, 48 px patches: 7 x 7 features per tile) and the
    processor of a checkpoint directory holding its config and the shipped llava-v1.6 settings."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    shipped = resolve_encoder("llava-hf/llava-v1.6-mistral-7b-hf").preprocessor_config
    torch.manual_seed(0)
    config = LlavaNextConfig(
        text_config={"model_type": "llama", **TEXT},
        vision_config={"model_type": "clip_vision_model", "image_size": 336, "patch_size": 48, "hidden_size": 16,
                       "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "projection_dim": 16},  # fmt: skip
        image_token_id=IMAGE, image_grid_pinpoints=shipped["image_grid_pinpoints"], vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    config.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(shipped))
    (directory / "processor_config.json").write_text(json.dumps({"num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}))
    return LlavaNextForConditionalGeneration(config).double(), dynamic_processor(resolve_encoder(str(directory)))


@pytest.fixture(scope="module")
def qwen():
    processor = dynamic_processor(resolve_encoder("Qwen/Qwen2-VL-7B-Instruct"), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 24)
    a, b, c, d = (processor.to_uint8(photo(name)) for name in ("astronaut", "coffee", "text", "retina"))
    assert a.tokens == d.tokens and a.parts[0].shape == d.parts[0].shape  # two square photos: the same grid
    assert b.parts[0].shape[1] != b.parts[0].shape[2]  # coffee: not square
    samples = [[4, a, 3, b, 5], [9], [2, c, 4, d, 3]]
    pack, counts = build_pack(samples, "native", multiple=8)
    return qwen_model(), processor, pack, counts, samples


def test_qwen2_vl_packed_equals_one_by_one(qwen):
    model, processor, pack, counts, samples = qwen
    item = dynamic_pack_item(pack, counts, processor, IMAGE)
    batch = hf_batch([item], IMAGE, image_patch_id=IMAGE)
    assert batch["position_ids"].shape == (4, 1, len(pack.tokens)) and batch["image_grid_thw"].shape == (4, 3)
    assert "batch_num_images" not in batch  # OneVision's alone (tests/training/test_onevision_training.py)
    reference = one_by_one(model, pack, counts, processor, "native")
    assert difference(packed(model, [item]), reference) < TOLERANCE

    # two packs in one row (hf_batch lays them end to end): the same
    packs = [build_pack(samples[:1], "native", 8), build_pack(samples[1:], "native", 8)]
    row = hf_batch([dynamic_pack_item(p, c, processor, IMAGE) for p, c in packs], IMAGE, image_patch_id=IMAGE)
    alone = [run for p, c in packs for run in samples_alone(p, c, processor, "native")]
    assert difference(loss_and_gradients(model, [(row, row["shift_labels"][0])]), loss_and_gradients(model, alone)) < TOLERANCE


def test_qwen2_vl_wrong_batches_fail_clearly(qwen):
    model, processor, pack, counts, samples = qwen
    reference = one_by_one(model, pack, counts, processor, "native")
    item = dynamic_pack_item(pack, counts, processor, IMAGE)
    batch = hf_batch([item], IMAGE, image_patch_id=IMAGE)
    targets = batch["shift_labels"][0]
    # positions not restarting: the pack's ids as one sequence's (then the samples see each other)
    whole = torch.from_numpy(mrope_position_ids(pack.tokens == IMAGE, item["image_grid_thw"].numpy()))[:, None]
    not_restarting = {**batch, "position_ids": torch.cat([torch.arange(len(pack.tokens))[None, None], whole])}
    assert difference(loss_and_gradients(model, [(not_restarting, targets)]), reference) > WRONG
    # the 1-D positions of a text collator on all rows (images laid out as text)
    text_only = {**batch, "position_ids": batch["position_ids"][:1].expand(4, -1, -1)}
    assert difference(loss_and_gradients(model, [(text_only, targets)]), reference) > WRONG
    # two images of the same grid swapped: accepted by every shape check, wrong pixels at each place
    swapped = [pack.stored_images[k] for k in (3, 1, 2, 0)]
    out_of_order = dynamic_pack_item(type(pack)(**{**_fields(pack), "stored_images": swapped}), counts, processor, IMAGE)
    assert difference(packed(model, [out_of_order]), reference) > WRONG
    # coffee's grid transposed (same patch count): the vision tower reads its rows as the wrong shape
    grids = batch["image_grid_thw"].clone()
    grids[1] = grids[1][[0, 2, 1]]
    assert difference(loss_and_gradients(model, [({**batch, "image_grid_thw": grids}, targets)]), reference) > WRONG
    # 3-row positions without the text row: samples see each other
    three_rows = {**batch, "position_ids": batch["position_ids"][1:]}
    assert difference(loss_and_gradients(model, [(three_rows, targets)]), reference) > WRONG


def _fields(pack) -> dict:
    return {name: getattr(pack, name) for name in type(pack).__dataclass_fields__}


def test_qwen2_vl_thd_batch_carries_the_same_inputs(qwen):
    _, processor, pack, counts, _ = qwen
    item = dynamic_pack_item(pack, counts, processor, IMAGE)
    thd = thd_batch([item, item], with_packed_seq_params=False)
    hf = hf_batch([item, item], IMAGE, image_patch_id=IMAGE)
    assert torch.equal(thd["position_ids"], hf["position_ids"][1:]) and thd["position_ids"].shape == (3, 1, 2 * len(pack.tokens))
    assert torch.equal(thd["pixel_values"], hf["pixel_values"]) and torch.equal(thd["image_grid_thw"], hf["image_grid_thw"])
    assert "images" not in thd
    # a fixed row: the last sample's padding grows, its mRoPE ids continuing from its largest + 1
    row = thd_batch([item], fixed_length=True, max_seq_length=160, max_samples_per_pack=3, pad_to_multiple_of=8, with_packed_seq_params=False)
    end = len(pack.tokens)
    assert torch.equal(row["position_ids"][:, :, :end], thd["position_ids"][:, :, :end])
    following = int(thd["position_ids"][:, 0, pack.cu_seqlens[-2] : end].max()) + 1
    assert torch.equal(row["position_ids"][:, 0, end:], torch.arange(following, following + 160 - end).expand(3, -1))
    # context parallelism: every rank its share of the 3 rows, the images whole
    shares = [cp_slice(thd, 2, rank) for rank in range(2)]
    index = [cp_partition_index(thd["cu_seqlens_q"], 2, rank) for rank in range(2)]
    for share, positions in zip(shares, index):
        assert torch.equal(share["position_ids"], thd["position_ids"][:, :, positions])
        assert torch.equal(share["pixel_values"], thd["pixel_values"]) and torch.equal(share["image_grid_thw"], thd["image_grid_thw"])


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    model, processor = next_model_and_processor(tmp_path_factory.mktemp("tiny_llava_next"))
    a, b, c = (processor.to_uint8(photo(name)) for name in ("coffee", "text", "grace_hopper"))
    assert len({processor.tiles(*image.size) for image in (a, b, c)}) > 1  # images of different tile counts
    pack, counts = build_pack([[4, a, 3, b, 5], [9], [2, c, 4]], "anyres", multiple=8)
    return model, processor, pack, counts


def test_llava_next_packed_equals_one_by_one(llava_next):
    model, processor, pack, counts = llava_next
    item = dynamic_pack_item(pack, counts, processor, IMAGE)
    assert "batch_num_images" not in hf_batch([item], IMAGE, image_patch_id=IMAGE)  # LlavaNextForConditionalGeneration has none
    reference = one_by_one(model, pack, counts, processor, "anyres")
    assert difference(packed(model, [item]), reference) < TOLERANCE


def test_llava_next_wrong_batches_fail_clearly(llava_next):
    model, processor, pack, counts = llava_next
    reference = one_by_one(model, pack, counts, processor, "anyres")
    item = dynamic_pack_item(pack, counts, processor, IMAGE)
    batch = hf_batch([item], IMAGE, image_patch_id=IMAGE)
    targets = batch["shift_labels"][0]
    continuing = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}  # one long sequence
    assert difference(loss_and_gradients(model, [(continuing, targets)]), reference) > WRONG
    order = [1, 0, 2]  # pixel_values and image_sizes of the first two images swapped together
    swapped = {**batch, "pixel_values": batch["pixel_values"][order], "image_sizes": batch["image_sizes"][order]}
    assert difference(loss_and_gradients(model, [(swapped, targets)]), reference) > WRONG  # the model checks only the total
    sizes = batch["image_sizes"].clone()
    sizes[2] = sizes[2].flip(0)  # grace_hopper's (height, width) transposed: other tiles, other unpadding
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        loss_and_gradients(model, [({**batch, "image_sizes": sizes}, targets)])
