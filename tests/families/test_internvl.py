"""InternVL 3.5, the Hugging Face port (``InternVLForConditionalGeneration``), through the public API: the
shipped settings resolve to the family; tile grids and token counts equal transformers' processor
(``GotOcr2ImageProcessorPil`` under ``InternVLProcessor``) on more than 20,000 sizes, and InternVL's own
``dynamic_preprocess`` (golden grids made with it, tests/golden/internvl/README.md) where that is chosen,
the ties where the two part named; pixels are bit-identical to the PIL processor over the image zoo; the
``internvl`` template gives the ids of the released chat template expanded by ``InternVLProcessor``; a
real run verifies as compact and energon, reads back, is refused by nemo and bridge in one line, and
plans from its input; and a tiny random ``InternVLForConditionalGeneration`` (float64) trained on packed
rows of that run through ``hf_collate`` gets the samples' one-by-one loss and gradients to 1e-9, while
rows whose positions do not restart, or whose images are swapped, move them far more.

Tokenizer: the stand-in tests/golden/dynamic/tokenizer.json with InternVL's ``<img>``, ``</img>``,
``<IMG_CONTEXT>`` and ``<video>`` added as special tokens (``internvl_tokenizer``): no InternVL tokenizer
is reachable offline."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.core import ConfigError
from neva_pack.families import ImageSource, dynamic_image_run, dynamic_processor, known_encoders, resolve_encoder, tokens_from_header
from neva_pack.files import paths
from neva_pack.formats import open_packed
from neva_pack.reading import PackedSeqDataset
from neva_pack.records import RawRecord
from neva_pack.samples import SampleBuilder
from neva_pack.text import load_template, load_tokenizer
from neva_pack.training import hf_collate
from tests.dynamic_models import TOLERANCE, TEXT, difference, loss_and_gradients, samples_alone
from tests.dynamic_references import STAND_IN_TOKENIZER
from tests.image_zoo import MPL, SKIMAGE, random_rgb, zoo_images
from tests.family_runs import write_mixed_records

SIZES_NAMES = ("1B", "2B", "4B", "8B", "14B", "38B")
ENCODERS = [f"OpenGVLab/InternVL3_5-{size}-HF" for size in SIZES_NAMES]
ENCODER = "OpenGVLab/InternVL3_5-8B-HF"
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "internvl"
SPECIALS = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
WRONG = 1e-6


def internvl_tokenizer(folder: Path) -> Path:
    """A tokenizer directory: the dynamic stand-in with InternVL's image specials added, EOS <|im_end|>."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(STAND_IN_TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return folder


def reference_image_processor(encoder_name: str = ENCODER, **overrides):
    """transformers' PIL image processor of the checkpoint's settings (what transformers maps internvl to)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    settings = {k: v for k, v in resolve_encoder(encoder_name).preprocessor_config.items()
                if k not in ("image_processor_type", "processor_class")}  # fmt: skip
    return GotOcr2ImageProcessorPil(**{**settings, **overrides})


def reference_processor(tokenizer_dir: Path, chat_template: str | None = None):
    """InternVLProcessor over the stand-in tokenizer. Its constructor insists on a video processor (torchvision,
    not installed) and on a tokenizer class with InternVL's attributes: the instance gets what its __init__
    sets, and its own __call__ does the work (expanding each <IMG_CONTEXT> to <img>, 256 per tile, </img>)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.internvl import InternVLProcessor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), eos_token="<|im_end|>")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    processor = InternVLProcessor.__new__(InternVLProcessor)
    processor.__dict__.update(
        image_processor=reference_image_processor(), tokenizer=tokenizer, video_processor=None, chat_template=chat_template,
        image_seq_length=resolve_encoder(ENCODER).model_config["image_seq_length"], start_image_token="<img>",
        end_image_token="</img>", start_image_token_id=ids["<img>"], end_image_token_id=ids["</img>"],
        image_token="<IMG_CONTEXT>", video_token="<video>", image_token_id=ids["<IMG_CONTEXT>"],
        multimodal_pattern=re.compile("(?P<image><IMG_CONTEXT>)|(?P<video><video>)"),
    )  # fmt: skip
    return processor


