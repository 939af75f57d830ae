"""Megatron Bridge's VLM training (``vlm_step``) on a packed output: a dataset provider for its
``ConfigContainer.dataset``, whose dataset's ``collate_fn`` gives the batch Bridge's own task encoder
and in-batch packing give for the same samples in the same grouping.

    from neva_pack.integrations.megatron_bridge import PackedVLMDatasetProvider
    cfg.dataset = PackedVLMDatasetProvider(path="out/", seq_length=cfg.model.seq_length)
    cfg.train.micro_batch_size = 1                     # packs per THD row

What Bridge does with it (Megatron-Bridge 067f987d: ``data/base.py``, ``data/utils.py``, ``data/loaders.py``,
``training/vlm_step.py``): a ``DatasetProvider`` subclass in ``cfg.dataset`` has its ``build_datasets``
called; the train dataset's ``collate_fn`` collates each micro-batch; ``vlm_step.get_batch`` reads
``input_ids``, ``labels``, ``loss_mask``, ``position_ids``, the ``cu_seqlens_q/kv(_padded)`` and
``max_seqlen_q/kv`` of a packed row, and ``visual_inputs`` (its ``GenericVisualInputs``), whose
``normalized_for_model()`` gives the model its image inputs.

A batch is one THD row: the micro-batch's packs end to end, each sample as Bridge's in-batch packing
lays it (``data/packing/in_batch.py``, ``models/qwen_vl/data/collate_fn.py``)::

    our pack:    tokens  [a0 a1 a2 | b0 b1]         labels [a1 a2 a3 | b1 b2]     (ids[:-1], ids[1:])
    Bridge row:  input_ids [a0 a1 a2 a3 | b0 b1 b2]  labels [a1 a2 a3 -100 | b1 b2 -100]
                 position_ids [0 1 2 3 | 0 1 2]      cu_seqlens_q [0, 4, 7]

Bridge feeds each sample's whole ids and scores none of the last position, so a row is one position
longer per sample than the pack (``seq_length`` must allow it: ``check_seq_length``); the added id is
the sample's last target (the pad id where it is not trained: a position nothing attends from and
nothing scores). The model computes its multimodal positions itself from ``input_ids`` and the image
grids, so ``position_ids`` restart per sample, 1-D, as Bridge's.

The images must be those Bridge's task encoder gives the model: its collate resizes each image twice
(qwen-vl-utils' ``fetch_image`` to a multiple of 28, then the processor to its own factor within the task
encoder's ``min_pixels`` / ``max_pixels``, on the processor's torchvision backend), which an output follows
only when preprocessed with ``--image_reference megatron_bridge`` (``BRIDGE_IMAGE_REFERENCE``; the family's
module says how): any other reference is refused in one line. Its ``--min_pixels`` / ``--max_pixels``
default to the task encoder config's defaults; a config with other bounds needs the same flags.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from neva_pack.reading import PackedSamples, PackedSeqDataset

__all__ = ["BRIDGE_IGNORE_INDEX", "BRIDGE_IMAGE_REFERENCE", "BridgeVLMPacks", "bridge_vlm_batch", "bridge_vlm_packs", "check_seq_length"]

BRIDGE_IGNORE_INDEX = -100
"""The label Bridge's loss ignores (its ``IGNORE_INDEX``)."""

BRIDGE_IMAGE_REFERENCE = "megatron_bridge"
"""The ``--image_reference`` whose images are the ones Bridge's task encoder makes (module docstring)."""

_ITEM_KEYS = ("cu_seqlens", "cu_seqlens_unpadded", "num_images", "tokens", "labels", "position_ids")
"""Keys of our items that are not the family's model inputs."""


def _visual_inputs_type():
    """Bridge's ``GenericVisualInputs``, the object ``vlm_step`` takes as ``visual_inputs``."""
    try:
        from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
    except ImportError as error:
        raise ImportError(f"Megatron Bridge's VLM batches need megatron.bridge importable ({error})") from error
    return GenericVisualInputs


