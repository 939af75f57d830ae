"""Seeded LLaVA-style workloads over real photos, for the pipeline benchmark and the byte-identity tests.

    image_workload(dir, records)  records.json + images/: the sample_data photos and the scikit-image
                                  wheel's (RGB, L, RGBA, P/animated GIF; 14x25 to 1411x1411, aspect
                                  up to 2.6), ~80% of the records with one image, ~5% with two,
                                  the rest text-only, 1-3 turns of generated text (some non-ASCII)
    text_workload(path, records)  text-only records: 1-4 turns, mix665k-like sizes (~1.4 KB); with
                                  vocabulary=N, words drawn from N compound words with Zipf weights
                                  (like natural text: most words rare) instead of ~70 common ones

Everything is a pure function of the record count and the seed, so a test can pin the bytes of a
run over it.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_IMAGES = ROOT / "sample_data" / "images"
SKIMAGE_IMAGES = (
    "astronaut.png",  # RGB 512x512
    "coffee.png",  # RGB 600x400
    "chelsea.png",  # RGB 451x300
    "rocket.jpg",  # RGB JPEG 640x427
    "hubble_deep_field.jpg",  # RGB JPEG 1000x872 with an ICC profile
    "retina.jpg",  # RGB JPEG 1411x1411
    "camera.png",  # L 512x512
    "text.png",  # L 448x172 (aspect 2.6)
    "logo.png",  # RGBA
    "horse.png",  # RGBA, mostly transparent
    "no_time_for_that_tiny.gif",  # P, animated, 14x25
    "motorcycle_left.png",  # RGB 741x500
)
WORDS = (
    "the a picture shows image cat coffee rocket galaxy person table light colour blue green red large small "
    "near far left right under over because while there is are was were has have what why how which describe "
    "explain count answer question detail background foreground pack sequence token model train café naïve — "
    "déjà µm 10° ½"
).split()


def image_files() -> list[Path]:
    """The real photos a workload draws from: sample_data's, plus scikit-image's when installed."""
    files = sorted(SAMPLE_IMAGES.iterdir())
    try:
        import skimage
    except ImportError:
        return files
    data = Path(skimage.__file__).parent / "data"
    return files + [data / name for name in SKIMAGE_IMAGES if (data / name).is_file()]


def _sentence(rng: random.Random, words: int, vocabulary=None) -> str:
    if vocabulary is None:
        chosen = [rng.choice(WORDS) for _ in range(words)]
    else:
        chosen = rng.choices(vocabulary[0], cum_weights=vocabulary[1], k=words)
    return " ".join(chosen).capitalize() + "."


def _answer(rng: random.Random, sentences: tuple[int, int], vocabulary=None) -> str:
    return " ".join(_sentence(rng, rng.randint(6, 18), vocabulary) for _ in range(rng.randint(*sentences)))


def zipf_vocabulary(size: int, seed: int = 0) -> tuple[list[str], list[float]]:
    """``size`` distinct words made of one to three of ``WORDS`` and an optional suffix
    ("coffeetable", "galaxylighted"), and their cumulative Zipf weights (1 / rank): text whose
    words repeat as natural text's do (most of them rare), spelled from pieces a tokenizer knows."""
    rng = random.Random(seed)
    stems = [word for word in WORDS if word.isalpha()]
    suffixes = ("", "", "", "s", "ed", "ing", "er", "ly", ",")
    words, seen = [], set()
    while len(words) < size:
        word = "".join(rng.choice(stems) for _ in range(rng.choice((1, 1, 2, 3)))) + rng.choice(suffixes)
        if word not in seen:
            seen.add(word)
            words.append(word)
    total, cumulative = 0.0, []
    for rank in range(1, size + 1):
        total += 1.0 / rank
        cumulative.append(total)
    return words, cumulative


