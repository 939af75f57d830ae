"""Context parallelism: each rank's share of a THD batch, as Transformer Engine partitions THD.

Causal attention costs more at the end of a sequence than at its start, so Transformer Engine
(``thd_get_partitioned_indices``, used by Megatron-Core and Megatron Bridge) cuts every padded
segment into 2·CP equal chunks and gives rank r chunks r and 2·CP − 1 − r::

    CP = 2, segments of 8 and 4 positions (cu_seqlens_q [0, 8, 12])
    position   0 1 | 2 3 | 4 5 | 6 7     8 | 9 | 10 | 11
    chunk        0     1     2     3     0   1    2    3
    rank 0     0 1               6 7     8             11      -> positions [0, 1, 6, 7, 8, 11]
    rank 1           2 3   4 5               9   10            -> positions [2, 3, 4, 5, 9, 10]

So every segment must be a multiple of 2·CP: preprocess with ``--context_parallel_size``, and
fixed-length rows are rounded down to a multiple of the alignment (``thd_batch``).

``cp_slice(batch, cp_size, cp_rank)`` gives rank r:

- every per-token key (each (1, T) tensor: tokens, labels, loss_mask, position_ids, segment_ids,
  sample_loss_weight, padding_mask, image_embedding_index, and any the caller added; and (k, 1, T)
  ones: Qwen's mRoPE position_ids) at the rank's positions, in the order above; the ranks' shares
  together are the batch, each position once;
- the images whose run holds at least one of the rank's positions (an image whose run straddles a
  chunk boundary goes to every rank holding part of it: each runs the vision encoder on it and keeps
  the embedding rows its positions use), in placeholder order; ``image_embedding_index`` renumbered
  to them (``k * image_positions + j``: row j of the rank's k-th image); ``batch_image_index`` the
  index of each in the whole batch's images; ``num_images`` per sample counts the rank's images;
- a batch's model inputs (every key a family declares: ``families.registered_batch_keys``) whole
  on every rank: the vision encoder runs over the batch's images before the sequence is split;
- counts that add up over the CP group: ``num_target_tokens`` and ``num_targets`` count the
  supervised positions the rank holds; ``num_samples`` the samples whose first position it holds
  (rank 0, which takes every segment's first chunk). Summing them over data-parallel and
  context-parallel ranks counts every target and sample once;
- the boundary keys unchanged (attention needs the whole row's cu_seqlens on every rank), and
  ``total_tokens`` = the rank's positions, as Megatron Bridge's step sets it after partitioning.
"""

from __future__ import annotations

import torch

from neva_pack.families import Join, registered_batch_keys
from neva_pack.training.thd import packed_seq_params

WHOLE_ROW_KEYS = ("cu_seqlens", "cu_seqlens_padded", *(key for key, join in registered_batch_keys().items() if join is not Join.TOKENS))
"""Never sliced, even when their shape happens to end in (1, T): the (1, n + 1) boundary keys and a
batch's model inputs (the families' declared keys, but per-token ones: sliced as the tokens)."""


def cp_partition_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions rank ``cp_rank`` of ``cp_size`` takes (int64), for segments bounded by
    ``cu_seqlens``: chunks r and 2·CP − 1 − r of each segment, in that order."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of size {cp_size}: need 0 <= rank < size")
    bounds = cu_seqlens.long().flatten()
    sizes = torch.diff(bounds)
    split = 2 * cp_size
    uneven = sizes % split != 0
    if uneven.any():
        size = int(sizes[uneven][0])
        raise ValueError(
            f"a segment of {size} positions does not split into 2·CP = {split} chunks: preprocess with "
            f"--context_parallel_size {cp_size} (or a --pad_to_multiple_of that {split} divides)"
        )
    chunk = sizes // split
    starts = torch.stack([bounds[:-1] + cp_rank * chunk, bounds[:-1] + (split - 1 - cp_rank) * chunk], dim=1).flatten()
    lengths = chunk.repeat_interleave(2)
    offsets = torch.cumsum(lengths, 0) - lengths
    run = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return starts[run] + torch.arange(int(lengths.sum())) - offsets[run]


def cp_slice(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """Rank ``cp_rank``'s share of a ``thd_batch`` (see the module docstring); a new dict."""
    total = batch["tokens"].shape[1]
    bounds = batch["cu_seqlens_q"]
    if int(bounds[-1]) != total:
        raise ValueError(f"cu_seqlens_q ends at {int(bounds[-1])}, the row holds {total} positions")
    index = cp_partition_index(bounds, cp_size, cp_rank)
    share = dict(batch)
    for key, value in batch.items():
        if key in WHOLE_ROW_KEYS or not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if value.shape[-2:] == (1, total):
            share[key] = value.index_select(value.dim() - 1, index)
    share.update(_images(batch, share))
    share.update(_counts(batch, share, index))
    share["total_tokens"] = len(index)
    if "packed_seq_params" in batch:
        share["packed_seq_params"] = packed_seq_params(share)
    return share


def _images(batch: dict, share: dict) -> dict:
    if "images" not in batch:  # no stack of fixed crops: the model inputs stay whole
        return {}
    images = batch["images"]
    if "image_embedding_index" not in batch:
        if len(images):
            raise ValueError("cp_slice needs image_embedding_index to hand out images: thd_batch(..., image_run=...) (thd_collate passes it)")
        return {"batch_image_index": torch.zeros(0, dtype=torch.long)}
    whole = batch["image_embedding_index"][0]
    positions = int((whole >= 0).sum()) // max(len(images), 1)
    local = share["image_embedding_index"][0]
    used = local >= 0
    taken = torch.unique(local[used] // positions) if positions else torch.zeros(0, dtype=torch.long)
    renumbered = torch.full_like(local, -1)
    renumbered[used] = torch.searchsorted(taken, local[used] // positions) * positions + local[used] % positions
    sample_of_image = torch.repeat_interleave(torch.arange(len(batch["num_images"])), batch["num_images"].long())
    counts = torch.bincount(sample_of_image[taken], minlength=len(batch["num_images"]))
    return {
        "images": images[taken],
        "batch_image_index": taken,
        "image_embedding_index": renumbered[None],
        "num_images": counts.to(batch["num_images"].dtype),
    }


def _counts(batch: dict, share: dict, index: torch.Tensor) -> dict:
    segment = share["segment_ids"][0]
    supervised = (share["loss_mask"][0] > 0) & (segment >= 0)
    num_targets = torch.zeros_like(batch["num_targets"]).index_add_(0, segment.clamp(min=0), supervised.long())
    bounds = batch["cu_seqlens_q"].long()
    firsts = bounds[:-1][torch.diff(bounds) > 0][: batch["num_samples"]]
    return {
        "num_targets": num_targets,
        "num_target_tokens": int(num_targets.sum()),
        "num_samples": int(torch.isin(index, firsts).sum()),
    }
