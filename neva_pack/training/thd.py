"""Megatron-Core THD batches from PackedSeqDataset items, and loss normalisation.

``thd_batch(packs)`` concatenates packs into one THD row (Megatron-Core's packed format: batch
dimension 1, samples told apart by cu_seqlens)::

    pack 0: samples of 5 and 11 tokens, M = 8       pack 1: one sample of 6 tokens
    tokens        [a a a a a . . . b b b b b b b b b b b . . . . . c c c c c c . .]   (1, T = 32)
    position_ids  [0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7 8 9 10 ...  15 0 1 2 3 4 5 6 7]   restart per sample
    cu_seqlens_q         [0, 5, 16, 22]      real lengths, cumulated (attention runs over these)
    cu_seqlens_q_padded  [0, 8, 24, 32]      where each sample starts in the buffer

Without alignment padding both are equal and only ``cu_seqlens_q`` is set (Megatron-Core then
takes the faster kernel path). Everything here imports without Megatron-Core; only
``packed_seq_params`` imports it, lazily.

Loss normalisation. A pack mixes n samples of different supervised lengths, so the reduction
decides what "the loss" means. The batch carries both:

- per-token (Megatron's default, LLaVA's within a micro-batch):
  ``(ce * loss_mask).sum() / loss_mask.sum()``, or summed across micro-batches and data-parallel ranks
  and divided by the global ``num_target_tokens`` to be independent of how samples were packed;
- per-sample (each conversation weighs the same): ``(ce * sample_loss_weight).sum() / num_samples``,
  where ``sample_loss_weight = loss_mask / num_targets[sample]``, i.e. the mean of the per-sample means.
"""

from __future__ import annotations

import functools

import torch

from neva_pack.defaults import IGNORE_INDEX, PAD_ID
from neva_pack.dataset import position_ids_from_cu_seqlens


def thd_batch(
    packs: list[dict[str, torch.Tensor]],
    fixed_length: bool = False,
    *,
    max_seq_length: int | None = None,
    max_samples_per_pack: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    pad_id: int = PAD_ID,
    with_packed_seq_params: bool = True,
) -> dict:
    """One THD batch from ``PackedSeqDataset`` items, packs concatenated in order.

    Each item has cu_seqlens (buffer boundaries), cu_seqlens_unpadded (real lengths, cumulated;
    taken equal to cu_seqlens when absent), tokens, labels, image and num_images (per sample).

    Returns tokens, labels, loss_mask, position_ids, segment_ids, sample_loss_weight (all (1, T)),
    images ((N, 3, H, W), in placeholder order: the zero image of an image-less pack is dropped),
    num_targets (supervised tokens per sample), num_samples, num_target_tokens, num_images (per
    sample), the cu_seqlens / max_seqlen tensors, and ``packed_seq_params`` (Megatron-Core's
    PackedSeqParams; leave it out with ``with_packed_seq_params=False`` to stay free of Megatron).

    ``fixed_length=True`` (CUDA graphs, pipeline parallelism): every pack's last segment is padded
    to ``max_seq_length``, so T = len(packs) * max_seq_length, and the cu_seqlens to
    ``len(packs) * max_samples_per_pack + 1`` entries by repeating their last value (zero-length
    segments). ``max_samples_per_pack`` defaults to max_seq_length (always enough: every sample
    holds at least one position). ``thd_collate(dataset)`` fills these from the dataset's meta.
    With alignment padding, pack at a max_seq_length that is a multiple of M so that the grown
    segment stays aligned.
    """
    if not packs:
        raise ValueError("thd_batch needs at least one pack")
    if fixed_length and max_seq_length is None:
        raise ValueError("fixed_length=True needs max_seq_length (thd_collate(dataset) reads it from the meta)")
    tokens, labels, padded_bounds, real_bounds, images, num_images = [], [], [0], [0], [], []
    for item in packs:
        cu = item["cu_seqlens"].long()
        real = item.get("cu_seqlens_unpadded", item["cu_seqlens"]).long()
        pack_tokens, pack_labels = item["tokens"].long(), item["labels"].long()
        if fixed_length:
            if len(pack_tokens) > max_seq_length:
                raise ValueError(f"a pack of {len(pack_tokens)} positions does not fit max_seq_length {max_seq_length}")
            extra = max_seq_length - len(pack_tokens)
            pack_tokens = torch.cat([pack_tokens, torch.full((extra,), pad_id, dtype=torch.long)])
            pack_labels = torch.cat([pack_labels, torch.full((extra,), ignore_index, dtype=torch.long)])
            cu = torch.cat([cu[:-1], cu[-1:] + extra])  # the last segment grows to the pack's end
        offset = padded_bounds[-1]
        padded_bounds += (offset + cu[1:]).tolist()
        real_bounds += (real_bounds[-1] + real[1:]).tolist()
        tokens.append(pack_tokens)
        labels.append(pack_labels)
        images.append(item["image"][: int(item["num_images"].sum())])  # not the zero image of an image-less pack
        num_images.append(item["num_images"])
    cu_padded = torch.tensor(padded_bounds, dtype=torch.int32)
    cu_real = torch.tensor(real_bounds, dtype=torch.int32)
    tokens, labels = torch.cat(tokens)[None], torch.cat(labels)[None]
    batch = {
        "tokens": tokens,
        "labels": labels,
        **_loss_metadata(labels, cu_padded, cu_real, ignore_index),
        "position_ids": position_ids_from_cu_seqlens(cu_padded)[None],
        "images": torch.cat(images),
        "num_images": torch.cat(num_images),
    }
    padded_sizes = torch.diff(cu_padded)
    has_padding = fixed_length or not torch.equal(cu_padded, cu_real)
    if fixed_length:
        bound = max_samples_per_pack or max_seq_length
        count = len(packs) * bound + 1
        if len(cu_padded) > count:
            raise ValueError(f"{len(cu_padded) - 1} samples exceed the fixed count of {count - 1}")
        cu_padded = torch.cat([cu_padded, cu_padded[-1:].expand(count - len(cu_padded))])
        cu_real = torch.cat([cu_real, cu_real[-1:].expand(count - len(cu_real))])
    batch["cu_seqlens_q"] = cu_real
    batch["cu_seqlens_q_padded"] = cu_padded if has_padding else None
    batch["max_seqlen"] = max_seq_length if fixed_length else int(padded_sizes.max())
    if with_packed_seq_params:
        batch["packed_seq_params"] = packed_seq_params(batch)
    return batch


