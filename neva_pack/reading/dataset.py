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

A dynamic-resolution output (Qwen2-VL, LLaVA-NeXT / OneVision: images at their own sizes) is read
with the processor its meta records (``meta.image_processor``, rebuilt offline by
``images.processor_from_record``; a ``processor`` argument overrides it) and gives instead of
``image`` the model's own inputs, as its family makes them (``reading/items.py``)::

    Qwen          position_ids  int64 (3, L)   mRoPE, each sample's alone, restarting at 0
                  pixel_values  float32 (sum of patches, 1176)      image_grid_thw  int64 (n, 3)
    LLaVA-NeXT    position_ids  int64 (L,)     restarting per sample
                  pixel_values  float32 (n, 1 + most tiles, 3, S, S)   image_sizes  int64 (n, 2)
    OneVision     as LLaVA-NeXT, and batch_num_images  int64 (samples,)   images of each sample
                  (its model tiles an image only when it is its sample's only one)

(an image-less pack: ``pixel_values`` with 0 rows, no zero image).

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

from neva_pack.core import IGNORE_INDEX, PAD_ID, InputError
from neva_pack.formats import open_packed, verify_hint
from neva_pack.families import restarting_positions
from neva_pack.reading.item_source import PackItem, source_of
from neva_pack.reading.items import item_layout


class PackedSeqDataset(Dataset):
    """Packs of an output directory or prefix (``pack_size`` picks one size of a --pack_sizes output).

    ``processor``: the dynamic-resolution processor of the output's images (then items carry the
    model's inputs, see the module docstring); None: the one the output's meta records (none for a
    fixed-crop output).

    Opening checks the meta's own checksum and those of the small files the format's reader trusts
    (``formats.open_packed``). Items are ``PackItem``s: dicts that carry ``source`` (this output's
    ``ItemSource``), which the collates check (``reading/item_source.py``)."""

    def __init__(self, path: str | Path, *, device=None, dtype: torch.dtype | None = None, pack_size: int | None = None, processor=None):
        self._reader = open_packed(Path(path), pack_size=pack_size)
        self.meta = self._reader.meta
        self.prefix = self._reader.prefix
        self.processor = processor if processor is not None else _recorded_processor(self.meta)
        self.crop_size = tuple(self.meta.crop_size) if self.meta.crop_size is not None else None
        self.ignore_index = int(self.meta.ignore_index)
        self.device = device
        self.dtype = dtype
        self.pad_id = int(self.meta.pad_id)
        self.pad_to_multiple_of = int(self.meta.pad_to_multiple_of)
        table = self._reader.plan_table()  # per-sample image counts, in pack order
        self._offsets = table.offsets
        self._num_images = table.num_images.astype(np.int32)
        self._bounds = np.concatenate([[0], np.cumsum(table.padded_length)])
        """Where each sample ends in the output's packs, from the plan table the open checked (``checked``)."""
        self._items = item_layout(self, self.processor)
        """How a pack becomes an item: the stack of one crop shape, or the family's inputs (reading/items.py)."""
        self.source = source_of(self.meta, self.processor)
        """What items of one batch must share (ignore value, pad id, image run, family)."""

    def checked(self, p: int, pack):
        """Pack ``p`` as read from a data file (which an open does not hash), once its sample bounds are the
        plan table's and hold its tokens and labels: a damaged .bin gave bounds past the tokens, and the
        batch functions failed far from the cause (a RuntimeError of tensor sizes, an IndexError)."""
        first, last = int(self._offsets[p]), int(self._offsets[p + 1])
        bounds, expected = np.asarray(pack.cu_seqlens), self._bounds[first : last + 1] - self._bounds[first]
        if not (np.array_equal(bounds, expected) and len(pack.tokens) == len(pack.labels) == expected[-1]):
            raise InputError(f"{self.prefix}: pack {p} holds {len(pack.tokens)} tokens and {len(pack.labels)} labels in samples ending at "
                             f"{bounds[1:6].tolist()}, its plan table {expected[1:6].tolist()} (a data file was changed); "
                             f"{verify_hint(self.prefix.parent)}")  # fmt: skip
        return pack

    def marked(self, item: dict) -> PackItem:
        """``item`` as a ``PackItem`` of this output."""
        marked = PackItem(item)
        marked.source = self.source
        return marked

    def __len__(self) -> int:
        return len(self._reader)

    @property
    def max_samples_in_a_pack(self) -> int:
        """The most samples any pack holds (what fixed-size cu_seqlens are sized by)."""
        return int(np.diff(self._offsets).max(initial=1))

    def __getitem__(self, p: int) -> dict[str, torch.Tensor]:
        if not 0 <= p < len(self):
            raise IndexError(f"pack {p} of {len(self)}")
        return self.marked(self._items.pack(p))

    def sample_images(self, p: int) -> np.ndarray:
        """int32: images of each sample of pack ``p``."""
        return self._num_images[self._offsets[p] : self._offsets[p + 1]].copy()


def _recorded_processor(meta):
    """The dynamic-resolution processor a meta records; None for fixed crops."""
    if meta.image_processor is None:
        return None
    from neva_pack.families import processor_from_record

    return processor_from_record(meta.image_processor)


class PackedSamples(Dataset):
    """The samples of a ``PackedSeqDataset`` one by one, for samplers that form their own batches
    (``neva_pack.training.PackedBatchSampler`` over ``lengths``).

    Item j is sample j (in pack order) as a one-sample pack, with the keys of a pack item;
    ``lengths[j]`` is the positions it occupies (alignment padding included). The last pack read is
    kept: a batch's samples that share a pack read it once. A sample without images carries one
    zero image, as an image-less pack does.
    """

    def __init__(self, packs: PackedSeqDataset):
        self.packs = packs
        self.meta = packs.meta
        self.processor = packs.processor
        self.offsets = packs._offsets
        """int64 (packs + 1): pack p holds samples offsets[p]:offsets[p + 1]."""
        table = packs._reader.plan_table()
        self.lengths = table.padded_length
        """int64: positions each sample occupies (what a sampler packs)."""
        self.num_images = table.num_images
        """int64: images of each sample (what a sampler balances the vision encoder's work by)."""
        self.image_tokens = table.image_tokens
        """int64: image tokens of each sample (what --max_image_tokens_per_pack counts); None for an
        output written before they were kept."""
        self.vision_cost = table.vision_cost
        """int64: the vision encoder's attention cost of each sample's images (patches² per encoder
        pass: what a sampler balances ranks by beside the LM's attention); None for an output written
        before it was kept."""
        self._cached: dict = {}
        """The last pack read (``p`` and its item): a batch's samples that share a pack read it once."""

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        if not 0 <= j < len(self):
            raise IndexError(f"sample {j} of {len(self)}")
        p = int(np.searchsorted(self.offsets, j, side="right")) - 1
        return self.packs.marked(self.packs._items.sample(p, j - int(self.offsets[p]), self._cached))


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[0, 3, 5] -> [0, 1, 2, 0, 1] (``model_inputs.restarting_positions``, as a tensor)."""
    return torch.from_numpy(restarting_positions(cu_seqlens.cpu().numpy()))


def collate(batch: list[dict[str, torch.Tensor]], ignore_index: int = IGNORE_INDEX, pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
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
