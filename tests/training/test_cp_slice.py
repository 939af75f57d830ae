"""cp_slice: each context-parallel rank's share of a THD batch, as Transformer Engine partitions THD.

Specification: every padded segment cut in 2·CP chunks, rank r takes chunks r and 2·CP − 1 − r;
every per-token key sliced alike; the ranks' shares together are the batch, each position once;
an image goes to every rank holding a position of its run; counts add up over the CP group.
"""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neva_pack.cli import main
from neva_pack.reading import PackedSeqDataset
from neva_pack.training import cp_partition_index, cp_slice, thd_batch, thd_collate
from neva_pack.files import packed_prefix
from tests.conftest import SAMPLE_DATA
from tests.training.test_thd_batch import GOLDEN, plain, tensor

RUN = [1, 2, 2, 2, 3]  # an image run of 5 positions: start, 3 patches, end
PER_TOKEN = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids", "sample_loss_weight", "padding_mask")


def test_the_partition_is_transformer_engines():
    """Transformer Engine's own unit test of thd_get_partitioned_indices (tests/pytorch/attention/test_cp_utils.py)."""
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert cp_partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert cp_partition_index(torch.tensor([0, 8, 12]), 2, 0).tolist() == [0, 1, 6, 7, 8, 11]  # the module's picture


@pytest.mark.parametrize("name", ["aligned", "fixed_length", "cp3"])
def test_each_rank_gets_what_megatron_core_gives_it(name):
    """Golden data: Megatron-Core's per-document CP partition (with a port of TE's kernel) run on our batch."""
    case = json.loads((GOLDEN / "thd_batches.json").read_text())[name]
    packs = [{key: tensor(value) for key, value in pack.items()} for pack in case["packs"]]
    for pack in packs:  # Megatron-Core slices no images, and these packs' tokens spell no image runs
        pack["num_images"] = torch.zeros_like(pack["num_images"])
    batch = thd_batch(packs, **case["thd_batch_kwargs"], with_packed_seq_params=False)
    assert case["mcore_cp_rank_batches"]
    for key, expected in case["mcore_cp_rank_batches"].items():
        cp, rank = map(int, key.split("/"))
        share = cp_slice(batch, cp, rank)
        assert {k: plain(share[k]) for k in expected} == expected, key


