"""Batching the model inputs a family gives each pack (``families.ModelFamily``): every key the family
declares joins the batch as its declaration says (``families.Join``), packs laid end to end in
placeholder order (thd.py and hf.py). No family is named here: the keys and how they join are the
family's, read from the dataset's family or, for items alone, from every registered family::

    Join.IMAGES    one entry per image, each pack's entries concatenated; trailing dimensions
                   zero-padded to the batch's largest first (tiles of different counts, padded as
                   the family's processor pads a batch)
    Join.SAMPLES   one entry per sample, each pack's concatenated
    Join.TOKENS    one entry per token position, each pack's concatenated, as (1, T) like the tokens
                   (a fixed THD row's extra padding: zeros)
    position_ids   (rows, L) per pack: the rows concatenated along the positions, (rows, T)

A fixed-crop output's items carry the formats' image stack under ``image`` instead (an image-less
pack holds one zero image, dropped here); its batch keys are the trainer's (thd.py, hf.py).
"""

from __future__ import annotations

from typing import Mapping

import torch

from neva_pack.families import FAMILIES, AttentionNeeds, Join, registered_batch_keys

__all__ = ["attention_needs", "dataset_batch_keys", "join_model_inputs", "position_rows"]


def dataset_batch_keys(dataset) -> Mapping[str, Join] | None:
    """The keys the dataset's family declares (a dataset read with a family object: one whose meta
    records it, or one given); None (every registered family's) for a dataset without one."""
    family = getattr(dataset, "processor", None)
    return None if family is None else family.batch_keys


def attention_needs(packs: list[dict], dataset=None) -> AttentionNeeds:
    """What the packs' model needs of attention: the dataset's family's declaration, or for items
    alone, that of the registered families whose every declared key the items carry (the first that
    needs more than causal masking, else causal masking)."""
    family = getattr(dataset, "processor", None)
    if family is not None:
        return getattr(family, "attention", AttentionNeeds())
    keys = set(packs[0]) if packs else set()
    needs = (getattr(cls, "attention", AttentionNeeds()) for cls in FAMILIES.values() if cls.batch_keys and set(cls.batch_keys) <= keys)
    return next((need for need in needs if need.bidirectional_images), AttentionNeeds())


def join_model_inputs(packs: list[dict], batch_keys: Mapping[str, Join] | None = None, extras: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The packs' declared model-input keys (``batch_keys``; None: every registered family's), each
    joined across the packs as declared (module docstring); ``extras``: each pack's extra padding
    positions in a fixed row (per-token keys get zeros there)."""
    declared = registered_batch_keys() if batch_keys is None else batch_keys
    batch = {}
    for key in packs[0]:
        join = declared.get(key)
        if join is None:
            continue
        values = [item[key] for item in packs]
        if join is Join.IMAGES:
            values = _padded(values)
        if join is Join.TOKENS:
            grown = [torch.nn.functional.pad(value, (0, extra)) for value, extra in zip(values, extras or [0] * len(values))]
            batch[key] = torch.cat(grown)[None]
            continue
        batch[key] = torch.cat(values)
    return batch


def _padded(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor zero-padded at the end of every dimension but the first to the largest's size."""
    largest = [max(sizes) for sizes in zip(*(value.shape[1:] for value in values))]
    padded = []
    for value in values:
        widths = [0] * (2 * len(largest))
        for d, size in enumerate(largest):  # F.pad lists the last dimension first
            widths[2 * (len(largest) - 1 - d) + 1] = size - value.shape[1 + d]
        padded.append(torch.nn.functional.pad(value, widths) if any(widths) else value)
    return padded


def position_rows(packs: list[dict]) -> torch.Tensor | None:
    """(rows, T): the packs' position rows end to end, for a family whose positions are rows (its
    items' ``position_ids`` 2-D); None when the items' positions restart per sample (1-D)."""
    if "position_ids" not in packs[0] or packs[0]["position_ids"].dim() != 2:
        return None
    return torch.cat([item["position_ids"].long() for item in packs], dim=1)
