"""The native-resolution family's second reference, ``--image_reference qwen_vl_utils``: Qwen's own
``qwen-vl-utils`` (0.0.14), whose ``fetch_image`` resizes an image with PIL before the Hugging Face
processor (called with ``do_resize=False``). Its sizes, ``image_grid_thw`` and token counts equal the
package's on the committed grid of 25,281 sizes per setting (tests/golden/qwen_vl_utils/, made by running
it), and live where the package imports; its pixels equal ``fetch_image``'s bit for bit; the choice is a
command-line flag, recorded in the output's meta and in the sample store's fingerprint, and refused by
the families that have no such choice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from neva_pack.cli import main
from neva_pack.config import SampleConfig
from neva_pack.core import ConfigError
from neva_pack.families import FamilyOptions, dynamic_processor, model_family, processor_from_record, resolve_encoder
from neva_pack.reading import PackedSeqDataset
from tests.dynamic_references import stand_in_tokenizer
from tests.family_runs import write_mixed_records

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "qwen_vl_utils" / "sizes.npz"
QWEN3 = "Qwen/Qwen3-VL-8B-Instruct"
QWEN2_5 = "Qwen/Qwen2.5-VL-7B-Instruct"
CONFIGS = {  # golden config -> (encoder, --min_pixels, --max_pixels) as given on the command line
    "qwen3_vl": (QWEN3, None, None),
    "qwen2_5_vl": (QWEN2_5, None, None),
    "qwen3_vl_bounds": (QWEN3, 200_000, 1_003_520),
    "qwen2_vl_small": (QWEN2_5, 1_000, 100_000),
}


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


def reference(encoder: str, min_pixels=None, max_pixels=None):
    return dynamic_processor(resolve_encoder(encoder), arithmetic="qwen_vl_utils", min_pixels=min_pixels, max_pixels=max_pixels)


def pattern(width: int, height: int) -> np.ndarray:
    """The golden images' pixels: (height, width, 3) uint8, a pattern of both coordinates in every channel."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 7 + y * 3) % 256, (x * x + 5 * y) % 256, (x * y + 11) % 256], axis=-1).astype(np.uint8)


# ---------------------------------------------------------------- sizes, grids and token counts


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sizes_grids_and_tokens_equal_qwen_vl_utils_on_the_golden_grid(golden, config):
    encoder, low, high = CONFIGS[config]
    ours = reference(encoder, low, high)
    patch, expected_low, expected_high = golden[f"{config}_settings"].tolist()
    s = ours.settings
    assert (s.patch_size, s.merge_size, s.min_pixels, s.max_pixels, s.resample) == (patch, 2, expected_low, expected_high, 3)
    factor, sides, grid = 2 * patch, golden["sides"].tolist(), golden[config]
    compared = refused = 0
    for i, height in enumerate(sides):
        for j, width in enumerate(sides):
            rows, columns = grid[i, j].tolist()
            if rows <= 0 or columns <= 0:  # the reference refuses the aspect ratio, or PIL its side of 0
                with pytest.raises(ValueError):
                    ours.tokens_for_size(width, height)
                refused += 1
                continue
            assert ours.resized_size(width, height) == (rows * factor, columns * factor), (width, height)
            assert ours.grid_thw(width, height) == (1, 2 * rows, 2 * columns)
            assert ours.tokens_for_size(width, height) == rows * columns
            compared += 1
    assert compared >= 20_000 and compared + refused == len(sides) ** 2


def test_the_references_part_where_the_package_says_they_do():
    """Small images: the processor scales them up to its 256² minimum, qwen-vl-utils to 4 tokens; a side
    rounded to 0 is one factor for qwen-vl-utils; large ones agree while under both maxima."""
    hf, qvu = dynamic_processor(resolve_encoder(QWEN3)), reference(QWEN3)
    assert hf.settings.reference == "transformers" and hf.options() == {"arithmetic": "transformers", "min_pixels": 65536, "max_pixels": 16777216}
    assert qvu.options() == {"arithmetic": "qwen_vl_utils", "min_pixels": 4096, "max_pixels": 16777216}
    assert (hf.resized_size(120, 90), hf.tokens_for_size(120, 90)) == ((224, 320), 70)
    assert (qvu.resized_size(120, 90), qvu.tokens_for_size(120, 90)) == ((96, 128), 12)
    assert qvu.resized_size(200, 10) == (32, 192)  # the processor rounds 10 to 0 and scales up: (64, 1152)
    assert hf.resized_size(200, 10) == (64, 1152)
    assert hf.tokens_for_size(1920, 1080) == qvu.tokens_for_size(1920, 1080) == 2040


