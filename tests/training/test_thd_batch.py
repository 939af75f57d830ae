"""thd_batch: Megatron-Core THD batches (PackedSeqParams), fixed-length batches, loss metadata.

The hand-made packs are the picture in neva_pack/training/thd.py: pack 0 holds samples of 5 and 11
tokens aligned to 8, pack 1 one sample of 6 tokens.
"""

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from neva_pack.training import image_embedding_index, thd_batch

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "bridge"

IGNORE = -1


def item(real_lengths, multiple=1, images=(), targets=None, image_shape=(3, 2, 2)):
    """A PackedSeqDataset item: sample k's tokens are 100*k + position, its last ``targets[k]``
    positions are supervised, padding is pad id 0 with ignored labels."""
    tokens, labels, padded = [], [], []
    for k, length in enumerate(real_lengths):
        size = -(-length // multiple) * multiple
        supervised = length if targets is None else targets[k]
        sample = torch.arange(length) + 100 * (k + 1)
        label = torch.where(torch.arange(length) >= length - supervised, sample + 1, IGNORE)
        tokens.append(torch.cat([sample, torch.zeros(size - length, dtype=torch.long)]))
        labels.append(torch.cat([label, torch.full((size - length,), IGNORE)]))
        padded.append(size)
    cumulate = lambda sizes: torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    num_images = torch.tensor([len(i) for i in images] if images else [0] * len(real_lengths), dtype=torch.int32)
    pictures = [torch.full(image_shape, float(v)) for sample in images for v in sample]
    return {
        "cu_seqlens": cumulate(padded),
        "cu_seqlens_unpadded": cumulate(real_lengths),
        "tokens": torch.cat(tokens),
        "labels": torch.cat(labels),
        "image": torch.stack(pictures) if pictures else torch.zeros((1, *image_shape)),
        "num_images": num_images,
    }


@pytest.fixture(scope="module")
def packs():
    return [item([5, 11], multiple=8, images=[(1,), (2, 3)], targets=[2, 4]), item([6], multiple=8, targets=[3])]


def test_thd_batch_concatenates_packs_with_padding_visible_to_attention(packs):
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = thd_batch(packs)
    assert batch["tokens"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, 32)
    assert batch["position_ids"][0].tolist() == [*range(8), *range(16), *range(8)]
    assert batch["tokens"][0, :8].tolist() == [100, 101, 102, 103, 104, 0, 0, 0]
    params = batch["packed_seq_params"]
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    # attention runs over each padded segment; Transformer Engine takes the padded pair equal to these
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 8, 24, 32]
    assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == params.max_seqlen_kv == 16
    assert batch["cu_seqlens_unpadded"].tolist() == [0, 5, 16, 22] and batch["total_tokens"] == 32
    assert batch["padding_mask"][0].tolist() == [False] * 5 + [True] * 3 + [False] * 11 + [True] * 5 + [False] * 6 + [True] * 2
    # Megatron-Core's CP helper reads (1, n + 1) boundaries and a one-element max_seqlen
    assert batch["cu_seqlens"].tolist() == batch["cu_seqlens_padded"].tolist() == [[0, 8, 24, 32]]
    assert batch["max_seqlen"].dtype == torch.int32 and batch["max_seqlen"].tolist() == [16]


def golden_cases():
    return json.loads((GOLDEN / "thd_batches.json").read_text())


def tensor(spec):
    return torch.tensor(spec["values"], dtype=getattr(torch, spec["dtype"])).view(spec["shape"])


def plain(value):
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape), "values": value.flatten().tolist()} if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_megatron_bridge_builds_from_our_batch_exactly_the_packed_seq_params_we_build(name):
    """Golden data: Bridge's get_packed_seq_params run on thd_batch's dict (tests/golden/bridge/README.md)."""
    case = golden_cases()[name]
    packs = [{key: tensor(value) for key, value in pack.items()} for pack in case["packs"]]
    batch = thd_batch(packs, **case["thd_batch_kwargs"])
    assert {key: plain(batch[key]) for key in case["bridge_reads"]} == case["bridge_reads"]  # what Bridge read
    params = batch["packed_seq_params"]
    for field in dataclasses.fields(params):
        if field.name in case["bridge_packed_seq_params"]:
            assert plain(getattr(params, field.name)) == case["bridge_packed_seq_params"][field.name], field.name


def test_packed_seq_params_names_the_megatron_core_it_needs(packs, monkeypatch):
    old = types.ModuleType("megatron.core.packed_seq_params")

    @dataclasses.dataclass
    class PackedSeqParams:  # Megatron-Core 0.9's fields
        qkv_format: str = None
        cu_seqlens_q: torch.Tensor = None
        cu_seqlens_kv: torch.Tensor = None
        max_seqlen_q: int = None
        max_seqlen_kv: int = None

    old.PackedSeqParams = PackedSeqParams
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", old)
    with pytest.raises(RuntimeError, match=r"install megatron-core>=0\.10"):
        thd_batch(packs)


def test_image_runs_are_indexed_row_by_row_in_placeholder_order():
    run = [7, 8, 8, 9]  # start, patch, patch, end
    tokens = torch.tensor([1, *run, 2, 0, 0, *run, *run, 3])
    index = image_embedding_index(tokens, run, 3)
    assert index.tolist() == [-1, 0, 1, 2, 3, -1, -1, -1, 4, 5, 6, 7, 8, 9, 10, 11, -1]
    patches_only = image_embedding_index(torch.tensor([5, 8, 8, 8, 8, 8, 8, 5]), [8, 8, 8], 2)
    assert patches_only.tolist() == [-1, 0, 1, 2, 3, 4, 5, -1]  # 2P patch ids are two runs
    with pytest.raises(ValueError, match="2 image runs in the batch's tokens for 3 images"):
        image_embedding_index(tokens[:-5], run, 3)


