"""The records a family's end-to-end tests preprocess: one workload for every family, so that each
family's run covers the same cases (text-only records, one image of several sizes, a record of two
images with a system prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def write_mixed_records(folder: Path, sizes, *, pair=("i3.png", "i2.png"), pair_question: str = "<image> and <image>?",
                        picture=None) -> Path:  # fmt: skip
    """``folder``/i<k>.png of each (width, height) of ``sizes`` and ``folder``/data.json: 9 records (every
    third text-only, the others one image in turn) and a record of the two images ``pair`` with its own
    system prompt, asking ``pair_question``. ``picture(k, width, height)`` draws image k (default: random
    pixels from one seeded generator, image after image). Returns the data file."""
    rng = np.random.default_rng(0)
    for k, (width, height) in enumerate(sizes):
        image = picture(k, width, height) if picture else Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        image.save(folder / f"i{k}.png")
    records = []
    for k in range(9):
        turns = [{"from": "human", "value": "<image>\nWhat is this?" if k % 3 else "Hello there"},
                 {"from": "gpt", "value": "A picture of things " * (k + 1)}]  # fmt: skip
        records.append({"id": str(k), "conversations": turns, **({"image": f"i{k % len(sizes)}.png"} if k % 3 else {})})
    records.append({"id": "two", "image": list(pair), "system": "Be brief.",
                    "conversations": [{"from": "human", "value": pair_question},
                                      {"from": "gpt", "value": "two"}]})  # fmt: skip
    data = folder / "data.json"
    data.write_text(json.dumps(records))
    return data