# ---------------------------------------------------------------- pixels


def test_stored_pixels_equal_fetch_image_bit_for_bit(golden):
    cases = sorted(key for key in golden if key.startswith("pixels_") and key.endswith("_case"))
    assert len(cases) == 4
    for key in cases:
        patch, width, height, high = golden[key].tolist()
        ours = reference(QWEN3 if patch == 16 else QWEN2_5, max_pixels=high or None)
        stored = ours.to_uint8(Image.fromarray(pattern(width, height), "RGB"))
        expected = golden[key.removesuffix("_case")]
        assert stored.parts[0].shape == (3, *expected.shape[:2]) and stored.size == (width, height)
        assert np.array_equal(stored.parts[0].transpose(1, 2, 0), expected), key
        assert stored.tokens == expected.shape[0] * expected.shape[1] // (2 * patch) ** 2


@pytest.mark.slow
def test_live_against_the_installed_package():
    """Where qwen-vl-utils imports (it needs torchvision), the same on random sizes and random images, its
    ``fetch_image`` with its own defaults and with a message's bounds."""
    vision = pytest.importorskip("qwen_vl_utils.vision_process")
    rng = np.random.default_rng(29)
    for encoder, patch in ((QWEN3, 16), (QWEN2_5, 14)):
        for bounds in ({}, {"min_pixels": 50_000, "max_pixels": 400_000}):
            ours = reference(encoder, bounds.get("min_pixels"), bounds.get("max_pixels"))
            for _ in range(2000):
                width, height = (int(v) for v in np.exp(rng.uniform(0, np.log(6000), 2)).round() + 1)
                factor = 2 * patch
                low = bounds.get("min_pixels", vision.IMAGE_MIN_TOKEN_NUM * factor**2)
                high = bounds.get("max_pixels", vision.IMAGE_MAX_TOKEN_NUM * factor**2)
                try:
                    expected = vision.smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
                except ValueError:
                    with pytest.raises(ValueError):
                        ours.resized_size(width, height)
                    continue
                assert ours.resized_size(width, height) == expected, (width, height)
            for width, height in ((1, 1), (33, 700), (640, 480), (900, 37), (75, 75)):
                image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
                expected = np.asarray(vision.fetch_image({"image": image, **bounds}, image_patch_size=patch))
                assert np.array_equal(ours.to_uint8(image).parts[0].transpose(1, 2, 0), expected), (encoder, width, height)


@pytest.mark.slow
def test_megatron_bridge_is_fetch_image_then_the_torchvision_processor_live():
    """``--image_reference megatron_bridge``: Megatron Bridge's collate hands its processor what qwen-vl-utils'
    ``fetch_image`` made of an image without ``image_patch_size`` (a multiple of 28 within its own bounds),
    and the processor (transformers' torchvision backend, the one Bridge loads) resizes that again to its
    own factor within Bridge's ``min_pixels`` / ``max_pixels`` (the flags over its defaults). Grids, tokens
    and pixels equal that chain, live, on random images both smaller and larger than the bounds (the
    whole task encoder: tests/integrations/test_megatron_bridge.py)."""
    vision = pytest.importorskip("qwen_vl_utils.vision_process")
    transformers = pytest.importorskip("transformers")
    processor_class = transformers.Qwen2VLImageProcessor
    if not any(base.__name__ == "TorchvisionBackend" for base in processor_class.__mro__):
        processor_class = transformers.Qwen2VLImageProcessorFast  # transformers 4's name of the torchvision one
    rng = np.random.default_rng(31)
    for encoder, bounds in ((QWEN3, None), (QWEN2_5, None), (QWEN3, (100_000, 300_000))):
        ours = dynamic_processor(resolve_encoder(encoder), arithmetic="megatron_bridge", **dict(zip(("min_pixels", "max_pixels"), bounds or ())))
        low, high = bounds or (200_704, 1_003_520)
        assert ours.options() == {"arithmetic": "megatron_bridge", "min_pixels": low, "max_pixels": high}
        settings = resolve_encoder(encoder).preprocessor_config
        theirs = processor_class(size={"shortest_edge": low, "longest_edge": high}, patch_size=ours.settings.patch_size,
                                 **{key: settings[key] for key in ("image_mean", "image_std") if key in settings})  # fmt: skip
        for width, height in ((480, 320), (451, 300), (33, 700), (1500, 900), (97, 61)):
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
            expected = theirs(images=[vision.fetch_image({"image": image})], return_tensors="np")
            mine = ours.model_inputs([ours.to_uint8(image)])
            assert mine["image_grid_thw"].tolist() == expected["image_grid_thw"].tolist() == [list(ours.grid_thw(width, height))]
            assert np.array_equal(mine["pixel_values"], expected["pixel_values"]), (encoder, width, height)
            assert ours.tokens_for_size(width, height) == int(np.prod(expected["image_grid_thw"][0])) // 4