def image_workload(directory: Path, records: int, seed: int = 0) -> dict:
    """Write directory/records.json and directory/images/; return the paths for the CLI flags."""
    directory = Path(directory)
    images = directory / "images"
    images.mkdir(parents=True, exist_ok=True)
    names = []
    for path in image_files():
        shutil.copyfile(path, images / path.name)
        names.append(path.name)
    rng = random.Random(seed)
    def pick(rng: random.Random) -> list[str]:
        roll = rng.random()
        return [] if roll < 0.15 else [rng.choice(names)] if roll < 0.95 else rng.sample(names, 2)

    data = _image_records(directory / "records.json", records, rng, pick, "img", (1, 5))
    return {"data_path": data, "image_folder": images}


def text_workload(path: Path, records: int, seed: int = 0, vocabulary: int | None = None) -> Path:
    """Write a JSON list of text-only records (mix665k's text-only part is ShareGPT-like: long,
    multi-turn), with words from ``zipf_vocabulary(vocabulary)`` when given."""
    rng = random.Random(seed)
    words = None if vocabulary is None else zipf_vocabulary(vocabulary, seed)
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(records):
            turns = []
            for _ in range(rng.choice((1, 2, 3, 4))):
                turns.append({"from": "human", "value": _sentence(rng, rng.randint(6, 24), words)})
                turns.append({"from": "gpt", "value": _answer(rng, (2, 8), words)})
            f.write(json.dumps({"id": f"txt-{i}", "conversations": turns}, ensure_ascii=False))
            f.write(",\n" if i + 1 < records else "\n")
        f.write("]\n")
    return path


def small_image_workload(directory: Path, records: int, images: int = 4000, image_share: float = 0.65, seed: int = 0) -> dict:
    """Write directory/records.json and directory/images/ (``images`` distinct small JPEGs, 64 to
    320 pixels a side, smooth gradients plus noise so they compress like photos): a scale workload
    where text dominates and images are many and cheap: ``image_share`` of the records with images
    (one of them in twelve with two), 1-3 turns. Returns the paths for the CLI flags."""
    import numpy as np
    from PIL import Image

    directory = Path(directory)
    folder = directory / "images"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pixels = np.random.default_rng(seed)
    names = []
    for i in range(images):
        height, width = rng.randint(64, 320), rng.randint(64, 320)
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], axis=-1)
        noisy = np.clip(base + pixels.integers(-12, 13, size=base.shape), 0, 255).astype(np.uint8)
        name = f"{i:06d}.jpg"
        Image.fromarray(noisy).save(folder / name, quality=85)
        names.append(name)
    def pick(rng: random.Random) -> list[str]:
        roll = rng.random()
        two = roll >= 1 - image_share / 12
        return [] if roll < 1 - image_share else rng.sample(names, 2) if two else [rng.choice(names)]

    data = _image_records(directory / "records.json", records, rng, pick, "s", (1, 4))
    return {"data_path": data, "image_folder": folder}


def _image_records(data: Path, records: int, rng: random.Random, pick, prefix: str, answer_sentences: tuple[int, int]) -> Path:
    """Write ``records`` LLaVA-style records to ``data``: ``pick(rng)`` chooses each record's images
    (their <image> lines open its first question), then 1-3 turns of generated text."""
    with open(data, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(records):
            record_images = pick(rng)
            turns = []
            for t in range(rng.choice((1, 1, 2, 3))):
                question = _sentence(rng, rng.randint(5, 16))
                if t == 0 and record_images:
                    question = "".join("<image>\n" for _ in record_images) + question
                turns.append({"from": "human", "value": question})
                turns.append({"from": "gpt", "value": _answer(rng, answer_sentences)})
            record = {"id": f"{prefix}-{i}", "conversations": turns}
            if record_images:
                record["image"] = record_images[0] if len(record_images) == 1 else record_images
            f.write(json.dumps(record, ensure_ascii=False))
            f.write(",\n" if i + 1 < records else "\n")
        f.write("]\n")
    return data