# ---------------------------------------------------------------- shipped settings


@pytest.mark.parametrize("name", ENCODERS)
def test_shipped_settings_resolve_to_the_family(name):
    encoder = resolve_encoder(name)
    assert (encoder.processor, encoder.family, encoder.patch_size) == ("got_ocr2", "internvl", 14)
    assert name in known_encoders("internvl")
    assert encoder.model_config == {"image_seq_length": 256}
    cfg = encoder.preprocessor_config
    assert cfg["size"] == {"height": 448, "width": 448} and (cfg["min_patches"], cfg["max_patches"]) == (1, 12)
    assert cfg["image_mean"] == [0.485, 0.456, 0.406] and cfg["image_std"] == [0.229, 0.224, 0.225]
    processor = dynamic_processor(encoder)
    s = processor.settings
    assert (s.tile, s.min_patches, s.max_patches, s.tokens_per_tile, s.patches_per_tile, s.resample) == (448, 1, 12, 256, 1024, 3)
    assert processor.options() == {"arithmetic": "transformers"}


def test_transformers_maps_internvl_to_the_processors_the_reference_uses():
    """What the exactness below is held against is what transformers itself builds for these checkpoints; its
    InternVLProcessor tiles whatever the preprocessor_config.json's crop_to_patches says (false in the files)."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.models.internvl import InternVLProcessor

    assert IMAGE_PROCESSOR_MAPPING_NAMES["internvl"]["pil"] == "GotOcr2ImageProcessorPil"
    assert PROCESSOR_MAPPING_NAMES["internvl"] == "InternVLProcessor"
    assert InternVLProcessor.images_kwargs == {"crop_to_patches": True}
    assert resolve_encoder(ENCODER).preprocessor_config["crop_to_patches"] is False


def test_a_local_checkpoint_directory_is_the_shipped_encoder(tmp_path):
    """preprocessor_config.json + processor_config.json (image_seq_length) + config.json, whose vision patch
    size transformers writes as [14, 14]."""
    shipped = resolve_encoder(ENCODER)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(shipped.preprocessor_config))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256, "processor_class": "InternVLProcessor"}))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": [14, 14], "image_size": [448, 448]}}))
    local = resolve_encoder(str(tmp_path))
    assert (local.family, local.patch_size, local.model_config) == ("internvl", 14, {"image_seq_length": 256})
    assert dynamic_processor(local).settings == dynamic_processor(shipped).settings
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": "256"}))
    with pytest.raises(ConfigError, match="processor_config.json: image_seq_length '256': expected an integer from 1 to"):
        resolve_encoder(str(tmp_path))


def test_layout_options_and_other_families_options_are_refused():
    encoder = resolve_encoder(ENCODER)
    with pytest.raises(ConfigError, match="--min_pixels / --max_pixels: .* is not a Qwen2-VL"):
        dynamic_processor(encoder, max_pixels=1000)
    with pytest.raises(ConfigError, match="arithmetic 'llava': choose one of transformers, internvl"):
        dynamic_processor(encoder, arithmetic="llava")


# ---------------------------------------------------------------- tile grids and token counts


def test_grids_and_counts_equal_the_processor_and_dynamic_preprocess_on_a_grid_of_sizes():
    """40,401 sizes (every side 1..100, coarser to 9,000, 448 k +- 1): the grid of get_optimal_tiled_canvas and
    the processor's patch count (x 256) for "transformers"; the golden grids of dynamic_preprocess for "internvl"
    (the two agree on every size with the released budget, 1..12)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    golden = np.load(GOLDEN / "dynamic_preprocess_grids.npz")
    sizes, expected_internvl = golden["sizes"], golden["grids_1_12"]
    assert len(sizes) >= 20_000
    encoder = resolve_encoder(ENCODER)
    ours, theirs = dynamic_processor(encoder), reference_image_processor()
    internvl = dynamic_processor(encoder, arithmetic="internvl")
    crop = {"crop_to_patches": True}
    for (width, height), grid_internvl in zip(sizes.tolist(), expected_internvl.tolist()):
        assert ours.grid(width, height) == tuple(get_optimal_tiled_canvas((height, width), (448, 448), 1, 12)), (width, height)
        assert ours.tokens_for_size(width, height) == 256 * theirs.get_number_of_image_patches(height, width, crop), (width, height)
        assert internvl.grid(width, height) == tuple(grid_internvl), (width, height)


