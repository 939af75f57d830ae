"""Megatron-Core THD batches from PackedSeqDataset items, and loss normalisation.

``thd_batch(packs)`` concatenates packs into one THD row (Megatron-Core's packed format: batch
dimension 1, samples told apart by cu_seqlens)::

    pack 0: samples of 5 and 11 tokens, M = 8       pack 1: one sample of 6 tokens
    tokens        [a a a a a . . . b b b b b b b b b b b . . . . . c c c c c c . .]   (1, T = 32)
    position_ids  [0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7 8 9 10 ...  15 0 1 2 3 4 5 6 7]   restart per sample
    padding_mask  [F F F F F T T T F F F F F F F F F F F T T T T T F F F F F F T T]   alignment padding
    cu_seqlens_q         [0, 8, 24, 32]      what attention runs over: each padded segment
    cu_seqlens_unpadded  [0, 5, 16, 22]      real lengths, cumulated (loss, routing, statistics)

**Padding is visible to attention.** Each sample's alignment padding is attended as the tail of
its own segment: ``cu_seqlens_q/kv`` hold the padded boundaries and ``cu_seqlens_q/kv_padded`` are
None (Transformer Engine then takes them equal to ``cu_seqlens_q``). Attention is causal, so a real
token never sees the padding that follows it: real outputs and gradients are exactly those of the
unpadded samples (tests/training/test_thd_training_equivalence.py), and padding outputs are finite. Declaring the padding
instead (real lengths in ``cu_seqlens_q``, buffer boundaries in ``cu_seqlens_q_padded``) depends on
Transformer Engine's ``pad_between_seqs`` auto-detection, which up to TE 2.17 ignores padding on a
row's last sample and then misplaces keys under context parallelism; visible padding has no
"padding between sequences" to detect, on any version, and costs at most M - 1 attended positions
per sample. Megatron-Core's ``padding_mask`` (True on padding) marks it for the MoE router.

The dict carries the keys each consumer reads, as it expects them:

- Megatron Bridge's ``get_packed_seq_params``: ``cu_seqlens_q/kv`` (int32, 1-D),
  ``cu_seqlens_q/kv_padded`` (None), ``max_seqlen_q/kv`` (int32, shape (1,): longest segment),
  ``total_tokens`` (int: T). It builds exactly ``packed_seq_params(batch)`` (golden-tested).
- Megatron-Core's context-parallel helper (``get_batch_on_this_cp_rank``, 0.18 and later):
  ``cu_seqlens`` and ``cu_seqlens_padded`` ((1, n + 1) int32, both the padded boundaries) and
  ``max_seqlen``. It slices only tokens, labels, loss_mask and position_ids: use ``cp_slice``,
  which slices every per-token key alike and hands out images (neva_pack/training/cp.py).

Loss normalisation. A pack mixes n samples of different supervised lengths, so the reduction
decides what "the loss" means. Mask with ``torch.where`` (or ``masked_select``), never by
multiplying: padding and ignored positions may hold any logits, and ``nan * 0`` is nan::

    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    per_token = torch.where(loss_mask > 0, ce, 0).sum()          # / num_target_tokens, reduced
    per_sample = torch.where(loss_mask > 0, ce * sample_loss_weight, 0).sum()   # / num_samples

- per-token (Megatron's default, LLaVA's within a micro-batch): sum ``per_token`` and
  ``num_target_tokens`` over micro-batches and every data-parallel and context-parallel rank, then
  divide (independent of how samples were packed);
- per-sample (each conversation weighs the same): the same with ``per_sample`` and
  ``num_samples``, where ``sample_loss_weight = loss_mask / num_targets[sample]``: the mean of the
  per-sample means.

Counts are additive: ``cp_slice`` gives each context-parallel rank its share of them, so summing
over DP x CP counts every target once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from neva_pack.core import IGNORE_INDEX, PAD_ID
from neva_pack.reading import position_ids_from_cu_seqlens
from neva_pack.packing import fixed_row_length
from neva_pack.training.model_keys import attention_needs, dataset_batch_keys, join_model_inputs, position_rows
from neva_pack.training.item_checks import check_items, checked_collate

MIN_MEGATRON_CORE = "0.10"
"""First Megatron-Core whose PackedSeqParams has the padded cu_seqlens fields."""


def thd_batch(
    packs: list[dict[str, torch.Tensor]],
    fixed_length: bool = False,
    *,
    max_seq_length: int | None = None,
    max_samples_per_pack: int | None = None,
    pad_to_multiple_of: int = 1,
    image_run=None,
    ignore_index: int = IGNORE_INDEX,
    pad_id: int = PAD_ID,
    with_packed_seq_params: bool = True,
    batch_keys=None,
) -> dict:
    """One THD batch from ``PackedSeqDataset`` items, packs concatenated in order.

    Each item has cu_seqlens (buffer boundaries), cu_seqlens_unpadded (real lengths, cumulated;
    taken equal to cu_seqlens when absent), tokens, labels, image and num_images (per sample).

    Returns tokens, labels, loss_mask, position_ids, segment_ids, sample_loss_weight, padding_mask
    (all (1, T)), images ((N, 3, H, W), in placeholder order: the zero image of an image-less pack is
    dropped), num_images (per sample), num_targets (supervised tokens per sample), num_samples,
    num_target_tokens, the boundary keys of the module docstring, and ``packed_seq_params``
    (Megatron-Core's PackedSeqParams; ``with_packed_seq_params=False`` stays free of Megatron).

    ``image_run`` (the ids of one image's run: ``meta.image_run.ids()``)
    adds ``image_embedding_index`` (1, T): at the j-th position of the k-th image's run,
    ``k * image_positions + j`` (a row of the images' embeddings, flattened), -1 elsewhere;
    ``cp_slice`` needs it to give each rank the images its positions use.

    ``fixed_length=True`` (CUDA graphs, pipeline parallelism): every pack is padded to the same row
    length, ``max_seq_length`` rounded down to a multiple of ``pad_to_multiple_of`` (M) so that the
    grown last segment stays aligned (every pack fits: its segments are multiples of M); the
    cu_seqlens get ``len(packs) * max_samples_per_pack + 1`` entries, the last value repeated
    (zero-length segments). ``thd_collate(dataset)`` fills these from the dataset, with the observed
    maximum of samples in a pack.

    Items that carry a family's model inputs instead of ``image`` give those keys joined as
    ``batch_keys`` declares (a family's ``batch_keys``; None: every registered family's), for
    example ``pixel_values`` and per-image metadata of all packs in placeholder order and per-sample
    counts (neva_pack/training/model_keys.py), and no ``images``; items whose ``position_ids`` are
    rows (a family's multimodal positions) give them as (rows, 1, T) (a fixed row's extra padding
    continuing from the last sample's largest id + 1). ``image_run`` is then not used. A family whose
    model attends bidirectionally inside each image (``AttentionNeeds``, read from the keys its items
    carry; ``thd_collate`` reads the dataset's family) is refused: THD's kernels take cu_seqlens and a
    causal flag, nothing that opens an image's block.
    """
    if not packs:
        raise ValueError("thd_batch needs at least one pack")
    check_items(packs)  # one output's items (neva_pack/training/item_checks.py)
    _refuse_bidirectional(attention_needs(packs))
    row = None
    if fixed_length:
        if max_seq_length is None or max_samples_per_pack is None:
            raise ValueError("fixed_length=True needs max_seq_length and max_samples_per_pack (thd_collate(dataset) reads them)")
        row = fixed_row_length(max_seq_length, pad_to_multiple_of)
    tokens, labels, padded_bounds, real_bounds, images, num_images, extras = [], [], [0], [0], [], [], []
    for item in packs:
        cu = item["cu_seqlens"].long()
        real = item.get("cu_seqlens_unpadded", item["cu_seqlens"]).long()
        pack_tokens, pack_labels = item["tokens"].long(), item["labels"].long()
        if row is not None:
            if len(pack_tokens) > row:
                raise ValueError(f"a pack of {len(pack_tokens)} positions does not fit the fixed row of {row}")
            extra = row - len(pack_tokens)
            pack_tokens = torch.cat([pack_tokens, torch.full((extra,), pad_id, dtype=torch.long)])
            pack_labels = torch.cat([pack_labels, torch.full((extra,), ignore_index, dtype=torch.long)])
            cu = torch.cat([cu[:-1], cu[-1:] + extra])  # the last segment grows to the pack's end
            extras.append(extra)
        padded_bounds += (padded_bounds[-1] + cu[1:]).tolist()
        real_bounds += (real_bounds[-1] + real[1:]).tolist()
        tokens.append(pack_tokens)
        labels.append(pack_labels)
        if "image" in item:  # the formats' stack of fixed crops
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
        "num_images": torch.cat(num_images),
    }
    batch.update(join_model_inputs(packs, batch_keys, extras or None))
    rows = position_rows([_grown(item, extra) for item, extra in zip(packs, extras or [0] * len(packs))])
    if rows is not None:
        batch["position_ids"] = rows[:, None]
    if "image" in packs[0]:
        batch["images"] = torch.cat(images)
    if image_run is not None and "images" in batch:
        batch["image_embedding_index"] = image_embedding_index(tokens[0], image_run, len(batch["images"]))[None]
    max_seqlen = int(torch.diff(cu_padded).max())
    if fixed_length:
        count = len(packs) * max_samples_per_pack + 1
        if len(cu_padded) > count:
            raise ValueError(f"{len(cu_padded) - 1} samples exceed the fixed count of {count - 1}")
        cu_real = torch.cat([cu_real, cu_real[-1:].expand(count - len(cu_real))])
        cu_padded = torch.cat([cu_padded, cu_padded[-1:].expand(count - len(cu_padded))])
        max_seqlen = row
    batch.update(boundary_keys(cu_padded, cu_real, max_seqlen))
    if with_packed_seq_params:
        batch["packed_seq_params"] = packed_seq_params(batch)
    return batch


def _grown(item: dict, extra: int) -> dict:
    """``item`` with its position rows grown by ``extra`` positions continuing its last sample's."""
    positions = item.get("position_ids")
    if not extra or positions is None or positions.dim() != 2:
        return item
    last = positions[:, int(item["cu_seqlens"][-2]) :]
    following = int(last.max()) + 1 if last.numel() else 0
    tail = torch.arange(following, following + extra).expand(positions.shape[0], -1)
    return {**item, "position_ids": torch.cat([positions.long(), tail], dim=1)}


def boundary_keys(cu_padded: torch.Tensor, cu_real: torch.Tensor, max_seqlen: int) -> dict:
    """The cu_seqlens / max_seqlen keys of the module docstring, from the padded and real boundaries."""
    seqlen = torch.tensor([max_seqlen], dtype=torch.int32)
    return {
        "cu_seqlens_q": cu_padded,
        "cu_seqlens_kv": cu_padded,
        "cu_seqlens_q_padded": None,
        "cu_seqlens_kv_padded": None,
        "max_seqlen_q": seqlen,
        "max_seqlen_kv": seqlen,
        "total_tokens": int(cu_padded[-1]),
        "cu_seqlens_unpadded": cu_real,
        "cu_seqlens": cu_padded[None],
        "cu_seqlens_padded": cu_padded[None],
        "max_seqlen": seqlen,
    }


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
        "padding_mask": ~real[None],
        "num_targets": num_targets,
        "num_samples": len(sizes),
        "num_target_tokens": int(num_targets.sum()),
    }


def image_embedding_index(tokens: torch.Tensor, image_run, num_images: int) -> torch.Tensor:
    """``k * P + j`` at the j-th position of the k-th run of ``image_run`` (P positions), -1 elsewhere.

    Runs are matched left to right and never overlap, so P patch ids in a row without delimiters are
    one run and 2P are two. ValueError unless there are exactly ``num_images`` runs.
    """
    run = torch.as_tensor(np.asarray(image_run), dtype=torch.long)
    size = len(run)
    index = torch.full_like(tokens, -1)
    if size == 0 or num_images == 0:
        return index
    starts, end = [], 0
    for start in torch.nonzero(tokens == run[0]).flatten().tolist():
        if start >= end and torch.equal(tokens[start : start + size], run):
            starts.append(start)
            end = start + size
    if len(starts) != num_images:
        raise ValueError(f"{len(starts)} image runs in the batch's tokens for {num_images} images: is image_run the output's?")
    where = (torch.tensor(starts)[:, None] + torch.arange(size)).flatten()
    index[where] = torch.arange(len(starts) * size)
    return index


def packed_seq_params(batch: dict):
    """Megatron-Core's PackedSeqParams for a ``thd_batch`` or a ``cp_slice`` of it (imports
    Megatron-Core: seconds, once): the one Megatron Bridge's ``get_packed_seq_params`` builds."""
    from megatron.core.packed_seq_params import PackedSeqParams

    fields = {f.name for f in dataclasses.fields(PackedSeqParams)}
    if "cu_seqlens_q_padded" not in fields:
        import megatron.core

        raise RuntimeError(
            f"Megatron-Core {megatron.core.__version__} has no padded cu_seqlens in PackedSeqParams: "
            f"install megatron-core>={MIN_MEGATRON_CORE}"
        )
    max_seqlen = int(batch["max_seqlen_q"].item())  # longest segment: what the kernels size their work by
    optional = {"total_tokens": batch["total_tokens"]} if "total_tokens" in fields else {}
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch["cu_seqlens_q"],
        cu_seqlens_kv=batch["cu_seqlens_kv"],
        cu_seqlens_q_padded=batch["cu_seqlens_q_padded"],
        cu_seqlens_kv_padded=batch["cu_seqlens_kv_padded"],
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=int(batch["max_seqlen_kv"].item()),
        **optional,
    )


def thd_collate(dataset, fixed_length: bool = False, with_packed_seq_params: bool = True):
    """A DataLoader collate_fn: ``thd_batch`` with the dataset's max_seq_length, alignment multiple,
    image run (none where each image's run has its own length), ignore index, pad id, observed
    maximum of samples in a pack, and the model-input keys of the dataset's family."""
    _refuse_bidirectional(attention_needs([], dataset))
    meta = dataset.meta
    run = meta.image_run
    return checked_collate(functools.partial(
        thd_batch,
        fixed_length=fixed_length,
        max_seq_length=int(meta.max_seq_length),
        max_samples_per_pack=dataset.max_samples_in_a_pack,
        pad_to_multiple_of=int(meta.pad_to_multiple_of),
        image_run=None if run.positions is None else run.ids().tolist(),
        ignore_index=int(meta.ignore_index),
        pad_id=int(meta.pad_id),
        with_packed_seq_params=with_packed_seq_params,
        batch_keys=dataset_batch_keys(dataset),
    ), dataset)  # fmt: skip


def _refuse_bidirectional(needs) -> None:
    """ValueError, one line, for a model whose attention THD's kernels cannot express."""
    if needs.bidirectional_images:
        raise ValueError(
            "THD batches: this output's model attends bidirectionally inside each image, which Megatron-Core's THD "
            "kernels (causal within cu_seqlens) cannot express; train it with hf_collate (sdpa or eager attention)"
        )
