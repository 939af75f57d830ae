"""The model's inputs for one pack, asked of the output's model family (``base.ModelFamily``).

A pack stores each image as uint8 at the sizes its family resized it to (``core.StoredImage``); the
model wants its processor's float layout, under its own key names, and the positions its rotary
embedding reads. The family supplies each part, and this module puts them together::

    pack      [ sample a: text <image run> text . . | sample b: text only . ]   (. = alignment padding)
    inputs    the family's ``model_inputs`` of the pack's images, in placeholder order (pixel tensors
              and per-image metadata), then its ``sample_extras`` (per-sample keys, when its model
              reads some), then ``position_ids``: (L,) restarting at every sample, or (rows, L)

Every key but ``position_ids`` is one of the family's ``batch_keys``, which say how training joins
it across a batch. Pixels are bit-identical to transformers' processor over the same images in the
same order; an image-less pack has 0 images' worth of pixels, never a zero image.
"""

from __future__ import annotations

import numpy as np

from neva_pack.core import StoredImage
from neva_pack.families.base import ModelFamily

__all__ = ["pack_model_inputs", "stored_vision_cost"]


def pack_model_inputs(
    *,
    tokens: np.ndarray,
    cu_seqlens: np.ndarray,
    cu_seqlens_unpadded: np.ndarray,
    num_images: np.ndarray,
    stored_images: list[StoredImage],
    processor: ModelFamily,
    patch_id: int,
) -> dict[str, np.ndarray]:
    """``position_ids`` and the images in the model's layout (module docstring) for one pack.

    ``cu_seqlens`` are the samples' boundaries in the pack (padded lengths), ``cu_seqlens_unpadded``
    their real lengths cumulated, ``num_images`` the images of each sample, ``stored_images`` the
    pack's images in placeholder order, ``processor`` the output's family (``registry.dynamic_processor``),
    ``patch_id`` the id of every image-feature position. ValueError when the images and the
    placeholders disagree (count or length), or the family finds an image stored otherwise than its
    model will read it.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    bounds = np.asarray(cu_seqlens, dtype=np.int64)
    real = np.diff(np.asarray(cu_seqlens_unpadded, dtype=np.int64))
    counts = np.asarray(num_images, dtype=np.int64)
    images = list(stored_images)
    if len(counts) != len(bounds) - 1 or int(counts.sum()) != len(images):
        raise ValueError(f"{len(images)} images for samples holding {counts.tolist()}")
    extras = processor.sample_extras(tokens, images, counts, patch_id)
    inputs = processor.model_inputs(images)
    inputs.update(extras)
    inputs["position_ids"] = processor.position_ids(tokens, bounds, real, counts, inputs, patch_id)
    return inputs


def stored_vision_cost(processor: ModelFamily, image: StoredImage) -> int:
    """The vision encoder's attention cost of one stored image, as the sample builder weighed it."""
    return processor.vision_cost_of_stored(image.size, len(image.parts), image.tokens)
