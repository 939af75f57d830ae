"""Reader items of dynamic-resolution packs (neva_pack.families.model_inputs, dataset.dynamic_pack_item):
Qwen's mRoPE position ids equal transformers' ``get_rope_index`` on each sample alone (Qwen2-VL
and Qwen2.5-VL), on packs of several samples with several images, text-only samples and alignment
padding; the images are transformers' PIL processors' own model inputs, bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neva_pack.reading import dynamic_pack_item, sample_of_pack
from neva_pack.families import (
    FAMILIES, FamilyOptions, Join, ModelFamily, dynamic_processor, model_family, pack_model_inputs,
    registered_batch_keys, resolve_encoder, restarting_positions
)
from neva_pack.core import ConfigError
from tests.dynamic_packs import IMAGE, VISION_START, build_pack, photo
from tests.families.test_mrope import _tiny

QWEN = "Qwen/Qwen2-VL-7B-Instruct"
NEXT = "llava-hf/llava-v1.6-mistral-7b-hf"
SMALL = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 40}
"""--min_pixels / --max_pixels that keep the photos at a few dozen tokens each."""
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "text", "grace_hopper")


@pytest.fixture(scope="module")
def qwen():
    return dynamic_processor(resolve_encoder(QWEN), **SMALL)


@pytest.fixture(scope="module")
def next_processor():
    return dynamic_processor(resolve_encoder(NEXT))


def qwen_samples(processor) -> list[list]:
    """Five samples: two images, a text-only one, one image mid-text, three images, one ending on an image."""
    a, b, c, d, e, f = (processor.to_uint8(photo(name)) for name in PHOTOS)
    return [[4, a, 3, b, 5], [9], [2, c, 7], [1, d, e, 2, f, 3], [3, a, 1]]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("multiple", [1, 8])
def test_mrope_of_every_sample_is_get_rope_index_on_it_alone(qwen, kind, multiple):
    model = _tiny(kind)
    pack, counts = build_pack(qwen_samples(qwen), "native", multiple)
    item = dynamic_pack_item(pack, counts, qwen, IMAGE)
    positions, grids = item["position_ids"], item["image_grid_thw"]
    assert positions.dtype == torch.int64 and positions.shape == (3, len(pack.tokens))
    bounds, real = pack.cu_seqlens, pack.cu_seqlens_unpadded
    first = np.concatenate([[0], np.cumsum(counts)])
    for k in range(len(counts)):
        start, length, end = bounds[k], real[k + 1] - real[k], bounds[k + 1]
        ids = torch.from_numpy(pack.tokens[start : start + length])[None]
        own = grids[first[k] : first[k + 1]]
        with torch.no_grad():
            expected, _ = model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=own if len(own) else None)
        assert torch.equal(positions[:, start : start + length], expected[:, 0])
        following = int(expected.max()) + 1
        assert torch.equal(positions[:, start + length : end], torch.arange(following, following + end - start - length).expand(3, -1))


def test_qwen_images_are_the_processors_inputs_bit_identical(qwen):
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    settings = {k: v for k, v in resolve_encoder(QWEN).preprocessor_config.items() if k not in ("image_processor_type", "processor_class")}
    reference = Qwen2VLImageProcessorPil(**{**settings, **SMALL})
    pack, counts = build_pack(qwen_samples(qwen), "native", 8)
    item = dynamic_pack_item(pack, counts, qwen, IMAGE)
    order = ["astronaut", "coffee", "chelsea", "rocket", "text", "grace_hopper", "astronaut"]
    expected = reference([photo(name) for name in order], return_tensors="np")
    assert item["pixel_values"].dtype == torch.float32 and item["pixel_values"].shape[1] == 1176
    assert np.array_equal(item["pixel_values"].numpy(), expected["pixel_values"])
    assert item["image_grid_thw"].dtype == torch.int64 and np.array_equal(item["image_grid_thw"].numpy(), expected["image_grid_thw"])
    assert item["num_images"].tolist() == counts.tolist()


def test_llava_next_images_and_restarting_positions(next_processor):
    from transformers.models.llava_next import LlavaNextImageProcessorPil

    settings = {k: v for k, v in resolve_encoder(NEXT).preprocessor_config.items() if k not in ("image_processor_type", "processor_class")}
    names = ["coffee", "text", "grace_hopper"]
    a, b, c = (next_processor.to_uint8(photo(name)) for name in names)
    pack, counts = build_pack([[3, a, b, 2], [5], [2, c, 4]], "anyres", 8)
    item = dynamic_pack_item(pack, counts, next_processor, IMAGE)
    expected = LlavaNextImageProcessorPil(**settings)([photo(name) for name in names], return_tensors="np")
    assert item["pixel_values"].dtype == torch.float32 and item["pixel_values"].shape[2:] == (3, 336, 336)
    assert np.array_equal(item["pixel_values"].numpy(), expected["pixel_values"])
    assert np.array_equal(item["image_sizes"].numpy(), expected["image_sizes"]) and item["image_sizes"].dtype == torch.int64
    assert torch.equal(item["position_ids"], torch.from_numpy(restarting_positions(pack.cu_seqlens)))
    assert restarting_positions(np.array([0, 3, 5])).tolist() == [0, 1, 2, 0, 1]


def test_a_sample_alone_gets_its_own_images(qwen, next_processor):
    """PackedSamples' one-sample items: the sample's tokens, its own images, positions from 0; the
    LLaVA-NeXT tiles padded to the sample's own most, as the processor would for it alone."""
    pack, counts = build_pack(qwen_samples(qwen), "native", 8)
    whole = dynamic_pack_item(pack, counts, qwen, IMAGE)
    alone = dynamic_pack_item(sample_of_pack(pack, counts, 3), counts[3:4], qwen, IMAGE)
    start, end = pack.cu_seqlens[3], pack.cu_seqlens[4]
    assert torch.equal(alone["position_ids"], whole["position_ids"][:, start:end])
    assert torch.equal(alone["image_grid_thw"], whole["image_grid_thw"][3:6])
    assert alone["cu_seqlens"].tolist() == [0, end - start] and alone["num_images"].tolist() == [3]
    assert (next_processor.tiles(600, 400), next_processor.tiles(448, 172)) == (4, 2)  # coffee, text
    coffee, text = next_processor.to_uint8(photo("coffee")), next_processor.to_uint8(photo("text"))
    pack, counts = build_pack([[2, coffee, 2], [2, text, 2]], "anyres")
    assert dynamic_pack_item(pack, counts, next_processor, IMAGE)["pixel_values"].shape[:2] == (2, 5)
    assert dynamic_pack_item(sample_of_pack(pack, counts, 1), counts[1:], next_processor, IMAGE)["pixel_values"].shape[:2] == (1, 3)


