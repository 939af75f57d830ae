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


def dynamic_resolution_like(
    samples: int, capacity: int, seed: int = 0, encoder: str = "Qwen/Qwen2-VL-7B-Instruct"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A native-resolution (Qwen2-VL) SFT mix: lengths, images, image tokens and vision cost per sample.

    0-4 images per sample (15% text-only, most one image, a tail of multi-image samples); image sizes
    of phone photos, screenshots and small web images (aspect ratios 4:3, 16:9, 1:1, 3:4, 9:16, 21:9),
    each image's tokens from the encoder's own ``tokens_for_size`` (its released min/max pixels) and its
    vision cost (patches squared); lognormal text of median 180 positions. Samples longer than
    ``capacity`` are left out (a run would cut them before an image run).
    """
    from neva_pack.families import resolve_encoder
    from neva_pack.families import dynamic_processor

    processor = dynamic_processor(resolve_encoder(encoder))
    merge = processor.settings.merge_size
    rng = np.random.default_rng(seed)
    counts = rng.choice([0, 1, 2, 3, 4], p=[0.15, 0.6, 0.13, 0.07, 0.05], size=samples)
    ratios = np.array([4 / 3, 16 / 9, 1.0, 3 / 4, 9 / 16, 21 / 9])
    kinds = [(0.35, 0.4, 3.0), (0.35, 1.0, 2.5), (0.3, 0.08, 0.25)]  # (share, median megapixels, lognormal sigma...)
    total = int(counts.sum())
    kind = rng.choice(len(kinds), p=[k[0] for k in kinds], size=total)
    megapixels = np.array([rng.lognormal(np.log(kinds[k][1]), 0.6) for k in kind]) * 1e6
    ratio = rng.choice(ratios, size=total)
    widths = np.maximum(np.round(np.sqrt(megapixels * ratio)), 28).astype(int)
    heights = np.maximum(np.round(megapixels / widths), 28).astype(int)
    tokens = np.array([processor.tokens_for_size(int(w), int(h)) for w, h in zip(widths, heights)], dtype=np.int64)
    cost = (tokens * merge * merge) ** 2
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    image_tokens = np.add.reduceat(np.concatenate([tokens, [0]]), starts) * (counts > 0)
    vision_cost = np.add.reduceat(np.concatenate([cost, [0]]), starts) * (counts > 0)
    image_tokens += 2 * counts  # <|vision_start|> and <|vision_end|> around each image run
    text = np.clip(np.round(rng.lognormal(np.log(180), 0.9, samples)), 8, 6000).astype(np.int64)
    lengths = image_tokens + text
    keep = lengths <= capacity
    return lengths[keep], counts[keep].astype(np.int64), image_tokens[keep], vision_cost[keep]
