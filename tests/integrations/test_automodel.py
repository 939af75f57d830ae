"""NeMo Automodel's packed VLM items from our packs, against Automodel's own preprocessing and packing.

tests/golden/automodel/{qwen2_5_vl,qwen3_vl}.npz were made by running nemo-automodel 0.7.0 (README there):
its own preprocessing (``PreTokenizedDatasetWrapper``) and neat packing (``PackedDatasetWrapper``, mRoPE
from the model's ``get_rope_index``) of the sample records in our plan's grouping, and its
``neat_packed_vlm_collater`` over its packs and over ``packed_dataset``'s items of our output (one pack
and two at a time), which it found equal. Here, without Automodel: our items are its items, key by key,
but for the newline closing each answer, which our templates train and its labels do not.
"""

import hashlib
import types

import numpy as np
import pytest
import torch

from neva_pack.families import FAMILIES
from neva_pack.integrations import AUTOMODEL_IGNORE_INDEX, AutomodelPacks, packed_dataset
from tests.conftest import SAMPLE_DATA
from tests.llamafactory_workload import build

GOLDEN = SAMPLE_DATA.parent / "tests" / "golden" / "automodel"
IM_END, NEWLINE = 2, 208
"""``<|im_end|>`` and ``\\n`` in the stand-in Qwen2 tokenizer (tests/golden/dynamic)."""


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def case(request, tmp_path_factory):
    """Our compact output of the case's records and Automodel's golden items of them."""
    return build(tmp_path_factory.mktemp(request.param), request.param, "compact"), np.load(GOLDEN / f"{request.param}.npz")


def golden_item(golden, p: int) -> dict:
    prefix = f"item{p}_"
    return {name[len(prefix) :]: golden[name] for name in golden.files if name.startswith(prefix)}


@pytest.mark.slow
def test_items_are_automodels_own_packed_items(case):
    out, golden = case
    items = packed_dataset(out, media_keys=golden["media_keys"].tolist())
    assert len(items) == sum(name.endswith("_n_images") for name in golden.files) > 1
    trained_newlines = 0
    for p in range(len(items)):
        mine, theirs = items[p], golden_item(golden, p)
        assert set(mine) == set(theirs) - {"pixel_values_sha256", "pixel_values_shape"} | {"pixel_values"}, p
        for key in ("input_ids", "attention_mask", "position_ids", "mm_token_type_ids", "image_grid_thw"):
            assert mine[key].dtype == torch.int64 and mine[key].numpy().tolist() == theirs[key].tolist(), (p, key)
        for key in ("n_images", "n_videos", "seq_lens", "seq_lens_padded"):
            assert mine[key] == theirs[key].tolist(), (p, key)
        assert mine["position_ids"].shape[0] == 3 and mine["attention_mask"].max() == len(mine["seq_lens"]) > 1
        pixels = mine["pixel_values"].to(torch.float32).numpy()
        assert list(pixels.shape) == theirs["pixel_values_shape"].tolist()
        assert hashlib.sha256(pixels.tobytes()).hexdigest() == str(theirs["pixel_values_sha256"])
        labels, own = mine["labels"].numpy(), theirs["labels"]
        differ = labels != own
        # ours trains "<|im_end|>\n" closing an answer (as LLaMA-Factory); Automodel's labels stop at <|im_end|>
        assert (own[differ] == AUTOMODEL_IGNORE_INDEX).all() and (labels[differ] == NEWLINE).all()
        assert (theirs["input_ids"][differ] == IM_END).all()
        trained_newlines += int(differ.sum())
    assert trained_newlines >= len(items)


def test_a_fixed_crop_output_is_refused_in_one_line():
    packs = types.SimpleNamespace(processor=None, prefix="out/packed_seq_dataset")
    with pytest.raises(ValueError, match=r"^out/packed_seq_dataset: an output of fixed crops[^\n]*$"):
        AutomodelPacks(packs, media_keys=("pixel_values",))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_is_taken_only_when_the_collater_carries_its_inputs_and_mask(family):
    """Every registered family: taken when its inputs are among the collater's media keys and its model
    attends causally; otherwise refused in one line naming what is missing."""
    cls = FAMILIES[family]
    media = ("pixel_values", "image_grid_thw", "image_position_ids", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    packs = types.SimpleNamespace(processor=cls, prefix="out", meta=types.SimpleNamespace(pad_id=0, image_run=types.SimpleNamespace(patch_id=5)))
    bidirectional = getattr(cls, "attention", None) is not None and cls.attention.bidirectional_images
    outside = sorted(set(cls.batch_keys or {}) - set(media) - {"mm_token_type_ids"})
    if bidirectional or outside:
        with pytest.raises(ValueError, match=r"^out: [^\n]+$"):
            AutomodelPacks(packs, media_keys=media)
    else:
        assert AutomodelPacks(packs, media_keys=media).media_keys == media


@pytest.mark.parametrize("media_keys", [[1, 2], [None], "pixel_values", ["pixel_values", b"image_grid_thw"]])
def test_media_keys_that_are_not_names_are_refused_in_one_line(media_keys):
    """A YAML's ``media_keys`` is untrusted: numbers escaped as a TypeError of str.join, and one name
    given as a string was read as its characters."""
    cls = FAMILIES["native"]
    packs = types.SimpleNamespace(processor=cls, prefix="out", meta=types.SimpleNamespace(pad_id=0, image_run=types.SimpleNamespace(patch_id=5)))
    with pytest.raises(ValueError, match=r"^media_keys .*: expected a list of model input names \(strings\)$"):
        AutomodelPacks(packs, media_keys=media_keys)
