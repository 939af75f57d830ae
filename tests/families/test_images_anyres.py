"""LLaVA-NeXT (v1.6) and LLaVA-OneVision anyres images (neva_pack.families.anyres) against
transformers' PIL processors and feature counts, and against LLaVA's own llava_arch arithmetic
(golden counts made by running LLaVA's code: tests/golden/anyres/README.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neva_pack.families import dynamic_processor, known_encoders, resolve_encoder, tokens_from_header
from neva_pack.core import ConfigError
from neva_pack.families.anyres import ARITHMETICS, AnyresProcessor, select_best_resolution
from tests.image_zoo import random_rgb, synthetic, zoo_images

V16 = ("llava-hf/llava-v1.6-vicuna-7b-hf", "llava-hf/llava-v1.6-mistral-7b-hf")
OV = "llava-hf/llava-onevision-qwen2-7b-ov-hf"
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "anyres" / "llava_token_counts.npz"


def _tokenizer():
    """A word-level tokenizer that knows <image>: the processors need one to count image tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "<image>": 1, "hello": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", extra_special_tokens={"image_token": "<image>"})


def reference_image_processor(encoder):
    from transformers.models.llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    cls = LlavaOnevisionImageProcessorPil if encoder.processor == "llava_onevision" else LlavaNextImageProcessorPil
    settings = {k: v for k, v in encoder.preprocessor_config.items()
                if k not in ("image_processor_type", "processor_class", "aspect_ratio_setting")}  # fmt: skip
    return cls(**settings)


def reference_processor(encoder):
    """transformers' LlavaNextProcessor / LlavaOnevisionProcessor built with the checkpoint's numbers."""
    from transformers import LlavaNextProcessor, LlavaOnevisionProcessor

    image_processor, model = reference_image_processor(encoder), encoder.model_config
    if encoder.processor == "llava_onevision":
        # its constructor insists on a video processor, which needs torchvision (not installed): the
        # instance is given what its __init__ would set, and its own methods do the work
        processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
        tokenizer = _tokenizer()
        processor.__dict__.update(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=None,
            num_image_tokens=model["num_image_tokens"], vision_feature_select_strategy=model["vision_feature_select_strategy"],
            vision_aspect_ratio=model["vision_aspect_ratio"], image_token="<image>", video_token="<video>",
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), video_token_id=None,
        )  # fmt: skip
        return processor
    return LlavaNextProcessor(
        image_processor=image_processor, tokenizer=_tokenizer(), patch_size=encoder.patch_size,
        vision_feature_select_strategy=model["vision_feature_select_strategy"],
        num_additional_image_tokens=model["num_additional_image_tokens"],
    )  # fmt: skip


def reference_tokens(processor, encoder, width: int, height: int) -> int:
    """The processor's own count: _get_number_of_features less the CLS the "default" strategy drops."""
    tile = encoder.preprocessor_config.get("crop_size", encoder.preprocessor_config["size"])["height"]
    count = processor._get_number_of_features(height, width, tile, tile)
    return count - (encoder.model_config["vision_feature_select_strategy"] == "default")


@pytest.mark.parametrize("name", [*V16, OV])
def test_shipped_settings(name):
    encoder = resolve_encoder(name)
    assert encoder.family == "anyres" and name in known_encoders("anyres") and name not in known_encoders("fixed")
    processor = dynamic_processor(encoder)
    assert isinstance(processor, AnyresProcessor)
    tile = 384 if name == OV else 336
    assert processor.settings.tile == tile
    assert all(h % tile == 0 and w % tile == 0 for h, w in processor.settings.pinpoints)
    assert len(processor.settings.pinpoints) == (36 if name == OV else 5)
    with pytest.raises(ConfigError, match="min_pixels"):
        dynamic_processor(encoder, max_pixels=1000)


def test_issue_examples():
    """A 640 x 480 photo: 2,340 positions in v1.6, 2,929 in OneVision (anyres_max_9 pools its 3 x 3... grid)."""
    assert dynamic_processor(resolve_encoder(V16[0])).tokens_for_size(640, 480) == 2340
    assert dynamic_processor(resolve_encoder(OV)).tokens_for_size(640, 480) == 2929


def test_best_resolution_is_transformers():
    from transformers.image_processing_utils import select_best_resolution as reference

    pinpoints = resolve_encoder(OV).preprocessor_config["image_grid_pinpoints"]
    for width in range(1, 3000, 71):
        for height in range(1, 3000, 67):
            assert select_best_resolution(height, width, pinpoints) == reference((height, width), pinpoints)


