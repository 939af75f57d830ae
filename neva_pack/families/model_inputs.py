"""The model's inputs for one pack of a dynamic-resolution family (Qwen2-VL, LLaVA-NeXT / OneVision).

A pack of such a family stores each image as uint8 at its own size (``images.StoredImage``); the
model wants its processor's float layout and, for Qwen, multimodal rotary positions (mRoPE)::

    pack      [ sample a: text <vs> pad x 6 <ve> text . . | sample b: text only . ]   (. = alignment padding)
    Qwen      pixel_values    float32 (sum of patches, 3 * 2 * 14 * 14)   image_grid_thw int64 (n, 3)
              position_ids    int64 (3, L): each sample's mRoPE ids as if it were alone (from 0),
                              its padding continuing from the sample's largest id + 1
    LLaVA-NeXT pixel_values   float32 (n, 1 + most tiles, 3, S, S), zero tiles after an image's own
              image_sizes     int64 (n, 2) (height, width)
              position_ids    int64 (L,): 0, 1, ... restarting at every sample (padding included)
    OneVision  as LLaVA-NeXT, and batch_num_images int64 (samples,): the images of each sample

OneVision tiles an image only when it is its sample's only one (a sample of several has each image
as one untiled square: ``images.anyres`` ``multi_image``); its model tells the two apart by
``batch_num_images`` alone, one count per sample, so a pack's item carries its samples' counts.

Pixels come from the processor's ``model_inputs`` (bit-identical to transformers' processor over
the same images in the same order); the positions are ``neva_pack.families.mrope.mrope_position_ids`` on
each sample alone, which is what the reference's ``get_rope_index`` gives that sample. An
image-less pack has 0 rows of ``pixel_values``, never a zero image.
"""

from __future__ import annotations

import numpy as np

from neva_pack.families.dynamic import DynamicProcessor, StoredImage
from neva_pack.families.mrope import mrope_position_ids

__all__ = ["counts_images_per_sample", "pack_model_inputs", "restarting_positions"]


def restarting_positions(cu_seqlens: np.ndarray) -> np.ndarray:
    """int64 positions 0, 1, ... restarting at every boundary: [0, 3, 5] -> [0, 1, 2, 0, 1]."""
    bounds = np.asarray(cu_seqlens, dtype=np.int64)
    sizes = np.diff(bounds)
    return np.arange(int(bounds[-1]), dtype=np.int64) - np.repeat(bounds[:-1], sizes)


def counts_images_per_sample(processor: DynamicProcessor) -> bool:
    """Whether the model of ``processor``'s images takes ``batch_num_images`` (OneVision: its
    ``anyres_max_N`` pooling; LLaVA-NeXT and Qwen do not take it)."""
    return processor.counts_images_per_sample


def pack_model_inputs(
    *,
    tokens: np.ndarray,
    cu_seqlens: np.ndarray,
    cu_seqlens_unpadded: np.ndarray,
    num_images: np.ndarray,
    stored_images: list[StoredImage],
    processor: DynamicProcessor,
    patch_id: int,
) -> dict[str, np.ndarray]:
    """``position_ids`` and the images in the model's layout (module docstring) for one pack.

    ``cu_seqlens`` are the samples' boundaries in the pack (padded lengths), ``cu_seqlens_unpadded``
    their real lengths cumulated, ``num_images`` the images of each sample, ``stored_images`` the
    pack's images in placeholder order, ``processor`` the output's (``images.dynamic_processor``),
    ``patch_id`` the id of every image-feature position (Qwen ``<|image_pad|>``, LLaVA ``<image>``).
    ValueError when the images and the placeholders disagree (count or length), or (OneVision) an
    image stored tiled in a sample of several or untiled alone in its sample.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    bounds = np.asarray(cu_seqlens, dtype=np.int64)
    real = np.diff(np.asarray(cu_seqlens_unpadded, dtype=np.int64))
    counts = np.asarray(num_images, dtype=np.int64)
    if len(counts) != len(bounds) - 1 or int(counts.sum()) != len(stored_images):
        raise ValueError(f"{len(stored_images)} images for samples holding {counts.tolist()}")
    expected = sum(image.tokens for image in stored_images) if processor.family == "anyres" else None
    if expected is not None and int((tokens == patch_id).sum()) != expected:
        raise ValueError(f"{int((tokens == patch_id).sum())} image positions in the pack, its images make {expected}")
    inputs = processor.model_inputs(list(stored_images))
    if counts_images_per_sample(processor):
        _check_tiling(stored_images, counts)
        inputs["batch_num_images"] = counts.copy()
    if processor.family == "native":
        inputs["position_ids"] = _mrope_of_pack(tokens, bounds, real, counts, inputs["image_grid_thw"], processor.settings.merge_size, patch_id)
    else:
        inputs["position_ids"] = restarting_positions(bounds)
    return inputs


def _check_tiling(stored_images: list[StoredImage], counts: np.ndarray) -> None:
    """OneVision: each image stored as its sample's count says the model will read it (an untiled
    square is one part, a tiled image its base image and its resized one)."""
    alone = np.repeat(counts == 1, counts)
    for k, (image, single) in enumerate(zip(stored_images, alone)):
        if (len(image.parts) == 1) == bool(single):
            state = "untiled" if len(image.parts) == 1 else "tiled"
            raise ValueError(f"image {k} of the pack is stored {state} in a sample of {'one image' if single else 'several'}")


def _mrope_of_pack(tokens, bounds, real, counts, grids, merge_size: int, patch_id: int) -> np.ndarray:
    """(3, L): each sample's mRoPE ids alone; its padding continues from its largest id + 1."""
    out = np.empty((3, int(bounds[-1])), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)])
    for k in range(len(counts)):
        start, end, length = int(bounds[k]), int(bounds[k + 1]), int(real[k])
        sample = mrope_position_ids(tokens[start : start + length] == patch_id, grids[first[k] : first[k + 1]], merge_size)
        out[:, start : start + length] = sample
        following = int(sample.max(initial=-1)) + 1
        out[:, start + length : end] = np.arange(following, following + end - start - length)
    return out
