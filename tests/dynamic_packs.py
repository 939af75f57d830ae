"""Packs of dynamic-resolution samples built from real photos (scikit-image's and matplotlib's
sample images), as a reader returns them (``ReadPack`` with stored images), for the reader-item and
real-model tests. Token ids are a tiny vocabulary's (under 64): text 10..59, pad 0."""

from __future__ import annotations

import importlib.resources

import numpy as np
from PIL import Image

from neva_pack.core import IGNORE_INDEX, PAD_ID
from neva_pack.formats import ReadPack
from neva_pack.families import StoredImage

VISION_START, VISION_END, IMAGE, VIDEO = 5, 6, 7, 8
"""Qwen's <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>; LLaVA's <image> is IMAGE."""
VOCAB = 64


def photo(name: str) -> Image.Image:
    """A real image as RGB: skimage's astronaut (512 x 512), coffee (600 x 400), chelsea (451 x 300),
    rocket (640 x 427), text (448 x 172, grey), retina (1411 x 1411); matplotlib's grace_hopper (512 x 600)."""
    if name == "grace_hopper":
        path = importlib.resources.files("matplotlib") / "mpl-data" / "sample_data" / "grace_hopper.jpg"
    else:
        path = next(p for p in (importlib.resources.files("skimage") / "data").iterdir() if p.name.split(".")[0] == name)
    with Image.open(path) as image:
        return image.convert("RGB")


def sample_ids(parts: list, family: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels) of a sample: ``parts`` are text lengths (int) and StoredImages, in order;
    tokens = ids[:-1], labels = ids[1:] (the pack convention), image and prompt targets ignored."""
    rng = np.random.default_rng(seed)
    ids, trained = [], []
    for part in parts:
        if isinstance(part, StoredImage):
            run = [IMAGE] * part.tokens
            if family == "native":
                run = [VISION_START, *run, VISION_END]
            ids += run
            trained += [False] * len(run)
        else:
            ids += rng.integers(10, 60, part).tolist()
            trained += [True] * part
    ids, trained = np.array(ids, dtype=np.int64), np.array(trained)
    labels = np.where(trained[1:], ids[1:], IGNORE_INDEX)
    labels[:2] = IGNORE_INDEX  # a prompt
    return ids[:-1], labels


def build_pack(samples: list[list], family: str, multiple: int = 1) -> tuple[ReadPack, np.ndarray]:
    """A ReadPack of ``samples`` (each a parts list, see ``sample_ids``), each padded to a multiple of
    ``multiple`` with pad ids, and the images of each sample."""
    tokens, labels, bounds, real, images, counts = [], [], [0], [0], [], []
    for k, parts in enumerate(samples):
        ids, targets = sample_ids(parts, family, seed=k)
        extra = -len(ids) % multiple
        tokens.append(np.concatenate([ids, np.full(extra, PAD_ID)]))
        labels.append(np.concatenate([targets, np.full(extra, IGNORE_INDEX)]))
        bounds.append(bounds[-1] + len(ids) + extra)
        real.append(real[-1] + len(ids))
        own = [part for part in parts if isinstance(part, StoredImage)]
        images += own
        counts.append(len(own))
    runs = [image.tokens + 2 * (family == "native") for image in images]
    pack = ReadPack(
        cu_seqlens=np.array(bounds, dtype=np.int64),
        cu_seqlens_unpadded=np.array(real, dtype=np.int64),
        tokens=np.concatenate(tokens).astype(np.int64),
        labels=np.concatenate(labels).astype(np.int64),
        pixels=None,
        images=None,
        num_images=len(images),
        image_lengths=np.array(runs, dtype=np.int64),
        stored_images=images,
    )
    return pack, np.array(counts, dtype=np.int32)
