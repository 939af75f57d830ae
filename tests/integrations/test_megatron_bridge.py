"""Megatron Bridge's ``vlm_step`` batches from our packs, against Bridge's own Qwen-VL task encoder.

tests/golden/megatron_bridge/{qwen2_5_vl,qwen3_vl}.npz were made by running Megatron Bridge's
``QwenVLTaskEncoder`` (its source at 067f987d with its locked transformers 5.12.1, README there), built by
Bridge's own ``build_energon_task_encoder`` from its recipe's defaults, with in-batch packing on the sample
records, batched in our plan's grouping: one packed THD row per pack, which it found equal to
``BridgeVLMPacks.collate_fn`` of the same pack (and of two consecutive packs) of our output made with
``--image_reference megatron_bridge``, and to the train dataset of ``PackedVLMDatasetProvider`` as Bridge's
``DatasetProvider`` contract builds it. Here, without Bridge: our rows are its rows, key by key (pixels bit
for bit), read from a compact and from an energon output of the same records, for Qwen2.5-VL and Qwen3-VL.
"""

import dataclasses
import hashlib
import types

import numpy as np
import pytest
import torch

from neva_pack.families import FAMILIES, VideoRequest, dynamic_processor, resolve_encoder
from neva_pack.integrations import BRIDGE_IGNORE_INDEX, BRIDGE_IMAGE_REFERENCE, BridgeVLMPacks, bridge_vlm_packs, check_seq_length
from neva_pack.text import load_tokenizer
from tests.conftest import SAMPLE_DATA
from tests.dynamic_references import stand_in_tokenizer
from tests.llamafactory_workload import ENCODERS, build, media_first

GOLDEN = SAMPLE_DATA.parent / "tests" / "golden" / "megatron_bridge"


CASES = ("qwen2_5_vl", "qwen3_vl")
"""The golden cases: tests/llamafactory_workload's encoders (Qwen2.5-VL-7B's and Qwen3-VL-2B's settings)."""


@pytest.fixture(scope="module", params=[(model, fmt) for model in CASES for fmt in ("compact", "energon")], ids="-".join)
def case(request, tmp_path_factory):
    """Our output (compact, energon) of the records Bridge's encoder renders as we do, made with
    ``--image_reference megatron_bridge`` and no pixel bounds of ours (Bridge's defaults), Bridge's rows of
    them, and a ``visual_inputs`` class with the fields of Bridge's ``GenericVisualInputs``."""
    model, fmt = request.param
    golden = np.load(GOLDEN / f"{model}.npz")
    visual = dataclasses.make_dataclass("VisualInputs", [(name, object, None) for name in golden["visual_fields"].tolist()])
    out = build(tmp_path_factory.mktemp(f"{model}_{fmt}"), model, fmt, max_pixels=None, keep=media_first, image_reference=BRIDGE_IMAGE_REFERENCE)
    return out, golden, visual


def golden_batch(golden, p: int) -> dict:
    prefix = f"batch{p}_"
    return {name[len(prefix) :]: golden[name] for name in golden.files if name.startswith(prefix)}


@pytest.mark.slow
def test_rows_are_bridges_own_in_batch_packed_rows(case):
    out, golden, visual = case
    packs = bridge_vlm_packs(out, visual_inputs=visual)
    assert len(packs) == sum(name.endswith("_total_tokens") for name in golden.files) > 1
    for p in range(len(packs)):
        mine, theirs = packs.collate_fn([packs[p]]), golden_batch(golden, p)
        assert {key for key, value in mine.items() if value is not None} == {
            key for key in theirs if not key.startswith(("visual_", "pixel_values"))} | {"visual_inputs"}  # fmt: skip
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens_q", "cu_seqlens_kv"):
            assert mine[key].dtype == torch.from_numpy(theirs[key]).dtype and mine[key].numpy().tolist() == theirs[key].tolist(), (p, key)
        assert mine["loss_mask"].dtype == torch.float32 and mine["loss_mask"].numpy().tolist() == theirs["loss_mask"].tolist()
        assert int(mine["max_seqlen_q"]) == int(mine["max_seqlen_kv"]) == int(theirs["max_seqlen_q"]) and mine["max_seqlen_q"].dim() == 0
        assert mine["total_tokens"] == int(theirs["total_tokens"]) == packs.row_lengths()[p]
        assert mine["visual_inputs"].image_grid_thw.numpy().tolist() == theirs["visual_image_grid_thw"].tolist()
        pixels = mine["visual_inputs"].pixel_values.to(torch.float32).numpy()
        assert list(pixels.shape) == theirs["pixel_values_shape"].tolist()
        assert hashlib.sha256(pixels.tobytes()).hexdigest() == str(theirs["pixel_values_sha256"])
        assert (mine["labels"][0, mine["cu_seqlens_q"][1:].long() - 1] == BRIDGE_IGNORE_INDEX).all()  # no sample scores its last id
    check_seq_length(packs, int(packs.row_lengths().max()))
    with pytest.raises(ValueError, match=r"^rows of 1 pack\(s\) reach \d+ positions [^\n]*$"):
        check_seq_length(packs, int(packs.row_lengths().max()) - 1)