class BridgeVLMPacks(Dataset):
    """The packs of a ``PackedSeqDataset`` with ``collate_fn`` giving Bridge's ``vlm_step`` batch.

    ``visual_inputs``: the class of ``visual_inputs`` (None: Bridge's ``GenericVisualInputs``); its
    fields are the model inputs it can carry. Refused in one line: a fixed-crop output, an output padded
    for alignment (Bridge aligns each sample with its last position added), and a family Bridge cannot
    train packed: one whose model attends both ways inside each image, whose model inputs are not all
    ``visual_inputs`` fields, or whose positions are not rows the model computes from its image grids
    (Bridge's in-batch packing is its task encoder of that kind of model only); and an output of such a
    family made with another ``--image_reference`` than ``BRIDGE_IMAGE_REFERENCE`` (its images are not
    Bridge's), or reading video clips (Bridge's collate runs qwen-vl-utils' ``fetch_video`` on them, then the
    processor's video resize: no ``--video_profile`` makes those frames)."""

    def __init__(self, packs: PackedSeqDataset, visual_inputs=None):
        family = packs.processor
        where = str(packs.prefix)
        if family is None:
            raise ValueError(f"{where}: an output of fixed crops: Megatron Bridge packs VLM samples only with a family's own inputs")
        if int(packs.meta.pad_to_multiple_of) > 1:
            raise ValueError(f"{where}: samples padded to a multiple of {packs.meta.pad_to_multiple_of}: Bridge's rows add each "
                             "sample's last position, which breaks that alignment; preprocess without --pad_to_multiple_of")  # fmt: skip
        if BRIDGE_IMAGE_REFERENCE in getattr(family, "references", ()):
            reference = family.options().get("arithmetic") or "transformers"
            if reference != BRIDGE_IMAGE_REFERENCE:
                raise ValueError(f"{where}: images made with --image_reference {reference}, not those Megatron Bridge's task encoder "
                                 f"makes (it resizes each image twice): preprocess with --image_reference {BRIDGE_IMAGE_REFERENCE}")  # fmt: skip
        if getattr(family, "takes_videos", False):
            raise ValueError(f"{where}: an output reading video clips: Megatron Bridge's task encoder samples and resizes their "
                             "frames its own way, which no --video_profile follows; preprocess without video records")  # fmt: skip
        self.visual_inputs = _visual_inputs_type() if visual_inputs is None else visual_inputs
        fields = {f.name for f in dataclasses.fields(self.visual_inputs)}
        if getattr(family, "attention", None) is not None and family.attention.bidirectional_images:
            raise ValueError(f"{where}: the {family.models} model attends both ways inside each image: Megatron Bridge cannot "
                             "train it packed (its THD attention is causal per sample)")  # fmt: skip
        outside = sorted(set(family.batch_keys) - fields)
        if outside:
            raise ValueError(f"{where}: the {family.models} inputs {outside} are not fields of Bridge's visual inputs: "
                             "Megatron Bridge cannot train it packed")  # fmt: skip
        positions = packs[0].get("position_ids") if len(packs) else None
        if len(packs) and (positions is None or positions.dim() != 2):
            raise ValueError(f"{where}: Megatron Bridge's in-batch packing is its task encoder of models whose positions are "
                             f"rows computed from the image grids; the {family.models} model's are not")  # fmt: skip
        self.packs = packs
        self.fields = fields
        self.ignore_index = int(packs.meta.ignore_index)
        self.pad_id = int(packs.meta.pad_id)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, p: int) -> dict:
        return self.packs[p]

    def row_lengths(self) -> np.ndarray:
        """int64: the positions of each pack's Bridge row (the pack's, plus one per sample)."""
        samples = PackedSamples(self.packs)
        sizes = np.diff(samples.offsets)
        return np.add.reduceat(samples.lengths, samples.offsets[:-1]) + sizes  # a pack is never empty

    def collate_fn(self, items: list[dict]) -> dict:
        """The ``vlm_step`` batch of a micro-batch of packs (module docstring)."""
        return bridge_vlm_batch(items, ignore_index=self.ignore_index, pad_id=self.pad_id, fields=self.fields,
                                visual_inputs=self.visual_inputs)  # fmt: skip


