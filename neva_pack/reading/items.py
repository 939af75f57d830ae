"""How a pack, or one sample of it, becomes an item: chosen once per output from what its meta says,
so that ``PackedSeqDataset`` and ``PackedSamples`` never ask what kind of images they read.

    StackedItems   images of one crop shape, as the format's reader hands them: ``image`` (N, 3, H, W),
                   normalised (NeMo's item; one zero image for an image-less pack or sample)
    FamilyItems    images each at their own size: the family's own model inputs (``pixel_values`` and
                   its per-image keys, its positions and per-sample extras), made from the stored uint8
                   parts by the family the output's meta records (``families.processor_from_record``)

Both give tokens, labels, cu_seqlens, cu_seqlens_unpadded and num_images alike.
"""

from __future__ import annotations

import numpy as np
import torch

from neva_pack.families import pack_model_inputs
from neva_pack.formats import ReadPack

__all__ = ["FamilyItems", "StackedItems", "dynamic_pack_item", "item_layout", "sample_of_pack"]


def item_layout(packs, family):
    """The item layout of ``packs`` (a PackedSeqDataset): its family's inputs where it has one, else the stack."""
    return StackedItems(packs) if family is None else FamilyItems(packs, family)


class StackedItems:
    """Images of one crop shape: the format decides how its ``image`` stack is made (nemo stores it
    normalised; compact and energon normalise uint8 on read, on ``device`` if given)."""

    def __init__(self, packs):
        self.packs = packs

    def pack(self, p: int) -> dict[str, torch.Tensor]:
        packs = self.packs
        pack = packs.checked(p, packs._reader.pack(p, images=False))
        return {
            "cu_seqlens": torch.from_numpy(pack.cu_seqlens.astype(np.int32)),
            "cu_seqlens_unpadded": torch.from_numpy(pack.cu_seqlens_unpadded.astype(np.int32)),
            "num_images": torch.from_numpy(packs.sample_images(p)),
            "tokens": torch.from_numpy(pack.tokens),
            "labels": torch.from_numpy(pack.labels),
            "image": packs._reader.images(p, device=packs.device, dtype=packs.dtype),
        }

    def sample(self, p: int, k: int, cache: dict) -> dict[str, torch.Tensor]:
        """Sample ``k`` of pack ``p`` as a one-sample item (``cache``: the last pack item read)."""
        if cache.get("p") != p:
            cache.update(p=p, item=self.packs[p])
        pack = cache["item"]
        start, end = int(pack["cu_seqlens"][k]), int(pack["cu_seqlens"][k + 1])
        first_image, images = int(pack["num_images"][:k].sum()), int(pack["num_images"][k])
        real = int(pack["cu_seqlens_unpadded"][k + 1] - pack["cu_seqlens_unpadded"][k])
        return {
            "cu_seqlens": torch.tensor([0, end - start], dtype=torch.int32),
            "cu_seqlens_unpadded": torch.tensor([0, real], dtype=torch.int32),
            "num_images": pack["num_images"][k : k + 1].clone(),
            "tokens": pack["tokens"][start:end].clone(),
            "labels": pack["labels"][start:end].clone(),
            "image": pack["image"][first_image : first_image + images].clone() if images else torch.zeros_like(pack["image"][:1]),
        }


class FamilyItems:
    """Images each at their own size: the family's model inputs, a sample's made from its own images
    alone (their own tile padding, positions from 0)."""

    def __init__(self, packs, family):
        self.packs = packs
        self.family = family

    def pack(self, p: int) -> dict[str, torch.Tensor]:
        packs = self.packs
        return dynamic_pack_item(packs.checked(p, packs._reader.pack(p)), packs.sample_images(p), self.family, packs.meta.image_run.patch_id)

    def sample(self, p: int, k: int, cache: dict) -> dict[str, torch.Tensor]:
        packs = self.packs
        if cache.get("p") != p:
            cache.update(p=p, item=packs.checked(p, packs._reader.pack(p)))
        counts = packs.sample_images(p)
        sample = sample_of_pack(cache["item"], counts, k)
        return dynamic_pack_item(sample, counts[k : k + 1], self.family, packs.meta.image_run.patch_id)


def dynamic_pack_item(pack: ReadPack, num_images: np.ndarray, processor, patch_id: int) -> dict[str, torch.Tensor]:
    """The item of a pack of a family whose images each have their own size: tokens, labels,
    boundaries, num_images (per sample) and ``families.pack_model_inputs`` of its stored images."""
    inputs = pack_model_inputs(
        tokens=pack.tokens,
        cu_seqlens=pack.cu_seqlens,
        cu_seqlens_unpadded=pack.cu_seqlens_unpadded,
        num_images=num_images,
        stored_images=list(pack.stored_images or ()),
        processor=processor,
        patch_id=patch_id,
    )
    return {
        "cu_seqlens": torch.from_numpy(np.asarray(pack.cu_seqlens).astype(np.int32)),
        "cu_seqlens_unpadded": torch.from_numpy(np.asarray(pack.cu_seqlens_unpadded).astype(np.int32)),
        "num_images": torch.from_numpy(np.asarray(num_images, dtype=np.int32)),
        "tokens": torch.from_numpy(np.asarray(pack.tokens, dtype=np.int64)),
        "labels": torch.from_numpy(np.asarray(pack.labels, dtype=np.int64)),
        **{key: torch.from_numpy(value) for key, value in inputs.items()},
    }


def sample_of_pack(pack: ReadPack, num_images: np.ndarray, k: int) -> ReadPack:
    """Sample ``k`` of a read pack whose images each have their own size, as a one-sample pack."""
    bounds, real = np.asarray(pack.cu_seqlens), np.asarray(pack.cu_seqlens_unpadded)
    start, end = int(bounds[k]), int(bounds[k + 1])
    first, count = int(np.sum(num_images[:k])), int(num_images[k])
    lengths = pack.image_lengths
    return ReadPack(
        cu_seqlens=np.array([0, end - start], dtype=np.int64),
        cu_seqlens_unpadded=np.array([0, real[k + 1] - real[k]], dtype=np.int64),
        tokens=pack.tokens[start:end],
        labels=pack.labels[start:end],
        pixels=None,
        images=None,
        num_images=count,
        image_lengths=None if lengths is None else lengths[first : first + count],
        stored_images=list(pack.stored_images or ())[first : first + count],
    )