@pytest.mark.parametrize("budget", [(1, 6), (4, 4), (5, 5), (8, 9), (9, 9)])
def test_other_budgets_follow_each_reference_where_they_part(budget):
    """Budgets without the 1 x 1 grid let two grids of one tile count tie on the closest ratio: transformers
    keeps its first, InternVL's set order another (every size 1..120 per side, golden for InternVL)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    low, high = budget
    golden = np.load(GOLDEN / "dynamic_preprocess_grids.npz")
    encoder = resolve_encoder(ENCODER)
    settings = {**encoder.preprocessor_config, "min_patches": low, "max_patches": high}
    encoder = type(encoder)(**{**{f: getattr(encoder, f) for f in encoder.__dataclass_fields__}, "preprocessor_config": settings})
    ours, internvl = dynamic_processor(encoder), dynamic_processor(encoder, arithmetic="internvl")
    parted = 0
    for (width, height), grid_internvl in zip(golden["small_sizes"].tolist(), golden[f"grids_{low}_{high}"].tolist()):
        hf = tuple(get_optimal_tiled_canvas((height, width), (448, 448), low, high))
        assert ours.grid(width, height) == hf and internvl.grid(width, height) == tuple(grid_internvl), (width, height)
        parted += hf != tuple(grid_internvl)
    assert parted == {(1, 6): 0, (4, 4): 24, (5, 5): 9, (8, 9): 31, (9, 9): 24}[budget]


@pytest.mark.parametrize("arithmetic", ["transformers", "internvl"])
def test_the_grid_index_is_the_references_loop_on_every_budget(arithmetic):
    """The family's bisection over distinct ratios gives what the references' loop over every grid gives
    (``closest_grid``), for every budget low..high within 1..12, on random sizes and the exact ties."""
    from neva_pack.families.internvl import candidate_grids, closest_grid

    rng = np.random.default_rng(0)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 5000, (400, 2))] + [(5, 2), (5, 1), (13, 5), (15, 4), (25, 4), (5, 4), (448, 448)]
    encoder = resolve_encoder(ENCODER)
    for low in range(1, 13):
        for high in range(max(low, 2), 13):
            settings = {**encoder.preprocessor_config, "min_patches": low, "max_patches": high}
            budget = type(encoder)(**{**{f: getattr(encoder, f) for f in encoder.__dataclass_fields__}, "preprocessor_config": settings})
            ours, grids = dynamic_processor(budget, arithmetic=arithmetic), candidate_grids(low, high, arithmetic)
            for width, height in sizes:
                assert ours.grid(width, height) == closest_grid(width, height, 448, grids), (low, high, width, height)


def test_ties_by_name():
    """Grids of one shape tie on the ratio: a later (larger) one wins only when the image's area is over half
    of it. 448 x 448 stays 1 tile; 900 x 900 (810,000 > 401,408) is 2 x 2 (+ thumbnail); 1344 x 1344 is 3 x 3;
    896 x 448 (401,408, not over 802,816) stays 2 x 1, 2000 x 1000 is 4 x 2. Between two shapes of one tile
    count (budget 4..4, a 5 x 2 image: 2 x 2 and 4 x 1 both 1.5 from 2.5) transformers keeps 2 x 2, InternVL's
    dynamic_preprocess 4 x 1; budget 8..9, a 5 x 1 image: 4 x 2 against 8 x 1."""
    p = dynamic_processor(resolve_encoder(ENCODER))
    assert (p.grid(448, 448), p.tiles(448, 448), p.tokens_for_size(448, 448)) == ((1, 1), 1, 256)
    assert (p.grid(900, 900), p.tiles(900, 900), p.tokens_for_size(900, 900)) == ((2, 2), 5, 1280)
    assert (p.grid(1344, 1344), p.tiles(1344, 1344)) == ((3, 3), 10)
    assert (p.grid(896, 448), p.grid(2000, 1000), p.tiles(2000, 1000)) == ((2, 1), (4, 2), 9)
    assert p.tokens_for_size(1, 1) == 256 and p.grid(10_000, 10) == (12, 1) and p.tokens_for_size(10_000, 10) == 13 * 256
    for (low, high), (width, height), transformers_grid, internvl_grid in (((4, 4), (5, 2), (2, 2), (4, 1)),
                                                                          ((8, 9), (5, 1), (4, 2), (8, 1))):  # fmt: skip
        encoder = resolve_encoder(ENCODER)
        settings = {**encoder.preprocessor_config, "min_patches": low, "max_patches": high}
        encoder = type(encoder)(**{**{f: getattr(encoder, f) for f in encoder.__dataclass_fields__}, "preprocessor_config": settings})
        assert dynamic_processor(encoder).grid(width, height) == transformers_grid
        assert dynamic_processor(encoder, arithmetic="internvl").grid(width, height) == internvl_grid


def test_the_count_from_the_header_is_the_decoded_images(tmp_path):
    ours = dynamic_processor(resolve_encoder(ENCODER))
    random_rgb(1333, 517).save(tmp_path / "a.png")
    assert tokens_from_header(tmp_path / "a.png", ours) == ours.to_uint8(random_rgb(1333, 517)).tokens == 256 * (5 * 2 + 1)


# ---------------------------------------------------------------- pixels


def test_pixels_are_bit_identical_to_the_processor_over_the_zoo():
    ours = dynamic_processor(resolve_encoder(ENCODER))
    theirs = reference_image_processor()
    images = zoo_images()
    stored = [ours.to_uint8(image) for image in images.values()]
    for (label, image), one in zip(images.items(), stored):
        expected = theirs(images=image, crop_to_patches=True, return_tensors="np")
        got = ours.model_inputs([one])
        assert got["pixel_values"].dtype == np.float32 and got["pixel_values"].shape[1:] == (3, 448, 448), label
        assert np.array_equal(got["pixel_values"], expected["pixel_values"]), label
        assert one.tokens == 256 * int(expected["num_patches"][0]), label
        assert all(part.dtype == np.uint8 for part in one.parts)
    together = theirs(images=list(images.values()), crop_to_patches=True, return_tensors="np")
    assert np.array_equal(ours.model_inputs(stored)["pixel_values"], together["pixel_values"])


@pytest.mark.parametrize("size", [(448, 448), (449, 448), (900, 900), (896, 448), (5000, 40), (40, 5000), (1, 1), (2, 1)])
def test_pixels_at_the_ties_and_the_extremes(size):
    ours = dynamic_processor(resolve_encoder(ENCODER))
    image = random_rgb(*size, seed=sum(size))
    expected = reference_image_processor()(images=image, crop_to_patches=True, return_tensors="np")
    assert np.array_equal(ours.model_inputs([ours.to_uint8(image)])["pixel_values"], expected["pixel_values"]), size


# ---------------------------------------------------------------- the template against the released chat template


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return internvl_tokenizer(tmp_path_factory.mktemp("internvl_tok"))


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("internvl_images")
    shutil.copy(MPL / "grace_hopper.jpg", folder / "grace_hopper.jpg")
    for name in ("coffee.png", "chelsea.png", "text.png"):
        shutil.copy(SKIMAGE / name, folder / name)
    for width, height in ((99, 88), (1000, 60)):
        random_rgb(width, height, seed=width).save(folder / f"r{width}x{height}.png")
    return folder


def messages_of(record: dict) -> list[dict]:
    """A LLaVA record as chat messages: each "<image>\\n" an image item (the chat template writes the newline
    after it), the text around it text items."""
    messages = [{"role": "system", "content": record["system"]}] if "system" in record else []
    for turn in record["conversations"]:
        if turn["from"] == "gpt":
            messages.append({"role": "assistant", "content": turn["value"]})
            continue
        content = []
        for k, text in enumerate(turn["value"].split("<image>\n")):
            if k:
                content.append({"type": "image"})
            if text:
                content.append({"type": "text", "text": text})
        messages.append({"role": "user", "content": content})
    return messages


def conversation(*turns, images=(), system=None) -> dict:
    data = {"id": "r", "conversations": [{"from": "gpt" if k % 2 else "human", "value": t} for k, t in enumerate(turns)]}
    if images:
        data["image"] = list(images)
    if system is not None:
        data["system"] = system
    return data


CONVERSATIONS = {
    "hopper": conversation("<image>\nWho is this?", "Grace Hopper.", images=["grace_hopper.jpg"]),
    "two_rounds": conversation("<image>\n<image>\nCompare.", "A cup and a cat.", "And <image>\nthis?", "Some text.",
                               images=["coffee.png", "chelsea.png", "text.png"]),  # fmt: skip
    "odd_sizes": conversation("Odd: <image>\nand <image>\n", "Small and wide.", images=["r99x88.png", "r1000x60.png"]),
    "text_only": conversation("No image here.", "Then text only.", "Sure?", "Yes."),
    "record_system": conversation("<image>\nWhat animal?", "A cat.", images=["chelsea.png"], system="Answer in three words."),
}


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_samples_are_the_released_chat_templates_ids(tokenizer_dir, image_folder, case):
    record = CONVERSATIONS[case]
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = resolve_encoder(ENCODER)
    builder = SampleBuilder(
        tokenizer=tokenizer, template=load_template("internvl"), image_source=ImageSource(image_folder),
        preprocessor=dynamic_processor(encoder), image_run=dynamic_image_run(tokenizer, encoder.family), max_seq_length=100_000,
    )  # fmt: skip
    sample = builder.build(RawRecord(index=0, value=record))
    reference = reference_processor(tokenizer_dir, (GOLDEN / "chat_template.jinja").read_text())
    text = reference.tokenizer.apply_chat_template(messages_of(record), chat_template=reference.chat_template, tokenize=False)
    assert text.startswith("<|im_start|>system\n") == ("system" in record)  # no default system block
    pictures = [Image.open(image_folder / name).convert("RGB") for name in record.get("image", [])]
    out = reference(text=[text], images=[pictures] if pictures else None)
    expected = np.asarray(out["input_ids"][0], dtype=np.int64)
    np.testing.assert_array_equal(np.concatenate([sample.tokens, sample.labels[-1:]]).astype(np.int64), expected)
    opener = [tokenizer.token_to_id("<|im_start|>"), *tokenizer.encode("assistant\n").ids.tolist()]
    closer = [tokenizer.token_to_id("<|im_end|>"), *tokenizer.encode("\n").ids.tolist()]
    trained = np.zeros(len(expected), dtype=bool)
    for start in range(len(expected) - len(opener)):
        if expected[start : start + len(opener)].tolist() == opener:
            end = start + len(opener)
            while expected[end : end + len(closer)].tolist() != closer:
                end += 1
            trained[start + len(opener) : end + len(closer)] = True
    np.testing.assert_array_equal(sample.labels, np.where(trained[1:], expected[1:], -1))
    if pictures:
        processed = reference.image_processor(images=pictures, crop_to_patches=True, return_tensors="np")
        np.testing.assert_array_equal(sample.image_tokens, 256 * np.asarray(processed["num_patches"]) + 2)


# ---------------------------------------------------------------- a real run, its formats, and the training proof

RUN_SIZES = [(120, 90), (600, 200), (60, 400), (512, 288), (900, 900)]


def run_records(folder: Path) -> Path:
    """The families' mixed records over RUN_SIZES, the pair's images each followed by a newline as InternVL's prompts write them."""
    return write_mixed_records(folder, RUN_SIZES, pair=("i3.png", "i0.png"), pair_question="<image>\n and <image>\n?")