def _loss_metadata(labels: torch.Tensor, cu_padded: torch.Tensor, cu_real: torch.Tensor, ignore_index: int) -> dict:
    """What per-token and per-sample loss averaging need (see the module docstring)."""
    loss_mask = (labels[0] != ignore_index).to(torch.float32)
    sizes = torch.diff(cu_padded.long())
    segment_ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    position = torch.arange(len(segment_ids)) - cu_padded.long()[:-1][segment_ids]
    real = position < torch.diff(cu_real.long())[segment_ids]
    segment_ids = torch.where(real, segment_ids, -1)  # -1 on alignment padding
    num_targets = torch.zeros(len(sizes), dtype=torch.long).index_add_(0, segment_ids.clamp(min=0), loss_mask.long() * real)
    weight = torch.where(loss_mask > 0, 1.0 / num_targets.clamp(min=1)[segment_ids.clamp(min=0)], 0.0)
    return {
        "loss_mask": loss_mask[None],
        "segment_ids": segment_ids[None],
        "sample_loss_weight": weight[None],
        "num_targets": num_targets,
        "num_samples": len(sizes),
        "num_target_tokens": int(num_targets.sum()),
    }


def packed_seq_params(batch: dict):
    """Megatron-Core's PackedSeqParams for a ``thd_batch`` (imports Megatron-Core: seconds, once).

    q and kv share their cu_seqlens (self-attention). The padded pair is set only when samples
    carry alignment padding (or fixed_length), as Megatron Bridge does for its packed SFT data.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = batch["cu_seqlens_q_padded"]
    max_seqlen = int(batch["max_seqlen"])  # longest padded segment: what the kernels size their work by
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch["cu_seqlens_q"],
        cu_seqlens_kv=batch["cu_seqlens_q"],
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def thd_collate(dataset, fixed_length: bool = False, with_packed_seq_params: bool = True):
    """A DataLoader collate_fn: ``thd_batch`` with the dataset meta's max_seq_length, ignore index,
    pad id and samples-per-pack cap."""
    meta = dataset.meta
    return functools.partial(
        thd_batch,
        fixed_length=fixed_length,
        max_seq_length=int(meta.max_seq_length),
        max_samples_per_pack=meta.max_samples_per_pack,
        ignore_index=int(meta.ignore_index),
        pad_id=int(meta.pad_id),
        with_packed_seq_params=with_packed_seq_params,
    )
