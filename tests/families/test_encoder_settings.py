"""A checkpoint directory's encoder settings are checked key by key: every key of every shipped
settings file (families/shipped), given a bad value in a local directory, is refused in one line
naming the file (or directory) and the key, before anything is encoded; or, where the value is one
the family can honour (or a key it does not read), the family counts, stores and normalises an
image with finite values. The harness for runs: tests/hostile_inputs.py."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from neva_pack.core import ConfigError
from neva_pack.families import FamilyOptions, model_family, resolve_encoder
from neva_pack.files import packed_prefix, skipped_path
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import GOOD, images, run_on, write_data  # noqa: F401 (images: the fixture)

BAD_VALUES = (
    0, -1, -(2**40), 2**62, 10**30, 1e300, 1e-300, 0.5, 2.0, 3.7, float("nan"), float("inf"), -float("inf"), "12", "", None, True,
    [], {}, [1, 2, 3], [[1, 2, 3]], [[0, 0]], [0.5, 0.5], [1e-300] * 3, [1e300] * 3, [float("nan")] * 3, {"height": 0},
    {"height": 10**9, "width": 10**9}, {"shortest_edge": -5}, {"longest_edge": 300}, "anyres_max_0",
)  # fmt: skip
"""Zero, negative, absurd, fractional, non-finite, strings where numbers go, wrong shapes: what a
hostile or damaged settings file holds. JSON has no NaN or infinity, but Python's reader takes them."""


def _shipped() -> list[dict]:
    """The shipped settings files, one of each distinct content (InternVL's six sizes share one)."""
    folder = importlib.resources.files("neva_pack.families") / "shipped"
    distinct = {}
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.name.endswith(".json"):
            data = json.loads(path.read_text())
            content = json.dumps({k: v for k, v in data.items() if k != "name"}, sort_keys=True)
            distinct.setdefault(content, data)
    return list(distinct.values())


SHIPPED = _shipped()
FILES = ("preprocessor_config.json", "processor_config.json")
CASES = [(data["name"], file, key) for data in SHIPPED
         for file, keys in zip(FILES, (data["preprocessor_config"], data.get("model_config", {}))) for key in keys]  # fmt: skip


def checkpoint_directory(folder: Path, data: dict, file: str | None = None, key: str | None = None, value=None) -> Path:
    """A local checkpoint directory holding a shipped encoder's settings (the model's numbers in its
    processor_config.json and config.json), with ``file``'s ``key`` set to ``value``."""
    folder.mkdir(parents=True, exist_ok=True)
    settings, model = dict(data["preprocessor_config"]), dict(data.get("model_config", {}))
    if file is not None:
        (settings if file == FILES[0] else model)[key] = value
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    (folder / "processor_config.json").write_text(json.dumps(model))
    image_size = data.get("model_config", {}).get("image_size")
    vision = {"patch_size": data["patch_size"], **({"image_size": image_size} if image_size else {})}
    (folder / "config.json").write_text(json.dumps({"vision_config": vision}))
    return folder


PHOTO = Image.open(SAMPLE_DATA / "images" / "chelsea.jpg").convert("RGB")


_WORKED = set()


def works(family) -> None:
    """The family counts a few sizes, stores a photo and gives the model finite pixels (once per
    distinct family: a key the family does not read leaves it as it was)."""
    made = repr((family.family, getattr(family, "settings", None), family.stored_shape, family.model_normalisation))
    if made in _WORKED:
        return
    for width, height in ((451, 300), (1, 1), (4000, 30), (30, 4000)):
        try:
            tokens = family.tokens_for_size(width, height)
        except ValueError:  # an aspect ratio the reference refuses: that record's skip
            continue
        assert isinstance(tokens, int) and tokens > 0
    stored = family.to_uint8(PHOTO)
    inputs = family.model_inputs([stored] if family.own_size else np.asarray(stored)[None])
    for key, value in inputs.items():
        assert value.dtype.kind != "f" or np.isfinite(value).all(), key
    assert np.isfinite(family.model_normalisation.lut()).all()
    _WORKED.add(made)


@pytest.mark.parametrize(("encoder", "file", "key"), CASES, ids=[f"{e}:{f.split('_')[0]}:{k}" for e, f, k in CASES])
def test_every_key_of_every_shipped_settings_file_is_refused_in_one_line_or_honoured(tmp_path, encoder, file, key):
    data = next(d for d in SHIPPED if d["name"] == encoder)
    for n, value in enumerate(BAD_VALUES):
        directory = checkpoint_directory(tmp_path / str(n), data, file, key, value)
        try:
            family = model_family(resolve_encoder(str(directory)), FamilyOptions())
        except ConfigError as refused:
            message = str(refused)
            assert "\n" not in message and str(directory) in message, message
            assert key in message, (value, message)
            continue
        works(family)


