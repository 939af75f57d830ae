"""Batching the items of a dynamic-resolution output (Qwen2-VL, LLaVA-NeXT / OneVision): their
images in the model's layout and Qwen's mRoPE rows, packs laid end to end (thd.py and hf.py).

    Qwen          pixel_values    rows of every pack, concatenated       image_grid_thw  (N, 3)
                  mrope           (3, T): each pack's (3, L) position_ids, concatenated
    LLaVA-NeXT    pixel_values    (N, 1 + most tiles, 3, S, S): each pack's images, tiles padded with
                                  zeros to the batch's most (as transformers' processor pads a batch)
                  image_sizes     (N, 2)
    OneVision     as LLaVA-NeXT, and batch_num_images (samples,): every pack's per-sample counts, in order
"""

from __future__ import annotations

import torch

__all__ = ["IMAGE_KEYS", "SAMPLE_KEYS", "batch_images", "is_dynamic", "mrope_rows", "reads_dynamic_images"]

IMAGE_KEYS = ("image_grid_thw", "image_sizes")
"""The per-image keys a dynamic item carries beside pixel_values (Qwen, LLaVA-NeXT)."""
SAMPLE_KEYS = ("batch_num_images",)
"""The per-sample image keys a dynamic item may carry (OneVision: which images its model tiles)."""


def is_dynamic(item: dict) -> bool:
    """An item of a dynamic-resolution output (its images are ``pixel_values``, not ``image``)."""
    return "pixel_values" in item


def reads_dynamic_images(dataset) -> bool:
    """Whether a dataset's items are a dynamic-resolution output's (what the collates configure their
    batches by): one whose meta records its processor, or a dataset read with one."""
    return getattr(dataset, "processor", None) is not None or getattr(dataset.meta, "image_processor", None) is not None


def batch_images(packs: list[dict]) -> dict[str, torch.Tensor]:
    """The packs' ``pixel_values``, per-image and per-sample keys, in placeholder order (module docstring)."""
    pixels = [item["pixel_values"] for item in packs]
    if pixels[0].dim() == 5:  # LLaVA-NeXT: (n, tiles, 3, S, S)
        most = max(p.shape[1] for p in pixels)
        pixels = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in pixels]
    batch = {"pixel_values": torch.cat(pixels)}
    for key in (*IMAGE_KEYS, *SAMPLE_KEYS):
        if key in packs[0]:
            batch[key] = torch.cat([item[key] for item in packs])
    return batch


def mrope_rows(packs: list[dict]) -> torch.Tensor | None:
    """(3, T): the packs' mRoPE position ids end to end; None when the items have 1-D positions."""
    if "position_ids" not in packs[0] or packs[0]["position_ids"].dim() != 2:
        return None
    return torch.cat([item["position_ids"].long() for item in packs], dim=1)