@st.composite
def batches(draw):
    """Packs of samples mixing text and image runs, aligned to a multiple of 2·CP, and the CP size."""
    cp = draw(st.integers(1, 4))
    multiple = 2 * cp * draw(st.integers(1, 2))
    packs, value = [], 10
    for _ in range(draw(st.integers(1, 3))):
        tokens, labels, padded, real, num_images = [], [], [0], [0], []
        for _ in range(draw(st.integers(1, 3))):
            pieces = []
            images = draw(st.integers(0, 2))
            for _ in range(images):
                pieces += list(range(value, value + draw(st.integers(0, 3)))) + RUN
                value += 4
            pieces += list(range(value, value + draw(st.integers(1, 4))))
            value += 5
            size = -(-len(pieces) // multiple) * multiple
            tokens += pieces + [0] * (size - len(pieces))
            trained = draw(st.lists(st.booleans(), min_size=len(pieces), max_size=len(pieces)))
            labels += [t + 1 if keep else -1 for t, keep in zip(pieces, trained)] + [-1] * (size - len(pieces))
            padded.append(padded[-1] + size)
            real.append(real[-1] + len(pieces))
            num_images.append(images)
        count = sum(num_images)
        packs.append({
            "cu_seqlens": torch.tensor(padded, dtype=torch.int32), "cu_seqlens_unpadded": torch.tensor(real, dtype=torch.int32),
            "tokens": torch.tensor(tokens), "labels": torch.tensor(labels), "num_images": torch.tensor(num_images, dtype=torch.int32),
            "image": torch.arange(max(count, 1), dtype=torch.float32)[:, None, None, None].expand(-1, 3, 2, 2) + value,
        })  # fmt: skip
    return thd_batch(packs, image_run=RUN, with_packed_seq_params=False), cp


@given(batches())
def test_the_shares_of_the_ranks_are_the_batch_each_position_once(drawn):
    batch, cp = drawn
    total = batch["tokens"].shape[1]
    shares = [cp_slice(batch, cp, rank) for rank in range(cp)]
    indices = [cp_partition_index(batch["cu_seqlens_q"], cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(indices).tolist()) == list(range(total))
    for share, index in zip(shares, indices):
        assert share["total_tokens"] == len(index) == total // cp
        for key in PER_TOKEN:
            assert torch.equal(share[key], batch[key][:, index]), key
        # every position of the rank that shows an image row shows that row of one of the rank's own images
        whole, local = batch["image_embedding_index"][0, index], share["image_embedding_index"][0]
        assert torch.equal(whole >= 0, local >= 0)
        positions = len(RUN)
        rebuilt = share["batch_image_index"][local[local >= 0] // positions] * positions + local[local >= 0] % positions
        assert torch.equal(rebuilt, whole[whole >= 0])
        assert torch.equal(share["images"], batch["images"][share["batch_image_index"]])
        assert int(share["num_images"].sum()) == len(share["images"])
        # an image goes to exactly the ranks holding a position of its run
        used = torch.unique(whole[whole >= 0] // positions)
        assert torch.equal(share["batch_image_index"], used)
    assert set(torch.cat([s["batch_image_index"] for s in shares]).tolist()) == set(range(len(batch["images"])))
    for key in ("num_target_tokens", "num_samples"):
        assert sum(share[key] for share in shares) == batch[key], key
    assert torch.equal(sum(share["num_targets"] for share in shares), batch["num_targets"])


def test_a_segment_that_does_not_split_names_the_flag():
    batch = thd_batch([{"cu_seqlens": torch.tensor([0, 6], dtype=torch.int32), "tokens": torch.arange(6),
                        "labels": torch.arange(6), "image": torch.zeros(1, 3, 2, 2), "num_images": torch.tensor([0])}],
                      with_packed_seq_params=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"a segment of 6 positions does not split into 2·CP = 4 chunks: preprocess with --context_parallel_size 2"):
        cp_slice(batch, 2, 0)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        cp_slice(batch, 2, 2)


def test_sample_data_at_510_positions_with_cp_2_splits_exactly_in_fixed_length_batches(tmp_path):
    """The reported case: packs of 510 aligned to 2·CP = 4. Fixed-length rows of 508 keep every
    segment a multiple of 4, so Transformer Engine's partition covers every position once."""
    out = tmp_path / "out"
    args = ["preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
            "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
            "--output_dir", str(out), "--conv_template", "v1", "--num_workers", "0",
            "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--max_seq_length", "510", "--context_parallel_size", "2"]  # fmt: skip
    assert main(args) == 0
    dataset = PackedSeqDataset(packed_prefix(out))
    assert dataset.pad_to_multiple_of == 4
    collate = thd_collate(dataset, fixed_length=True, with_packed_seq_params=False)
    for first in range(0, len(dataset), 2):
        batch = collate([dataset[p] for p in range(first, min(first + 2, len(dataset)))])
        assert batch["tokens"].shape[1] % 508 == 0 and (torch.diff(batch["cu_seqlens_q"]) % 4 == 0).all()
        shares = [cp_slice(batch, 2, rank) for rank in range(2)]
        positions = torch.cat([cp_partition_index(batch["cu_seqlens_q"], 2, rank) for rank in range(2)])
        assert sorted(positions.tolist()) == list(range(batch["tokens"].shape[1]))
        assert sum(share["num_target_tokens"] for share in shares) == batch["num_target_tokens"]
        assert sum(len(share["images"]) for share in shares) >= len(batch["images"])
    assert len(batch["cu_seqlens_q"]) == 2 * dataset.max_samples_in_a_pack + 1 or len(dataset) % 2