@pytest.mark.parametrize("data", SHIPPED, ids=[d["name"] for d in SHIPPED])
def test_every_shipped_settings_file_is_accepted_from_a_directory(tmp_path, data):
    directory = checkpoint_directory(tmp_path, data)
    local = resolve_encoder(str(directory))
    works(model_family(local, FamilyOptions()))
    assert local.preprocessor_config == data["preprocessor_config"]


REFUSED = {
    "merge size 0": ("Qwen/Qwen2-VL-7B-Instruct", "merge_size", 0, "merge_size 0: expected an integer from 1 to 8"),
    "a pinpoint of three numbers": ("llava-hf/llava-v1.6-mistral-7b-hf", "image_grid_pinpoints", [[336, 672, 3]],
                                    "image_grid_pinpoints [[336, 672, 3]]: expected a list of 1 to 1024 [height, width] pairs"),
    "std 1e-300": ("openai/clip-vit-large-patch14-336", "image_std", [1e-300] * 3, "image_std [1e-300, 1e-300, 1e-300]: expected a list"),
    "rescale 1e300": ("google/gemma-4-E2B-it", "rescale_factor", 1e300, "rescale_factor 1e+300: expected a number from 1e-06 to 1"),
    "a negative token count": ("llava-hf/llava-onevision-qwen2-7b-ov-hf", "num_image_tokens", -729, "num_image_tokens -729: expected a square integer"),
    "max_patches 2**62": ("OpenGVLab/InternVL3_5-1B-HF", "max_patches", 2**62, "max_patches 4611686018427387904: expected an integer from 1 to 64"),
    "a string budget": ("google/gemma-4-E2B-it", "max_soft_tokens", "280", "max_soft_tokens '280': expected one of 70, 140, 280, 560, 1120, got str"),
    "NaN mean": ("google/siglip-so400m-patch14-384", "image_mean", [float("nan")] * 3, "image_mean [nan, nan, nan]: expected a list of 3 numbers"),
    "a crop of a billion pixels a side": ("google/siglip-base-patch16-224", "size", {"height": 10**9, "width": 10**9},
                                          "size {'height': 1000000000, 'width': 1000000000}: expected"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_encoder_setting_refuses_the_run_in_one_line_before_any_record(tmp_path, capsys, images, case):
    encoder, key, value, says = REFUSED[case]
    data = next(d for d in _all_shipped() if d["name"] == encoder)
    file = FILES[0] if key in data["preprocessor_config"] else FILES[1]
    directory = checkpoint_directory(tmp_path / "encoder", data, file, key, value)
    records = write_data(tmp_path / "data.jsonl", GOOD, "jsonl")
    run = run_on(tmp_path, capsys, records, images, "--hf_vision_encoder", str(directory), "--output_format", "compact")
    assert run.code == 2 and run.err.count("\n") == 1 and "Traceback" not in run.err, run.err
    assert f"{directory / file}: {says}" in run.err
    assert not run.out.exists() or not skipped_path(run.out).exists()


def _all_shipped() -> list[dict]:
    folder = importlib.resources.files("neva_pack.families") / "shipped"
    return [json.loads(p.read_text()) for p in folder.iterdir() if p.name.endswith(".json")]


def test_the_extremes_a_settings_file_may_hold_publish_finite_pixels(tmp_path, capsys, images):
    """std at its least, mean and rescale at their most: every pixel the reader gives is finite."""
    from neva_pack.reading import PackedSeqDataset

    data = next(d for d in _all_shipped() if d["name"] == "openai/clip-vit-large-patch14-336")
    data = {**data, "preprocessor_config": {**data["preprocessor_config"], "image_std": [1e-3] * 3, "image_mean": [1.0, 0.0, 1.0],
                                            "rescale_factor": 1.0}}  # fmt: skip
    directory = checkpoint_directory(tmp_path / "encoder", data)
    records = write_data(tmp_path / "data.jsonl", GOOD, "jsonl")
    run = run_on(tmp_path, capsys, records, images, "--hf_vision_encoder", str(directory))
    assert run.code == 0, run.err
    packs = list(PackedSeqDataset(packed_prefix(run.out)))
    pixels = np.concatenate([pack["image"].numpy().reshape(-1) for pack in packs if int(pack["num_images"].sum())])
    assert pixels.size and np.isfinite(pixels).all()
    assert 100_000 < np.abs(pixels).max() <= 255_000  # at most (255 - 0) / 0.001