@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=40),
    st.integers(1, 4000), st.integers(1, 4000), st.sampled_from(ARITHMETICS),
)  # fmt: skip
def test_the_processors_grid_choice_is_select_best_resolution(tiles, width, height, arithmetic):
    """The processor's quicker search (the fitting pinpoint of least area, else by decreasing area)
    gives the reference's choice on any list of pinpoints, duplicates and ties included."""
    settings = dynamic_processor(resolve_encoder(V16[0])).settings
    pinpoints = tuple((336 * rows, 336 * columns) for rows, columns in tiles)
    ours = AnyresProcessor(dataclasses.replace(settings, pinpoints=pinpoints), None, arithmetic=arithmetic)
    assert ours.grid(width, height) == select_best_resolution(height, width, pinpoints)
    assert ours.tokens_for_size(width, height) == reference_tokens_for_pinpoints(settings, pinpoints, arithmetic, width, height)


def reference_tokens_for_pinpoints(settings, pinpoints, arithmetic, width, height):
    """The count on the pinpoint select_best_resolution picks (the only pinpoint of a processor), read
    as the arithmetic reads the pinpoints: (width, height) for LLaVA's, (height, width) for transformers'."""
    picked = select_best_resolution(*((width, height) if arithmetic == "llava" else (height, width)), pinpoints)
    alone = AnyresProcessor(dataclasses.replace(settings, pinpoints=(picked,)), None, arithmetic=arithmetic)
    return alone.tokens_for_size(width, height)


def _size_grid(dense: bool = True) -> list[tuple[int, int]]:
    """Dense: >= 20,000 (width, height): every side 1..100, then coarser to 5,000, plus tile multiples
    +- 1. Sparse (the default run; dense with -m slow): sides 1..8, every 397th to 5,000 and the same
    tile multiples +- 1 (~3,000 sizes, every tile boundary kept)."""
    small, step = (range(1, 101), 29) if dense else (range(1, 9), 397)
    sides = sorted({*small, *range(101, 5000, step),
                    *(tile * k + d for tile in (336, 384) for k in range(1, 7) for d in (-1, 0, 1))})  # fmt: skip
    return [(w, h) for w in sides for h in sides]