# ---------------------------------------------------------------- the flag


SIZES = [(120, 90), (300, 200), (37, 53), (640, 480)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qvu_run")
    tokenizer = stand_in_tokenizer(tmp_path_factory.mktemp("qvu_tok"), "qwen")
    write_mixed_records(folder, SIZES)
    out = folder / "out"
    argv = ["preprocess", "--quiet", "--data_path", str(folder / "data.json"), "--image_folder", str(folder),
            "--tokenizer_path", str(tokenizer), "--hf_vision_encoder", QWEN3, "--conv_template", "qwen2_vl",
            "--image_reference", "qwen_vl_utils", "--output_format", "compact", "--max_seq_length", "600",
            "--output_dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    return folder, tokenizer, out


def test_a_run_follows_the_reference_and_records_it(run):
    _, _, out = run
    dataset = PackedSeqDataset(out)
    record = dataset.meta.image_processor
    assert (record["family"], record["arithmetic"], record["min_pixels"], record["max_pixels"]) == ("native", "qwen_vl_utils", 4096, 16777216)
    rebuilt = processor_from_record(record)
    assert rebuilt.settings == reference(QWEN3).settings
    grids = {tuple(row) for p in range(len(dataset)) for row in dataset[p]["image_grid_thw"].reshape(-1, 3).tolist()}
    expected = {reference(QWEN3).grid_thw(w, h) for w, h in SIZES}
    assert grids == expected and (1, 6, 8) in grids  # 120 x 90: 96 x 128 (the processor: 224 x 320)


def test_the_reference_is_in_the_sample_fingerprint_only_when_given(run):
    folder, tokenizer, _ = run
    common = {"data_path": folder / "data.json", "tokenizer_path": tokenizer, "hf_vision_encoder": QWEN3}
    plain = SampleConfig(**common).fingerprint(600)
    chosen = SampleConfig(**common, image_reference="qwen_vl_utils").fingerprint(600)
    assert "image_reference" not in plain and chosen["image_reference"] == "qwen_vl_utils"
    with pytest.raises(ConfigError, match="--image_reference"):
        SampleConfig(**common, image_reference="pil")


@pytest.mark.parametrize("encoder, reference_name, says", [
    ("google/gemma-4-E4B-it", "qwen_vl_utils", "Hugging Face processor only"),
    ("openai/clip-vit-large-patch14-336", "transformers", "Hugging Face processor only"),
    (QWEN3, "internvl", "transformers, qwen_vl_utils"),
    ("OpenGVLab/InternVL3_5-8B-HF", "qwen_vl_utils", "transformers, internvl"),
])  # fmt: skip
def test_a_family_without_the_reference_refuses_it_in_one_line(encoder, reference_name, says):
    with pytest.raises(ConfigError) as error:
        model_family(resolve_encoder(encoder), FamilyOptions(reference=reference_name))
    assert says in str(error.value) and "\n" not in str(error.value) and f"--image_reference {reference_name}" in str(error.value)


def test_internvl_takes_its_own_reference_from_the_flag():
    family = model_family(resolve_encoder("OpenGVLab/InternVL3_5-8B-HF"), FamilyOptions(reference="internvl"))
    assert family.options() == {"arithmetic": "internvl"}
    assert model_family(resolve_encoder("OpenGVLab/InternVL3_5-8B-HF")).options() == {"arithmetic": "transformers"}


def test_the_package_bounds_replace_the_encoders_not_the_flags():
    """qwen-vl-utils reads no preprocessor_config: the encoder's 65,536 minimum does not refuse a smaller
    --max_pixels (only the package's own 4,096 does), and the flags stand for a message's bounds."""
    assert reference(QWEN3, max_pixels=50_000).options() == {"arithmetic": "qwen_vl_utils", "min_pixels": 4096, "max_pixels": 50_000}
    with pytest.raises(ConfigError, match="need 0 < min <= max"):
        reference(QWEN3, max_pixels=4000)
    json.dumps(reference(QWEN2_5).options())  # JSON values, as a meta records them
