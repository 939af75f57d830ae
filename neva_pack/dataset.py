"""Training side: read a packed output of any format as NeMo's NevaPackedSeqDatatset does, plus a collate.

``PackedSeqDataset(path)[p]`` gives, for pack p, the same tensors whatever the output's format
(bit-identical between a ``compact`` and a ``nemo`` output of the same run)::

    cu_seqlens           int32 (n + 1,)  [0, p1, p1+p2, ..., L]   sample boundaries in the buffer (padded lengths)
    cu_seqlens_unpadded  int32 (n + 1,)  [0, l1, l1+l2, ...]      cumulative real lengths (= cu_seqlens without padding)
    tokens               int64 (L,)      pad id on padding positions
    labels               int64 (L,)      ignore value outside trained positions and on padding
    image                (N, 3, H, W)    normalised; float32 unless a dtype is given; one zero image if the pack has none
    num_images           int32 (n,)      images of each sample (the zero image of an image-less pack is not counted)

The format's reader decides how ``image`` is made: nemo stores it normalised; compact stores uint8
pixels and normalises them on read with the processor's exact float ops (formats/meta.py
Normalisation: a numba kernel on the CPU, or, given ``device``, a 3 x 256 table after the uint8
pixels moved there).

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

from neva_pack.formats import open_packed


class PackedSeqDataset(Dataset):
    """Packs of an output directory or prefix (``pack_size`` picks one size of a --pack_sizes output)."""

    def __init__(self, path: str | Path, *, device=None, dtype: torch.dtype | None = None, pack_size: int | None = None):
        self._reader = open_packed(Path(path), pack_size=pack_size)
        self.meta = self._reader.meta
        self.prefix = self._reader.prefix
        self.crop_size = tuple(self.meta.crop_size)
        self.ignore_index = int(self.meta.ignore_index)
        self.device = device
        self.dtype = dtype
        self.pad_id = int(self.meta.pad_id)
        self.pad_to_multiple_of = int(self.meta.pad_to_multiple_of)
        table = self._reader.plan_table()  # per-sample image counts, in pack order
        self._offsets = table.offsets
        self._num_images = table.num_images.astype(np.int32)

    def __len__(self) -> int:
        return len(self._reader)

    @property
    def max_samples_in_a_pack(self) -> int:
        """The most samples any pack holds (what fixed-size cu_seqlens are sized by)."""
        return int(np.diff(self._offsets).max(initial=1))

    def __getitem__(self, p: int) -> dict[str, torch.Tensor]:
        if not 0 <= p < len(self):
            raise IndexError(f"pack {p} of {len(self)}")
        pack = self._reader.pack(p, images=False)
        image = self._reader.images(p, device=self.device, dtype=self.dtype)  # the format decides how
        return {
            "cu_seqlens": torch.from_numpy(pack.cu_seqlens.astype(np.int32)),
            "cu_seqlens_unpadded": torch.from_numpy(pack.cu_seqlens_unpadded.astype(np.int32)),
            "num_images": torch.from_numpy(self._num_images[self._offsets[p] : self._offsets[p + 1]].copy()),
            "tokens": torch.from_numpy(pack.tokens),
            "labels": torch.from_numpy(pack.labels),
            "image": image,
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
    concatenated; ``images_per_pack`` says how many belong to each pack (NeMo's zero image of an
    image-less pack included; an item's ``num_images`` is per sample and leaves it out).
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
        "images_per_pack": torch.tensor([len(item["image"]) for item in batch]),
    }
