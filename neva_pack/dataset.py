"""Training side: read a packed prefix as NeMo's NevaPackedSeqDatatset does, plus a collate.

``PackedSeqDataset(prefix)[p]`` gives, for pack p::

    cu_seqlens           int32 (n + 1,)   [0, p1, p1+p2, ..., L]  buffer boundaries (padded lengths)
    cu_seqlens_unpadded  int32 (n + 1,)   [0, l1, l1+l2, ...]     real lengths, cumulated
    tokens               int64 (L,)
    labels               int64 (L,)       ignore value outside trained positions (and on padding)
    image                float32 (N, 3, H, W), H and W read from the output's meta (never guessed)
    num_images           int32 (n,)       images of each sample (the zero image of an image-less
                                          pack is not counted)

Without --pad_to_multiple_of (or CP/TP alignment) p_i == l_i and both cu_seqlens agree. With it,
sample i occupies p_i positions: its l_i tokens, then p_i - l_i pad positions (see
neva_pack.packing.alignment). NeMo 2 / Megatron Bridge read the pair as cu_seqlens (padded) and
cu_seqlens_unpadded; ``neva_pack.training.thd_batch`` turns them into Megatron-Core's PackedSeqParams.

``collate`` adds what a packed (THD) attention needs: position ids that restart at 0 for
every sample, and the loss mask::

    cu_seqlens   = [0, 3, 5]
    position_ids = [0, 1, 2, 0, 1]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from neva_pack.store import PackedReader, read_plan_table


class PackedSeqDataset(Dataset):
    def __init__(self, prefix: str | Path):
        self._reader = PackedReader(Path(prefix))
        self.meta = self._reader.meta
        self.crop_size = tuple(self.meta["crop_size"])
        self.ignore_index = int(self.meta.get("ignore_index", -1))
        self.pad_id = int(self.meta.get("pad_id", 0))
        self.pad_to_multiple_of = int(self.meta.get("pad_to_multiple_of", 1))
        table = read_plan_table(Path(prefix))  # per-sample real lengths and image counts, in pack order
        self._offsets = table["offsets"].astype(np.int64)
        self._lengths = table["length"].astype(np.int32)
        self._num_images = table["num_images"].astype(np.int32)

    def __len__(self) -> int:
        return len(self._reader)

    def __getitem__(self, p: int) -> dict[str, torch.Tensor]:
        pack = self._reader[p]
        first, last = self._offsets[p], self._offsets[p + 1]
        unpadded = np.concatenate([[0], np.cumsum(self._lengths[first:last])]).astype(np.int32)
        return {
            "cu_seqlens": torch.from_numpy(pack.cu_seqlens.astype(np.int32)),
            "cu_seqlens_unpadded": torch.from_numpy(unpadded),
            "num_images": torch.from_numpy(self._num_images[first:last].copy()),
            "tokens": torch.from_numpy(pack.tokens),
            "labels": torch.from_numpy(pack.labels),
            "image": torch.from_numpy(pack.images),
        }


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[0, 3, 5] -> [0, 1, 2, 0, 1]."""
    lengths = torch.diff(cu_seqlens.long())
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(cu_seqlens[-1])) - starts


def collate(batch: list[dict[str, torch.Tensor]], ignore_index: int = -1, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Batch packs: tokens/labels/position_ids/loss_mask padded to the longest pack.

    cu_seqlens are padded with -1 to a common length (NeMo's convention for packed batches);
    ``cu_seqlens_argmin`` is where the padding starts in each row. Images of all packs are
    concatenated; ``num_images`` says how many belong to each pack.
    """
    longest = max(len(item["tokens"]) for item in batch)
    most_bounds = max(len(item["cu_seqlens"]) for item in batch)
    size = len(batch)
    tokens = torch.full((size, longest), pad_id, dtype=torch.long)
    labels = torch.full((size, longest), ignore_index, dtype=torch.long)
    position_ids = torch.zeros((size, longest), dtype=torch.long)
    cu_seqlens = torch.full((size, most_bounds), -1, dtype=torch.int32)
    for row, item in enumerate(batch):
        length = len(item["tokens"])
        tokens[row, :length] = item["tokens"]
        labels[row, :length] = item["labels"]
        position_ids[row, :length] = position_ids_from_cu_seqlens(item["cu_seqlens"])
        cu_seqlens[row, : len(item["cu_seqlens"])] = item["cu_seqlens"]
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": (labels != ignore_index).float(),
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_argmin": torch.tensor([[len(item["cu_seqlens"])] for item in batch]),
        "image": torch.cat([item["image"] for item in batch]),
        "num_images": torch.tensor([len(item["image"]) for item in batch]),
    }