@pytest.mark.parametrize("dense", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sparse", "dense"])
@pytest.mark.parametrize("name", [V16[0], OV])
def test_token_counts_equal_transformers_on_a_grid_of_sizes(name, dense):
    encoder = resolve_encoder(name)
    ours, theirs = dynamic_processor(encoder), reference_processor(encoder)
    sizes = _size_grid(dense)
    assert len(sizes) >= (20_000 if dense else 2_500)
    for width, height in sizes:
        assert ours.tokens_for_size(width, height) == reference_tokens(theirs, encoder, width, height), (width, height)


@pytest.mark.parametrize("name, golden", [(V16[0], "llava_v1_6"), (OV, "llava_onevision")])
def test_token_counts_equal_llavas_own_code(name, golden):
    """--tokenization llava: LLaVA's llava_arch arithmetic, held against counts from running it."""
    data = np.load(GOLDEN)
    sides, counts = data["sides"].tolist(), data[golden]
    assert counts.size >= 20_000
    ours = dynamic_processor(resolve_encoder(name), arithmetic="llava")
    for i, height in enumerate(sides):
        for j, width in enumerate(sides):
            assert ours.tokens_for_size(width, height) == counts[i, j], (width, height)


def test_the_references_disagree_and_each_arithmetic_names_its_own():
    """99 wide x 88 high, v1.6. transformers (LlavaNextProcessor): grid 336 x 672 (h x w), unpadded
    width int(round(99 * 24 / 88, 7)) = 27 -> 1,272. LLaVA's unpad truncates instead (26.999... -> 26):
    1,224 on the same grid. LLaVA's own code also reads the pinpoints as (width, height), so on this
    size's tie it takes the 672 x 336 grid: 1,126 (its golden count). The other three sizes where
    only the truncation differs are listed with both counts."""
    encoder = resolve_encoder(V16[0])
    hf, llava = dynamic_processor(encoder), dynamic_processor(encoder, arithmetic="llava")
    assert reference_tokens(reference_processor(encoder), encoder, 99, 88) == hf.tokens_for_size(99, 88) == 1272
    assert llava.tokens_for_size(99, 88) == 1126
    data = np.load(GOLDEN)
    sides = data["sides"].tolist()
    assert data["llava_v1_6"][sides.index(88), sides.index(99)] == 1126
    truncation_only = {(99, 88): (1272, 1224), (55, 88): (984, 936), (110, 176): (984, 936), (198, 176): (1272, 1224)}
    for (width, height), (transformers_count, truncated_count) in truncation_only.items():
        assert hf.tokens_for_size(width, height) == transformers_count
        grid_height, grid_width = hf.grid(width, height)
        assert (grid_height, grid_width) == (336, 672)  # the tie both references resolve differently
        columns = 24 * grid_width // 336
        kept = int(width * (24 / height))
        truncated = 576 + 24 * (columns - 2 * ((columns - kept) // 2) + 1)
        assert truncated == truncated_count != transformers_count


@pytest.mark.parametrize("name", [V16[0], OV])
def test_pixels_are_bit_identical_to_the_processor_over_the_zoo(name):
    encoder = resolve_encoder(name)
    ours, theirs = dynamic_processor(encoder), reference_image_processor(encoder)
    images = zoo_images()
    stored = {label: ours.to_uint8(image) for label, image in images.items()}
    for label, image in images.items():
        expected = theirs(images=image, return_tensors="np")
        got = ours.model_inputs([stored[label]])
        assert got["pixel_values"].dtype == np.float32, label
        assert np.array_equal(got["image_sizes"], expected["image_sizes"]), label
        assert np.array_equal(got["pixel_values"], expected["pixel_values"]), label
        assert got["pixel_values"].shape[1] == 1 + ours.tiles(*image.size), label
        assert all(part.dtype == np.uint8 and part.flags.c_contiguous for part in stored[label].parts), label
    batch = list(images)[:6]  # images of different tile counts: padded with zero tiles, as the processor pads
    expected = theirs(images=[images[label] for label in batch], return_tensors="np")
    got = ours.model_inputs([stored[label] for label in batch])
    assert np.array_equal(got["pixel_values"], expected["pixel_values"])
    assert np.array_equal(got["image_sizes"], expected["image_sizes"])


@pytest.mark.parametrize("size", [(335, 337), (337, 335), (673, 671), (1009, 335), (3, 700), (1, 1), (2, 1)])
def test_pixels_on_both_sides_of_tile_boundaries(size):
    encoder = resolve_encoder(V16[1])
    ours, theirs = dynamic_processor(encoder), reference_image_processor(encoder)
    image = random_rgb(*size, seed=size[0])
    expected = theirs(images=image, return_tensors="np")["pixel_values"]
    assert np.array_equal(ours.model_inputs([ours.to_uint8(image)])["pixel_values"], expected), size


def test_onevision_multi_image_samples_are_not_tiled():
    """OneVision tiles an image only when it is its sample's only one; otherwise it pads it to a
    square with the mean colour: one 384 x 384 input, 729 + 1 (newline) positions."""
    encoder = resolve_encoder(OV)
    ours, theirs = dynamic_processor(encoder), reference_image_processor(encoder)
    images = [random_rgb(500, 300, seed=1), random_rgb(120, 260, seed=2)]
    stored = [ours.to_uint8(image, sample_images=2) for image in images]
    expected = theirs(images=[images], return_tensors="np")
    got = ours.model_inputs(stored)
    assert np.array_equal(got["pixel_values"], expected["pixel_values"])
    assert [one.tokens for one in stored] == [730, 730]


def test_counts_equal_the_processors_expanded_prompt():
    """End to end: the number of <image> tokens transformers' processor puts in the prompt."""
    for name in (V16[0], OV):
        encoder = resolve_encoder(name)
        ours, processor = dynamic_processor(encoder), reference_processor(encoder)
        for image in (random_rgb(640, 480), random_rgb(99, 88), random_rgb(1500, 300)):
            ids = processor(images=image, text="hello <image>", return_tensors="np")["input_ids"][0]
            assert int((ids == 1).sum()) == ours.tokens_for_size(*image.size), (name, image.size)


def test_token_count_from_the_header(tmp_path):
    ours = dynamic_processor(resolve_encoder(V16[0]))
    path = tmp_path / "photo.jpg"
    path.write_bytes(synthetic("RGB", (640, 480), exif_orientation=6))  # EXIF is not applied: the stored size counts
    assert tokens_from_header(path, ours) == 2340


def test_a_local_checkpoint_directory(tmp_path):
    shipped = resolve_encoder(OV)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(shipped.preprocessor_config))
    (tmp_path / "config.json").write_text(json.dumps({
        "vision_config": {"patch_size": 14, "image_size": 384}, "vision_aspect_ratio": "anyres_max_9",
        "vision_feature_select_strategy": "full"}))  # fmt: skip
    (tmp_path / "processor_config.json").write_text(json.dumps({"num_image_tokens": 729}))
    local = resolve_encoder(str(tmp_path))
    assert local.processor == "llava_onevision"
    assert dynamic_processor(local).settings == dynamic_processor(shipped).settings