def check_seq_length(dataset: BridgeVLMPacks, seq_length: int, micro_batch_size: int = 1) -> None:
    """ValueError, in one line, when a row of ``micro_batch_size`` packs can exceed ``seq_length``
    (each pack's row is its length plus one position per sample)."""
    longest = int(np.sort(dataset.row_lengths())[::-1][:micro_batch_size].sum()) if len(dataset) else 0
    if longest > seq_length:
        raise ValueError(f"rows of {micro_batch_size} pack(s) reach {longest} positions (each sample adds its last id) over "
                         f"seq_length={seq_length}: raise seq_length or preprocess with a smaller --max_seq_length")  # fmt: skip


def bridge_vlm_batch(items: list[dict], *, ignore_index: int, pad_id: int, fields: set[str], visual_inputs) -> dict:
    """One THD row of ``items`` (packs) as Bridge's in-batch packing gives it (module docstring)."""
    tokens, labels, positions, bounds = [], [], [], [0]
    for item in items:
        cu = item["cu_seqlens"].long().tolist()
        for start, end in itertools.pairwise(cu):
            ids, targets = item["tokens"][start:end].long(), item["labels"][start:end].long()
            last = int(targets[-1]) if int(targets[-1]) != ignore_index else pad_id
            tokens.append(torch.cat([ids, torch.tensor([last])]))
            targets = torch.where(targets == ignore_index, BRIDGE_IGNORE_INDEX, targets)
            labels.append(torch.cat([targets, torch.tensor([BRIDGE_IGNORE_INDEX])]))
            positions.append(torch.arange(end - start + 1))
            bounds.append(bounds[-1] + end - start + 1)
    labels = torch.cat(labels)[None]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    longest = torch.tensor(int(torch.diff(cu_seqlens).max()), dtype=torch.int32)
    media = {}
    for key in items[0]:
        if key not in _ITEM_KEYS and key in fields:
            values = [item[key] for item in items if len(item[key])]
            if values:
                media[key] = torch.cat(values)
    return {
        "input_ids": torch.cat(tokens)[None],
        "position_ids": torch.cat(positions)[None],
        "attention_mask": None,
        "labels": labels,
        "loss_mask": (labels != BRIDGE_IGNORE_INDEX).to(torch.float32),
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_kv": cu_seqlens,
        "max_seqlen_q": longest,
        "max_seqlen_kv": longest,
        "total_tokens": int(cu_seqlens[-1]),
        "visual_inputs": visual_inputs(**media),
    }


def bridge_vlm_packs(path: str | Path, pack_size: int | None = None, visual_inputs=None) -> BridgeVLMPacks:
    """``BridgeVLMPacks`` of the packs at ``path`` (an output directory or prefix, any format)."""
    return BridgeVLMPacks(PackedSeqDataset(path, pack_size=pack_size), visual_inputs)


def _provider_class():
    """``PackedVLMDatasetProvider``: Bridge's ``DatasetProvider`` over our packs (made where Bridge imports)."""
    from megatron.bridge.data.base import DatasetProvider

    @dataclasses.dataclass(kw_only=True)
    class PackedVLMDatasetProvider(DatasetProvider):
        """``cfg.dataset`` for ``vlm_step`` on a neva_pack output: train packs, no validation split."""

        path: str
        """The output directory (or prefix) of a neva_pack run, any format."""
        pack_size: int | None = None
        """One size of a --pack_sizes output."""
        seq_length: int | None = None
        """The model's sequence length: rows that could exceed it are refused when building."""
        micro_batch_size: int = 1
        """Packs per THD row (``cfg.train.micro_batch_size``)."""
        dataloader_type: str | None = "cyclic"

        def build_datasets(self, context):
            train = bridge_vlm_packs(self.path, self.pack_size)
            if self.seq_length is not None:
                check_seq_length(train, self.seq_length, self.micro_batch_size)
            return train, None, None

    PackedVLMDatasetProvider.__module__ = __name__
    return PackedVLMDatasetProvider


def __getattr__(name: str):
    if name == "PackedVLMDatasetProvider":  # Bridge's base class is imported only when the provider is asked for
        cls = _provider_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
