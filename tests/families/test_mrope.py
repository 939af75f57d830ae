"""mRoPE position ids of one sample (neva_pack.families.native) == transformers' Qwen2-VL and Qwen2.5-VL
``get_rope_index`` on that sample alone, on tiny randomly initialised models (no hub)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.families.native import mrope_position_ids

IMAGE = 7  # the tiny vocabulary's <|image_pad|>


def _tiny(kind: str):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel

    text = {"vocab_size": 16, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if kind == "qwen2_vl":
        config = Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 16}, image_token_id=IMAGE)
        return Qwen2VLModel(config).eval()
    config = Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "out_hidden_size": 16, "intermediate_size": 32},
                              image_token_id=IMAGE)  # fmt: skip
    return Qwen2_5_VLModel(config).eval()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model(request):
    return _tiny(request.param)


def reference(model, ids: np.ndarray, grids: np.ndarray) -> np.ndarray:
    input_ids = torch.as_tensor(ids, dtype=torch.long)[None]
    token_types = (input_ids == IMAGE).int()
    with torch.no_grad():
        positions, _ = model.get_rope_index(
            input_ids, token_types, image_grid_thw=torch.as_tensor(grids, dtype=torch.long).reshape(-1, 3) if len(grids) else None
        )
    return positions[:, 0].numpy()


samples = st.lists(
    st.tuples(st.integers(1, 12), st.integers(1, 5), st.integers(1, 5)), min_size=0, max_size=4
).flatmap(lambda images: st.tuples(st.just(images), st.integers(0, 9)))


def build(images, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """Text (ids 1..6) before each image, the image's run of <|image_pad|>, then ``tail`` text tokens."""
    ids, grids = [], []
    for text, rows, columns in images:
        ids += [1 + k % 6 for k in range(text)] + [IMAGE] * (rows * columns)
        grids.append((1, 2 * rows, 2 * columns))
    ids += [2] * tail
    return np.array(ids or [3], dtype=np.int64), np.array(grids, dtype=np.int64).reshape(-1, 3)


@settings(max_examples=60)
@given(samples)
def test_equal_to_get_rope_index_on_the_sample_alone(model, sample):
    ids, grids = build(*sample)
    ours = mrope_position_ids(ids == IMAGE, grids)
    assert ours.dtype == np.int64 and ours.shape == (3, ids.size)
    assert np.array_equal(ours, reference(model, ids, grids))


def test_golden_positions_of_a_small_sample():
    """text x2, a 2 x 3 LLM grid at position 2, text: the text after the image starts at 2 + max(2, 3) = 5."""
    ids = np.array([1, 2] + [IMAGE] * 6 + [3, 4])
    ours = mrope_position_ids(ids == IMAGE, [[1, 4, 6]])
    assert ours.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]


def test_in_a_pack_each_sample_restarts_at_zero(model):
    """A pack's positions are its samples' own, concatenated; the reference run over the packed row
    instead would continue counting (the packing bug of HF trainers)."""
    first, second = build([(3, 2, 2)], 2), build([(1, 1, 3), (2, 2, 1)], 1)
    packed = np.concatenate([mrope_position_ids(ids == IMAGE, grids) for ids, grids in (first, second)], axis=1)
    assert np.array_equal(packed[:, : first[0].size], reference(model, *first))
    assert np.array_equal(packed[:, first[0].size :], reference(model, *second))
    assert packed[0, first[0].size] == 0
    whole = reference(model, np.concatenate([first[0], second[0]]), np.concatenate([first[1], second[1]]))
    assert not np.array_equal(whole, packed)


def test_runs_and_grids_must_agree():
    ids = np.array([1] + [IMAGE] * 4 + [2])
    with pytest.raises(ValueError, match="2 image_grid_thw rows"):
        mrope_position_ids(ids == IMAGE, [[1, 4, 4], [1, 2, 2]])
    with pytest.raises(ValueError, match="makes 6"):
        mrope_position_ids(ids == IMAGE, [[1, 4, 6]])
