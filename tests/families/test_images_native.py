"""Qwen2-VL / Qwen2.5-VL native resolution (neva_pack.families.native) against transformers'
Qwen2VLImageProcessorPil: sizes, token counts and pixel rows, for the released checkpoints'
settings and transformers' class default."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neva_pack.families import dynamic_processor, known_encoders, resolve_encoder, tokens_from_header
from neva_pack.core import ConfigError
from neva_pack.families.fixed import encoder_tokens
from neva_pack.families.native import NativeProcessor, smart_resize
from tests.image_zoo import random_rgb, synthetic, zoo_images

QWEN = ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct")
CLASS_DEFAULT_MAX_PIXELS = 28 * 28 * 1280  # transformers' Qwen2VLImageProcessor default, not the checkpoints'


def reference(encoder, **overrides):
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    settings = {k: v for k, v in encoder.preprocessor_config.items() if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**{**settings, **overrides})


@pytest.fixture(scope="module")
def qwen2():
    return resolve_encoder("Qwen/Qwen2-VL-7B-Instruct")


@pytest.mark.parametrize("name", QWEN)
def test_shipped_settings_are_the_released_preprocessor_config(name):
    encoder = resolve_encoder(name)
    assert encoder.processor == "qwen2_vl" and encoder.family == "native" and name in known_encoders("native")
    cfg = encoder.preprocessor_config
    assert (cfg["min_pixels"], cfg["max_pixels"], cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"]) == (
        3136, 12845056, 14, 2, 2)  # fmt: skip
    processor = dynamic_processor(encoder)
    assert isinstance(processor, NativeProcessor) and processor.settings.max_pixels == 12845056
    with pytest.raises(ConfigError, match="dynamic-resolution"):
        encoder_tokens(encoder)  # the fixed-crop pipeline refuses it in one line


def test_rounding_is_python_round_half_to_even():
    assert smart_resize(70, 70, 28, 3136, 12845056) == (56, 56)  # 70 / 28 = 2.5 -> 2
    assert smart_resize(98, 98, 28, 3136, 12845056) == (112, 112)  # 3.5 -> 4
    assert smart_resize(56 + 13, 84 + 14, 28, 3136, 12845056) == (56, 112)  # 2.46 -> 2; 3.5 -> 4
    for k in (2, 3, 10, 37):
        assert smart_resize(28 * k - 1, 28 * k + 1, 28, 3136, 12845056) == (28 * k, 28 * k)
        assert smart_resize(28 * k + 14, 28 * k + 15, 28, 3136, 12845056)[1] == 28 * (k + 1)


def test_the_checkpoints_and_the_class_default_differ_on_a_full_hd_photo(qwen2):
    assert dynamic_processor(qwen2).tokens_for_size(1920, 1080) == 2691
    assert dynamic_processor(qwen2, max_pixels=CLASS_DEFAULT_MAX_PIXELS).tokens_for_size(1920, 1080) == 1222


def test_min_and_max_pixels_edges(qwen2):
    small = dynamic_processor(qwen2)
    assert small.resized_size(1, 1) == (56, 56)  # below min_pixels: scaled up to it
    assert small.resized_size(2, 1) == (56, 84)
    tight = dynamic_processor(qwen2, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 4)
    assert tight.resized_size(56, 56) == (56, 56)  # exactly at both edges
    assert tight.resized_size(57, 57) == (56, 56) and tight.resized_size(84, 84) == (56, 56)  # just over: scaled down
    assert tight.resized_size(30, 30) == (56, 56)  # under: scaled up
    with pytest.raises(ConfigError, match="min_pixels"):
        dynamic_processor(qwen2, min_pixels=10_000, max_pixels=5_000)
    with pytest.raises(ValueError, match="aspect ratio"):
        small.tokens_for_size(401, 2)


def _size_grid(dense: bool = True) -> list[tuple[int, int]]:
    """Dense: >= 20,000 (width, height): every side 1..120, then coarser to 8,000, plus 28k +- 1.
    Sparse (the default run; dense with -m slow): sides 1..10, every 97th to 2,000, every 997th to
    8,000, and 28k +- 1 for every 6th k (~4,000 sizes)."""
    small, step, far, every = (range(1, 121), 17, 331, 1) if dense else (range(1, 11), 97, 997, 6)
    sides = sorted({*small, *range(121, 2000, step), *range(2000, 8001, far),
                    *(28 * k + d for k in range(1, 80, every) for d in (-1, 0, 1))})  # fmt: skip
    return [(w, h) for w in sides for h in sides if max(w, h) / min(w, h) <= 200]


@pytest.mark.parametrize("dense", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sparse", "dense"])
@pytest.mark.parametrize("max_pixels", [None, CLASS_DEFAULT_MAX_PIXELS, 28 * 28 * 64])
def test_token_counts_equal_the_processors_on_a_grid_of_sizes(qwen2, max_pixels, dense):
    sizes = _size_grid(dense)
    assert len(sizes) >= (20_000 if dense else 2_500)
    ours = dynamic_processor(qwen2, max_pixels=max_pixels)
    theirs = reference(qwen2, **({} if max_pixels is None else {"max_pixels": max_pixels}))
    for width, height in sizes:
        patches = theirs.get_number_of_image_patches(height, width)
        assert ours.tokens_for_size(width, height) == patches // 4, (width, height)
        assert np.prod(ours.grid_thw(width, height)) == patches, (width, height)


@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 4000), st.integers(1, 4000))
def test_smart_resize_property(height, width, low, span):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference_resize

    low, high = low * 28, low * 28 + span * 28
    if max(height, width) / min(height, width) > 200:
        return
    ours = smart_resize(height, width, 28, low, high)
    assert ours == reference_resize(height, width, 28, low, high)
    assert ours[0] % 28 == 0 and ours[1] % 28 == 0 and min(ours) >= 28


@pytest.mark.parametrize("name", QWEN)
def test_pixels_are_bit_identical_to_the_processor_over_the_zoo(name):
    encoder = resolve_encoder(name)
    ours = dynamic_processor(encoder)
    theirs = reference(encoder)
    images = zoo_images()
    stored = [ours.to_uint8(image) for image in images.values()]
    for (label, image), one in zip(images.items(), stored):
        expected = theirs(images=image, return_tensors="np")
        got = ours.model_inputs([one])
        assert got["pixel_values"].dtype == np.float32, label
        assert np.array_equal(got["image_grid_thw"], expected["image_grid_thw"]), label
        assert np.array_equal(got["pixel_values"], expected["pixel_values"]), label
        assert one.tokens == int(np.prod(expected["image_grid_thw"])) // 4, label
        assert one.parts[0].dtype == np.uint8 and one.parts[0].shape == (3, *ours.resized_size(*image.size)), label
    together = theirs(images=list(images.values()), return_tensors="np")  # several images: rows concatenated in order
    got = ours.model_inputs(stored)
    assert np.array_equal(got["pixel_values"], together["pixel_values"])
    assert np.array_equal(got["image_grid_thw"], together["image_grid_thw"])


@pytest.mark.parametrize("size", [(70, 70), (69, 71), (83, 85), (55, 57), (57, 55), (140, 42), (5600, 28)])
def test_pixels_on_both_sides_of_rounding_boundaries(qwen2, size):
    image = random_rgb(*size, seed=sum(size))
    for max_pixels in (None, 28 * 28 * 16):
        ours = dynamic_processor(qwen2, max_pixels=max_pixels)
        theirs = reference(qwen2, **({} if max_pixels is None else {"max_pixels": max_pixels}))
        expected = theirs(images=image, return_tensors="np")
        got = ours.model_inputs([ours.to_uint8(image)])
        assert np.array_equal(got["image_grid_thw"], expected["image_grid_thw"]), (size, max_pixels)
        assert np.array_equal(got["pixel_values"], expected["pixel_values"]), (size, max_pixels)


def test_float_rows_cost_eight_times_the_stored_uint8(qwen2):
    ours = dynamic_processor(qwen2)
    stored = ours.to_uint8(random_rgb(280, 140))
    rows = ours.model_inputs([stored])["pixel_values"]
    assert rows.shape == (10 * 20, 1176)
    assert rows.nbytes == 8 * stored.parts[0].nbytes


def test_token_count_from_the_header_equals_the_decoded_images(tmp_path, qwen2):
    ours = dynamic_processor(qwen2)
    data = synthetic("RGB", (333, 517))
    path = tmp_path / "a.png"
    path.write_bytes(data)
    assert tokens_from_header(path, ours) == tokens_from_header(data, ours) == ours.to_uint8(random_rgb(333, 517)).tokens


def test_a_local_checkpoint_directory_picks_the_family(tmp_path, qwen2):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**qwen2.preprocessor_config, "max_pixels": 1003520}))
    local = resolve_encoder(str(tmp_path))
    assert local.processor == "qwen2_vl" and local.patch_size == 14
    assert dynamic_processor(local).tokens_for_size(1920, 1080) == 1222