def tiny_checkpoint(directory: Path, vocab_size: int, image_id: int):
    """A tiny randomly initialised InternVLForConditionalGeneration (float64, seeded): 448 px tiles of 56 px
    patches (8 x 8, pixel-shuffled by 0.5: 16 positions a tile), saved with the shipped preprocessor_config.json
    and a processor_config.json of image_seq_length 16, a checkpoint whose --hf_vision_encoder counts its tokens."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    torch.manual_seed(0)
    config = InternVLConfig(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": [448, 448], "patch_size": [56, 56]},  # fmt: skip
        text_config={"model_type": "qwen2", **TEXT, "vocab_size": vocab_size},
        image_token_id=image_id, downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default",
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    config.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(resolve_encoder(ENCODER).preprocessor_config))
    (directory / "processor_config.json").write_text(json.dumps({"image_seq_length": 16, "processor_class": "InternVLProcessor"}))
    return InternVLForConditionalGeneration(config).double()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    """compact and energon runs with the tiny checkpoint's settings (16 positions a tile), the internvl template
    and the stand-in tokenizer: records of 0, 1 and 2 images of 1 to 5 tiles."""
    folder = tmp_path_factory.mktemp("internvl_run")
    data = run_records(folder)
    tokenizer = load_tokenizer(tokenizer_dir)
    checkpoint = folder / "checkpoint"
    checkpoint.mkdir()
    model = tiny_checkpoint(checkpoint, tokenizer.vocab_size, tokenizer.token_to_id("<IMG_CONTEXT>"))
    flags = ["--data_path", str(data), "--image_folder", str(folder), "--tokenizer_path", str(tokenizer_dir),
             "--hf_vision_encoder", str(checkpoint), "--conv_template", "internvl", "--max_seq_length", "300"]  # fmt: skip
    outs = {}
    for output_format in ("compact", "energon"):
        outs[output_format] = folder / output_format
        assert main(["preprocess", "--quiet", *flags, "--output_format", output_format, "--output_dir", str(outs[output_format])]) == 0
    return outs, flags, model, tokenizer.token_to_id("<IMG_CONTEXT>")


def test_the_runs_verify_and_read_back(runs):
    outs, _, _, image = runs
    for output_format, out in outs.items():
        assert not verify(paths.packed_prefix(out), progress=False).problems, output_format
        dataset = PackedSeqDataset(out)
        assert dataset.meta.image_processor["family"] == "internvl" and dataset.meta.image_processor["arithmetic"] == "transformers"
        tiles = 0
        for p in range(len(dataset)):
            item = dataset[p]
            assert item["pixel_values"].dtype == torch.float32 and tuple(item["pixel_values"].shape[1:]) == (3, 448, 448)
            assert int((item["tokens"] == image).sum()) == 16 * len(item["pixel_values"]) * bool(int(item["num_images"].sum()))
            assert torch.equal(item["position_ids"], torch.cat([torch.arange(b - a) for a, b in
                                                                zip(item["cu_seqlens"][:-1].tolist(), item["cu_seqlens"][1:].tolist())]))  # fmt: skip
            tiles += len(item["pixel_values"]) if int(item["num_images"].sum()) else 0
        sizes = [RUN_SIZES[k % 5] for k in range(9) if k % 3] + [RUN_SIZES[3], RUN_SIZES[0]]
        assert tiles == sum(dataset.processor.tiles(*size) for size in sizes), output_format


def test_the_hugging_face_and_thd_batches_carry_every_packs_tiles(runs):
    outs, _, _, image = runs
    dataset = PackedSeqDataset(outs["compact"])
    items = [dataset[p] for p in range(len(dataset)) if int(dataset.sample_images(p).sum())]
    from neva_pack.training import thd_collate

    for collate in (hf_collate(dataset, image), thd_collate(dataset, with_packed_seq_params=False)):
        batch = collate(items)
        assert torch.equal(batch["pixel_values"], torch.cat([item["pixel_values"] for item in items]))
        assert int((batch["input_ids" if "input_ids" in batch else "tokens"] == image).sum()) == 16 * len(batch["pixel_values"])


def test_nemo_and_bridge_refuse_in_one_line_naming_the_formats_that_can(runs, tmp_path, capsys):
    """nemo holds one crop size, bridge text only: each is refused before any work, in one line naming the
    formats that hold images of their own sizes."""
    _, flags, _, _ = runs
    for output_format in ("nemo", "bridge"):
        capsys.readouterr()
        assert main(["preprocess", "--quiet", *flags, "--output_format", output_format, "--output_dir", str(tmp_path / output_format)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        message = f"--output_format {output_format}: cannot hold the dynamic-resolution images"
        assert len(err) == 1 and message in err[0] and "compact" in err[0] and "energon" in err[0], err


def test_plan_from_the_input(runs, capsys):
    _, flags, _, _ = runs
    capsys.readouterr()
    sample_flags = flags[: flags.index("--max_seq_length")]
    assert main(["plan", *sample_flags, "--output_format", "compact", "--num_workers", "0", "--pack_sizes", "300", "600", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["pack_size"] for row in rows} == {300, 600}, rows
    assert main(["plan", str(runs[0]["compact"]), "--pack_sizes", "300", "600", "--json"]) == 0
    from_store = json.loads(capsys.readouterr().out)
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in rows] == [{k: v for k, v in row.items() if k != "seconds"} for row in from_store]


@pytest.fixture(scope="module")
def proof(runs):
    """Packs of the compact run holding images, as one ``hf_collate`` row, and the loss and gradients of their
    samples run one by one as the model's processor would feed them."""
    outs, _, model, image = runs
    dataset, reader = PackedSeqDataset(outs["compact"]), open_packed(outs["compact"])
    packs = [p for p in range(len(dataset)) if dataset.sample_images(p).sum()][:3]
    assert sum(int(dataset.sample_images(p).sum()) for p in packs) >= 3
    batch = hf_collate(dataset, image)([dataset[p] for p in packs])
    alone = [run for p in packs for run in samples_alone(reader.pack(p), dataset.sample_images(p), dataset.processor, "internvl", image)]
    return model, batch, batch["shift_labels"][0], loss_and_gradients(model, alone), image


def test_a_tiny_internvl_trained_on_packed_rows_through_hf_collate_gets_the_samples_loss_and_gradients(proof):
    model, batch, targets, reference, _ = proof
    assert batch["position_ids"].dim() == 2 and batch["pixel_values"].shape[1:] == (3, 448, 448)
    assert any(name.startswith("model.vision_tower") for name in reference[1])  # the vision tower is trained too
    assert difference(loss_and_gradients(model, [(batch, targets)]), reference) < TOLERANCE


def test_wrong_rows_fail_clearly(proof):
    model, batch, targets, reference, image = proof
    continuing = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    assert difference(loss_and_gradients(model, [(continuing, targets)]), reference) > WRONG
    swapped = batch["pixel_values"].clone()
    swapped[[0, -1]] = swapped[[-1, 0]]  # a tile of the first image and the last image's thumbnail trade places
    assert difference(loss_and_gradients(model, [({**batch, "pixel_values": swapped}, targets)]), reference) > WRONG