class _Packs:
    """What ``BridgeVLMPacks`` reads of a dataset before its first batch: its family, meta and first item."""

    def __init__(self, family, positions=None, pad_to_multiple_of=1):
        self.processor, self.prefix = family, "out"
        self.meta = types.SimpleNamespace(pad_to_multiple_of=pad_to_multiple_of, ignore_index=-1, pad_id=0)
        self.first = {"position_ids": torch.zeros((3, 4)) if positions is None else positions}

    def __len__(self):
        return 1

    def __getitem__(self, p):
        return self.first


VISUAL = dataclasses.make_dataclass("VisualInputs", [(name, object, None) for name in (
    "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts", "image_sizes",
    "image_position_ids", "mm_token_type_ids",
)])  # fmt: skip
"""The fields of Bridge's ``GenericVisualInputs`` at the golden data's commit (its ``visual_fields``)."""


def test_fixed_crops_and_aligned_samples_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^out: an output of fixed crops[^\n]*$"):
        BridgeVLMPacks(_Packs(None), VISUAL)
    with pytest.raises(ValueError, match=r"^out: samples padded to a multiple of 8[^\n]*$"):
        BridgeVLMPacks(_Packs(FAMILIES["native"], pad_to_multiple_of=8), VISUAL)


def native(encoder: str, reference: str | None = BRIDGE_IMAGE_REFERENCE):
    """The native family of ``encoder`` as an output made with ``--image_reference reference`` reads it."""
    return dynamic_processor(resolve_encoder(encoder), arithmetic=reference or "transformers")


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"fixed"}))
def test_a_family_bridge_cannot_train_packed_is_refused_in_one_line(family):
    """Taken: a family whose model inputs Bridge's visual inputs carry, attending causally, with position
    rows the model computes from its grids (the native family, golden-tested above); every other refused."""
    cls = FAMILIES[family]
    rows = family == "native"  # the positions its items carry: rows, or 1-D
    packs = _Packs(native(ENCODERS["qwen3_vl"][0]) if rows else cls, positions=torch.zeros((3, 4)) if rows else torch.zeros(4))
    if family == "native":
        assert BridgeVLMPacks(packs, VISUAL).fields >= set(cls.batch_keys)
    else:
        with pytest.raises(ValueError, match=r"^out: [^\n]*Megatron Bridge[^\n]*$"):
            BridgeVLMPacks(packs, VISUAL)


@pytest.mark.parametrize("model", CASES)
@pytest.mark.parametrize("reference", [None, "transformers", "qwen_vl_utils"])
def test_images_not_made_as_bridges_task_encoder_makes_them_are_refused_in_one_line(model, reference):
    """Bridge's collate resizes each image twice (to a multiple of 28 in qwen-vl-utils, then in the processor
    within its own bounds): an output made with any other reference holds other images (Qwen3-VL's
    480 x 320 image: 150 tokens by its processor alone, 216 in Bridge's rows), and is refused, naming the
    reference to use."""
    with pytest.raises(ValueError, match=rf"^out: images made with --image_reference {reference or 'transformers'}, [^\n]*"
                                         rf"preprocess with --image_reference {BRIDGE_IMAGE_REFERENCE}$"):  # fmt: skip
        BridgeVLMPacks(_Packs(native(ENCODERS[model][0], reference)), VISUAL)
    assert native(ENCODERS["qwen3_vl"][0], reference).tokens_for_size(480, 320) == 150
    assert native(ENCODERS["qwen3_vl"][0]).tokens_for_size(480, 320) == 216


def test_an_output_reading_video_clips_is_refused_in_one_line(tmp_path):
    """Bridge's collate samples and resizes a clip's frames with qwen-vl-utils' ``fetch_video`` and then the
    processor's video resize: none of our video profiles is that chain, so its rows are not claimed."""
    tokenizer = load_tokenizer(stand_in_tokenizer(tmp_path, "qwen"))
    videos = native(ENCODERS["qwen3_vl"][0]).with_videos(VideoRequest(profile="qwen_vl_utils"), tokenizer)
    with pytest.raises(ValueError, match=r"^out: an output reading video clips: [^\n]*preprocess without video records$"):
        BridgeVLMPacks(_Packs(videos), VISUAL)


@pytest.mark.parametrize("model", CASES)
def test_the_stand_in_visual_inputs_are_bridges_own_fields(model):
    """VISUAL above is the field list the golden run read from Bridge's GenericVisualInputs, no more, no less."""
    golden = np.load(GOLDEN / f"{model}.npz")
    assert sorted(f.name for f in dataclasses.fields(VISUAL)) == sorted(golden["visual_fields"].tolist())
