"""NeMo Automodel's VLM recipe on a packed output: the dataset its YAML ``_target_`` builds, with items
in the contract of its ``neat_packed_vlm_collater``, and that collater bound as its ``collate_fn``.

    dataset:
      _target_: neva_pack.integrations.automodel.packed_dataset
      path: /data/out                       # a --output_format compact (or any) output of a family's images
    dataloader:
      _target_: torchdata.stateful_dataloader.StatefulDataLoader
      collate_fn:
        _target_: neva_pack.integrations.automodel.collate

What Automodel 0.7 does with these (``recipes/_typed_config.py``, ``datasets/vlm/loader.py``): a dataset
``_target_`` that is not one of its own is called with the node's other fields; without ``max_length``
or ``pretokenize`` it is not tokenized again, and without a ``packed_sequence`` section it is not packed
again; a ``collate_fn`` node is called as ``collate_fn(examples, processor=<its processor>)``, which
``neat_packed_vlm_collater`` does not take: ``collate`` takes it and calls the collater.

An item of pack p is what Automodel's own neat packing (``datasets/vlm/neat_packing_vlm.py``) makes of
the same samples in the same pack::

    input_ids          int64 (L,)     the pack's tokens: each sample's ids[:-1] (already shifted)
    labels             int64 (L,)     each sample's ids[1:], -100 where not trained
    attention_mask     int64 (L,)     1 on the first sample's positions, 2 on the second's, ... (indexed)
    position_ids       int64 (rows, L) or (L,)   the family's positions, each sample's from 0
    mm_token_type_ids  int64 (L,)     1 on image positions, 0 elsewhere
    <media keys>       the family's model inputs (pixel values, per-image metadata), placeholder order
    n_images, n_videos int            images (videos) of the pack
    seq_lens, seq_lens_padded  list   real and occupied positions of each sample

(golden-tested against Automodel's own preprocessing and packing, and its collater over both, in
tests/integrations/test_automodel.py). The collater pads a batch's packs to the longest, builds the
block-causal mask from ``attention_mask`` and concatenates the media.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from neva_pack.reading import PackedSeqDataset

__all__ = ["AUTOMODEL_IGNORE_INDEX", "AutomodelPacks", "collate", "packed_dataset"]

AUTOMODEL_IGNORE_INDEX = -100
"""The label of untrained positions Automodel's losses skip."""

_ITEM_KEYS = ("cu_seqlens", "cu_seqlens_unpadded", "num_images", "tokens", "labels", "position_ids")
"""Keys of our items that are not model inputs of the family (turned into the contract's own)."""


def _media_keys() -> tuple[str, ...]:
    """The media keys Automodel's neat packing carries and its collater concatenates."""
    try:
        from nemo_automodel.components.datasets.vlm.neat_packing_vlm import MEDIA_KEYS
    except ImportError as error:
        raise ImportError(f"NeMo Automodel's packed VLM items need nemo_automodel: pip install nemo-automodel ({error})") from error
    return tuple(MEDIA_KEYS)


class AutomodelPacks(Dataset):
    """The packs of a ``PackedSeqDataset`` as Automodel's packed VLM items (module docstring).

    ``media_keys``: the media keys Automodel's collater concatenates (None: its own ``MEDIA_KEYS``, read
    from nemo_automodel). Refused in one line: an output of fixed crops (its image stack is no input
    Automodel's VLM models take as it is), a family whose items carry a model input outside
    ``media_keys`` (the collater would drop it), a family whose model attends both ways inside each
    image (the collater's block-causal mask cannot open an image's block)."""

    def __init__(self, packs: PackedSeqDataset, media_keys: tuple[str, ...] | None = None):
        family = packs.processor
        if family is None:
            raise ValueError(f"{packs.prefix}: an output of fixed crops: Automodel's packed VLM items carry a family's own model inputs "
                             "(preprocess with a native-resolution encoder)")  # fmt: skip
        if getattr(family, "attention", None) is not None and family.attention.bidirectional_images:
            raise ValueError(f"{packs.prefix}: the {family.models} model attends both ways inside each image, which "
                             "neat_packed_vlm_collater's block-causal mask does not give")  # fmt: skip
        if media_keys is not None and (isinstance(media_keys, str) or not all(isinstance(key, str) for key in media_keys)):
            raise ValueError(f"media_keys {media_keys!r}: expected a list of model input names (strings)")  # a YAML value: untrusted
        media = tuple(_media_keys() if media_keys is None else media_keys)
        dropped = sorted(key for key in family.batch_keys if key not in media and key != "mm_token_type_ids")
        if dropped:
            raise ValueError(f"{packs.prefix}: the {family.models} inputs {dropped} are not among the media keys "
                             f"neat_packed_vlm_collater carries ({', '.join(media)})")  # fmt: skip
        self.packs = packs
        self.meta = packs.meta
        self.media_keys = media
        self.pad_id = int(packs.meta.pad_id)
        self.patch_id = int(packs.meta.image_run.patch_id)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, p: int) -> dict:
        item = self.packs[p]
        bounds = item["cu_seqlens"].long()
        occupied = torch.diff(bounds)
        tokens = item["tokens"].long()
        labels = item["labels"].long()
        positions = item.get("position_ids")
        if positions is None:
            positions = torch.arange(len(tokens)) - torch.repeat_interleave(bounds[:-1], occupied)
        marks = item.get("mm_token_type_ids")
        packed = {
            "input_ids": tokens,
            "labels": torch.where(labels == int(self.meta.ignore_index), AUTOMODEL_IGNORE_INDEX, labels),
            "attention_mask": torch.repeat_interleave(torch.arange(1, len(occupied) + 1), occupied),
            "position_ids": positions.long(),
            "mm_token_type_ids": (tokens == self.patch_id).long() if marks is None else marks.reshape(-1).long(),
            "seq_lens": torch.diff(item["cu_seqlens_unpadded"].long()).tolist(),
            "seq_lens_padded": occupied.tolist(),
            "n_images": int(item["num_images"].sum()),
            "n_videos": 0,
        }
        for key, value in item.items():
            if key not in _ITEM_KEYS and key in self.media_keys and len(value):
                packed[key] = value
        return packed


def packed_dataset(path: str | Path, pack_size: int | None = None, media_keys: list[str] | None = None) -> AutomodelPacks:
    """The dataset of the YAML's ``dataset._target_``: the packs at ``path`` (an output directory or
    prefix; ``pack_size`` picks one size of a --pack_sizes output) as Automodel's packed VLM items."""
    return AutomodelPacks(PackedSeqDataset(path, pack_size=pack_size), media_keys)


def collate(examples: list[dict], processor=None, **settings) -> dict:
    """The YAML's ``dataloader.collate_fn._target_``: Automodel's ``neat_packed_vlm_collater`` over the
    items (``settings``: its keyword arguments, ``max_length`` for one fixed row length); its
    ``padding_idx`` is the processor's tokenizer's pad id, as Automodel's own packing pads with."""
    try:
        from nemo_automodel.components.datasets.vlm.collate_fns import neat_packed_vlm_collater
    except ImportError as error:
        raise ImportError(f"Automodel's collate needs nemo_automodel: pip install nemo-automodel ({error})") from error
    tokenizer = getattr(processor, "tokenizer", processor)
    padding = getattr(tokenizer, "pad_token_id", None)
    settings.setdefault("padding_idx", int(padding) if padding is not None else 0)
    return neat_packed_vlm_collater(examples, **settings)
