"""Synthetic sequence-length distributions for packing benchmarks (documented, seeded).

LLaVA-1.5 mix665k-like (the canonical NeVA fine-tuning set; ASSETS.md facts):
  665,298 samples: 624,610 with one image, 40,688 text-only.
  image sample = image_positions (576 for CLIP-L/14-336) + text tokens;
  text tokens ~ round(lognormal(median 140, sigma 0.75)), clipped to [12, 3000]
      (median text roughly 100-200 tokens, a long multi-turn tail to a few thousand);
  text-only sample = round(lognormal(median 260, sigma 1.0)), clipped to [8, 4000]
      (ShareGPT-style conversations, longer and more spread).
  Every length is finally clipped to the capacity, as the pipeline truncates.

SFT-like: the 6,144 real OpenChat V1 lengths (shared/data, multipack_sampler's benchmark input)
when present, else a lognormal(median 400, sigma 0.9) stand-in of the same size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LLAVA_IMAGE_SAMPLES = 624_610
LLAVA_TEXT_ONLY = 40_688
OPENCHAT_LENGTHS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "openchat_v1_lengths.json"


def llava_like(capacity: int, seed: int = 0, image_positions: int = 576, scale: float = 1.0) -> np.ndarray:
    return llava_like_with_images(capacity, seed, image_positions, scale)[0]


def llava_like_with_images(
    capacity: int, seed: int = 0, image_positions: int = 576, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The lengths of ``llava_like`` and the number of images of each sample (1, or 0 for text-only)."""
    rng = np.random.default_rng(seed)
    n_image = int(LLAVA_IMAGE_SAMPLES * scale)
    n_text = int(LLAVA_TEXT_ONLY * scale)
    text = np.clip(np.round(rng.lognormal(np.log(140), 0.75, n_image)), 12, 3000).astype(np.int64)
    image_samples = image_positions + text
    text_only = np.clip(np.round(rng.lognormal(np.log(260), 1.0, n_text)), 8, 4000).astype(np.int64)
    order = rng.permutation(n_image + n_text)  # the same draw as shuffling the lengths in place
    lengths = np.concatenate([image_samples, text_only])[order]
    images = np.concatenate([np.ones(n_image, np.int64), np.zeros(n_text, np.int64)])[order]
    return np.minimum(lengths, capacity), images


def sft_like(capacity: int, seed: int = 0) -> tuple[np.ndarray, str]:
    if OPENCHAT_LENGTHS.is_file():
        data = json.loads(OPENCHAT_LENGTHS.read_text())
        lengths = np.asarray(data if isinstance(data, list) else data.get("lengths", data), dtype=np.int64)
        return np.minimum(lengths, capacity), "openchat_v1 (real, 6,144)"
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(400), 0.9, 6144)), 4, None).astype(np.int64)
    return np.minimum(lengths, capacity), "lognormal stand-in (6,144)"