def test_images_come_in_placeholder_order_without_the_zero_image_of_an_image_less_pack(packs):
    batch = thd_batch([packs[1], packs[0], packs[1]], with_packed_seq_params=False)
    assert batch["images"][:, 0, 0, 0].tolist() == [1.0, 2.0, 3.0]
    assert batch["num_images"].tolist() == [0, 1, 2, 0]


def test_loss_metadata_counts_supervised_tokens_per_sample(packs):
    batch = thd_batch(packs, with_packed_seq_params=False)
    assert batch["num_targets"].tolist() == [2, 4, 3]
    assert batch["num_samples"] == 3 and batch["num_target_tokens"] == 9 == int(batch["loss_mask"].sum())
    assert batch["segment_ids"][0].tolist() == [0] * 5 + [-1] * 3 + [1] * 11 + [-1] * 5 + [2] * 6 + [-1] * 2
    weight = batch["sample_loss_weight"][0]
    for sample, targets in enumerate([2, 4, 3]):
        assert torch.allclose(weight[batch["segment_ids"][0] == sample].sum(), torch.tensor(1.0))
        supervised = weight[(batch["segment_ids"][0] == sample) & (batch["loss_mask"][0] > 0)]
        assert torch.allclose(supervised, torch.full((targets,), 1 / targets))
    # per-sample averaging: sum(ce * weight) / num_samples == mean of the per-sample means
    ce = torch.rand(32)
    means = [ce[(batch["segment_ids"][0] == s) & (batch["loss_mask"][0] > 0)].mean() for s in range(3)]
    assert torch.allclose((ce * weight).sum() / 3, torch.stack(means).mean())


def test_without_padding_the_boundaries_are_the_samples():
    batch = thd_batch([item([3, 2]), item([4])])
    params = batch["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 9] and params.cu_seqlens_q_padded is None
    assert params.max_seqlen_q == 4 and batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert not batch["padding_mask"].any()


def test_fixed_length_batches_have_one_shape_whatever_the_packs(packs):
    shapes = set()
    for chosen in ([packs[0], packs[1]], [packs[1], packs[1]], [item([1, 1, 1]), item([40])]):
        batch = thd_batch(chosen, fixed_length=True, max_seq_length=40, max_samples_per_pack=4)
        params = batch["packed_seq_params"]
        shapes.add((batch["tokens"].shape, params.cu_seqlens_q.shape, params.max_seqlen_q))
        assert batch["tokens"].shape == (1, 80) and params.cu_seqlens_q[-1] == 80 == batch["total_tokens"]
        assert int(batch["loss_mask"].sum()) == batch["num_target_tokens"]
    assert shapes == {((1, 80), (9,), 40)}
    batch = thd_batch(packs, fixed_length=True, max_seq_length=40, max_samples_per_pack=4)
    # pack 0's last segment grows from 24 to 40; zero-length segments fill the fixed count
    assert batch["cu_seqlens_q"].tolist() == [0, 8, 40, 80, 80, 80, 80, 80, 80]
    assert batch["cu_seqlens_unpadded"].tolist() == [0, 5, 16, 22, 22, 22, 22, 22, 22]
    assert batch["tokens"][0, 24:40].tolist() == [0] * 16 and batch["labels"][0, 24:40].tolist() == [IGNORE] * 16
    assert batch["padding_mask"][0, 19:40].all() and not batch["padding_mask"][0, 8:19].any() and batch["num_samples"] == 3
    assert batch["position_ids"][0, :40].tolist() == [*range(8), *range(32)]


def test_fixed_length_rows_are_rounded_down_to_the_alignment(packs):
    """Packs of at most 42 positions aligned to 8 hold at most 40: rows of 40 keep every segment aligned."""
    batch = thd_batch(packs, fixed_length=True, max_seq_length=42, max_samples_per_pack=2, pad_to_multiple_of=8)
    assert batch["tokens"].shape == (1, 80) and batch["max_seqlen_q"].tolist() == [40]
    assert (torch.diff(batch["cu_seqlens_q"]) % 8 == 0).all()


def test_fixed_length_refuses_what_does_not_fit(packs):
    with pytest.raises(ValueError, match="needs max_seq_length and max_samples_per_pack"):
        thd_batch(packs, fixed_length=True, max_seq_length=40)
    with pytest.raises(ValueError, match="a pack of 24 positions does not fit the fixed row of 20"):
        thd_batch(packs, fixed_length=True, max_seq_length=20, max_samples_per_pack=4)
    with pytest.raises(ValueError, match="3 samples exceed the fixed count of 2"):
        thd_batch(packs, fixed_length=True, max_seq_length=40, max_samples_per_pack=1)
    with pytest.raises(ValueError, match="max_seq_length 6 is shorter than the alignment multiple 8"):
        thd_batch(packs, fixed_length=True, max_seq_length=6, max_samples_per_pack=1, pad_to_multiple_of=8)


def test_dataset_and_training_import_without_megatron():
    code = (
        "import sys, neva_pack.reading.dataset, neva_pack.training, neva_pack.packing.balance;"
        "sys.exit(any(name.startswith('megatron') for name in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