def test_an_image_less_pack_has_no_zero_image(qwen, next_processor):
    for processor, family in ((qwen, "native"), (next_processor, "anyres")):
        pack, counts = build_pack([[7], [4]], family, 8)
        item = dynamic_pack_item(pack, counts, processor, IMAGE)
        assert len(item["pixel_values"]) == 0 and item["num_images"].tolist() == [0, 0]
    assert item["pixel_values"].shape[1:] == (1, 3, 336, 336)


def test_images_that_disagree_with_the_placeholders_are_refused(qwen, next_processor):
    pack, counts = build_pack(qwen_samples(qwen), "native")
    inputs = dict(tokens=pack.tokens, cu_seqlens=pack.cu_seqlens, cu_seqlens_unpadded=pack.cu_seqlens_unpadded, processor=qwen, patch_id=IMAGE)  # fmt: skip
    with pytest.raises(ValueError, match="images for samples"):
        pack_model_inputs(**inputs, num_images=counts, stored_images=pack.stored_images[:-1])
    swapped = [pack.stored_images[1], pack.stored_images[0], *pack.stored_images[2:]]  # different grids
    with pytest.raises(ValueError, match="image token run"):
        pack_model_inputs(**inputs, num_images=counts, stored_images=swapped)
    a = next_processor.to_uint8(photo("coffee"))
    pack, counts = build_pack([[3, a, 2]], "anyres")
    with pytest.raises(ValueError, match="image positions"):
        pack_model_inputs(tokens=np.where(pack.tokens == IMAGE, VISION_START, pack.tokens)[:-1], cu_seqlens=[0, len(pack.tokens) - 1],
                          cu_seqlens_unpadded=[0, len(pack.tokens) - 1], num_images=counts, stored_images=pack.stored_images,
                          processor=next_processor, patch_id=IMAGE)  # fmt: skip


def test_every_family_answers_the_one_protocol():
    """Each registered family class offers every member of ``ModelFamily``, and its record options
    are its own: nothing outside families/ needs to know which family it holds."""
    members = [name for name in vars(ModelFamily) if not name.startswith("_")]
    members += list(ModelFamily.__annotations__)
    assert {"image_run", "tokens_for_size", "to_uint8", "model_inputs", "position_ids", "batch_keys"} <= set(members)
    for name, cls in FAMILIES.items():
        missing = [member for member in members if not hasattr(cls, member)]
        assert not missing, f"{name}: {missing}"
        assert cls.family == name and set(cls.option_names) <= {"arithmetic", "min_pixels", "max_pixels", "max_soft_tokens"}
        assert all(isinstance(join, Join) for join in cls.batch_keys.values())


def test_every_key_of_an_item_is_declared_by_its_family(qwen, next_processor):
    """A reader item's model inputs are exactly what its family declares (and position_ids), so that
    training joins them without naming a family."""
    for processor, family in ((qwen, "native"), (next_processor, "anyres")):
        pack, counts = build_pack([[4, processor.to_uint8(photo("coffee")), 3], [9]], family, 8)
        item = dynamic_pack_item(pack, counts, processor, IMAGE)
        carried = set(item) - {"cu_seqlens", "cu_seqlens_unpadded", "num_images", "tokens", "labels", "position_ids"}
        assert carried and carried <= set(processor.batch_keys)
        assert all(registered_batch_keys()[key] is processor.batch_keys[key] for key in carried)


def test_an_option_of_another_family_is_refused_naming_its_flags(next_processor):
    with pytest.raises(ConfigError, match="--min_pixels / --max_pixels: .* is not a Qwen2-VL / Qwen2.5-VL encoder"):
        dynamic_processor(resolve_encoder(NEXT), min_pixels=1000)
    with pytest.raises(ConfigError, match="--min_pixels / --max_pixels"):
        model_family(resolve_encoder("openai/clip-vit-large-patch14-336"), FamilyOptions(max_pixels=1000))
    with pytest.raises(ConfigError, match="--use_im_start_end / --image_aspect_ratio"):
        model_family(resolve_encoder(QWEN), FamilyOptions(aspect_ratio="pad"))
    assert model_family(resolve_encoder(NEXT), FamilyOptions(tokenization="llava")).options() == {"arithmetic": "llava"}
