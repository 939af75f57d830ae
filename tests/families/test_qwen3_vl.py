"""Qwen3-VL (and the Qwen3.5 / 3.6 checkpoints whose processor is ``Qwen3VLProcessor``) through the public
API as it is: the shipped settings are the released ``preprocessor_config.json`` byte for byte; token
counts and ``image_grid_thw`` equal transformers' PIL image processor (the one transformers maps to
``qwen3_vl`` / ``qwen3_5``) on more than 20,000 sizes; pixels are bit-identical to it over the image zoo;
the ``qwen3_vl`` template gives the ids of the released chat template (tests/golden/qwen3_vl/) expanded by
``Qwen3VLProcessor``; every sample's positions equal ``Qwen3VLModel.get_rope_index`` on the sample alone;
and a tiny random ``Qwen3VLForConditionalGeneration`` (float64, deepstack on) trained on packed rows of a
real run through ``hf_collate`` gets the samples' one-by-one loss and gradients to 1e-9, while wrong rows
(positions not restarting, a transposed grid, two images swapped) move them far more.

Tokenizer: the stand-in tests/golden/dynamic/tokenizer.json (a small byte-level BPE carrying Qwen's
special tokens; Qwen3-VL's tokenizer has the same ones): no Qwen tokenizer is reachable offline."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.families import (
    ImageSource,
    dynamic_image_run,
    dynamic_processor,
    known_encoders,
    resolve_encoder,
    tokens_from_header,
)
from neva_pack.families.native import NativeProcessor, mrope_position_ids  # the family's own module
from neva_pack.files import paths
from neva_pack.formats import open_packed
from neva_pack.reading import PackedSeqDataset
from neva_pack.records import RawRecord
from neva_pack.samples import SampleBuilder
from neva_pack.text import load_template, load_tokenizer
from neva_pack.training import hf_collate
from tests.dynamic_models import TOLERANCE, difference, loss_and_gradients, samples_alone
from tests.dynamic_references import hf_tokenizer, stand_in_tokenizer
from tests.image_zoo import MPL, SKIMAGE, random_rgb, zoo_images
from tests.family_runs import write_mixed_records

QWEN3_VL = ["Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"]
QWEN3_5 = ["Qwen/Qwen3.5-2B-Base", "Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-9B", "Qwen/Qwen3.6-35B-A3B"]
ENCODER = "Qwen/Qwen3-VL-8B-Instruct"
RELEASED_SHA256 = "27225450ac9c6529872ee1924fcb0962ff5634834f817040f444118116f4e516"
"""SHA-256 of the released preprocessor_config.json (390 bytes), the same file in every checkpoint above
(snapshot inventories that pin these repositories record it; see neva_pack/families/shipped/README.md)."""
CHAT_TEMPLATE = Path(__file__).resolve().parent.parent / "golden" / "qwen3_vl" / "chat_template.jinja"
CHAT_TEMPLATE_SHA256 = "5c72a170d2a4a1a3bc5adad2e689ae28138a9700e5b8c96c0266331e86c0acce"
"""SHA-256 of Qwen/Qwen3-VL-8B-Instruct's chat_template.json, which is {"chat_template": <the .jinja>}
written with indent 4 (tests/golden/qwen3_vl/README.md)."""
WRONG = 1e-6


def reference_processor(encoder_name: str = ENCODER, **overrides):
    """transformers' PIL image processor of the checkpoint's settings: the class transformers maps to
    qwen3_vl / qwen3_5 (``Qwen2VLImageProcessorPil``); ``min_pixels`` / ``max_pixels`` go into ``size``
    as the checkpoint's own do."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    settings = {k: v for k, v in resolve_encoder(encoder_name).preprocessor_config.items()
                if k not in ("image_processor_type", "processor_class")}  # fmt: skip
    size = dict(settings.pop("size"))
    size.update({{"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}[k]: v for k, v in overrides.items()})
    return Qwen2VLImageProcessorPil(size=size, **settings)


# ---------------------------------------------------------------- shipped settings


@pytest.mark.parametrize("name", QWEN3_VL + QWEN3_5)
def test_shipped_settings_are_the_released_file_byte_for_byte(name):
    encoder = resolve_encoder(name)
    written = json.dumps(encoder.preprocessor_config, indent=4).encode()  # as the checkpoints' file is written
    assert len(written) == 390 and hashlib.sha256(written).hexdigest() == RELEASED_SHA256
    assert encoder.processor == "qwen2_vl" and encoder.family == "native" and name in known_encoders("native")
    assert encoder.patch_size == 16
    processor = dynamic_processor(encoder)
    assert isinstance(processor, NativeProcessor)
    s = processor.settings
    assert (s.patch_size, s.merge_size, s.temporal_patch_size, s.factor) == (16, 2, 2, 32)
    assert (s.min_pixels, s.max_pixels, s.resample) == (65536, 16777216, 3)  # size's shortest/longest edge; bicubic
    assert processor.normalisation.mean == processor.normalisation.std == (0.5, 0.5, 0.5)


def test_transformers_maps_these_models_to_the_processors_the_reference_uses():
    """What the exactness below is held against is what transformers itself builds for these checkpoints."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for model_type in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        assert IMAGE_PROCESSOR_MAPPING_NAMES[model_type]["pil"] == "Qwen2VLImageProcessorPil"
    for model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"):
        assert PROCESSOR_MAPPING_NAMES[model_type] == "Qwen3VLProcessor"
    reference = reference_processor()
    assert (reference.size.shortest_edge, reference.size.longest_edge, reference.patch_size) == (65536, 16777216, 16)


def test_a_local_checkpoint_directory_with_the_released_file_is_the_shipped_encoder(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(resolve_encoder(ENCODER).preprocessor_config, indent=4))
    local, shipped = dynamic_processor(resolve_encoder(str(tmp_path))), dynamic_processor(resolve_encoder(ENCODER))
    assert local.settings == shipped.settings and local.normalisation == shipped.normalisation


# ---------------------------------------------------------------- token counts and grids


def size_grid() -> list[tuple[int, int]]:
    """>= 20,000 (width, height): every side 1..100 (all under min_pixels: scaled up), coarser to 9,000
    (over max_pixels past 4,096 x 4,096: scaled down), 32k +- 1 and the half-way sides 32k + 16."""
    sides = sorted({*range(1, 101), *range(101, 2000, 19), *range(2000, 9001, 397),
                    *(32 * k + d for k in range(3, 90, 2) for d in (-1, 0, 1, 16))})  # fmt: skip
    return [(w, h) for w in sides for h in sides if max(w, h) / min(w, h) <= 200]


@pytest.mark.parametrize("max_pixels", [None, 32 * 32 * 1280])
def test_token_counts_and_grids_equal_the_processors_on_a_grid_of_sizes(max_pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sizes = size_grid()
    assert len(sizes) >= 20_000
    ours = dynamic_processor(resolve_encoder(ENCODER), max_pixels=max_pixels)
    theirs = reference_processor(**({} if max_pixels is None else {"max_pixels": max_pixels}))
    low, high = theirs.size.shortest_edge, theirs.size.longest_edge
    for width, height in sizes:
        patches = theirs.get_number_of_image_patches(height, width, {})
        resized_height, resized_width = smart_resize(height, width, 32, low, high)
        assert ours.grid_thw(width, height) == (1, resized_height // 16, resized_width // 16), (width, height)
        assert ours.tokens_for_size(width, height) == patches // 4, (width, height)


@pytest.mark.slow
def test_token_counts_equal_the_processors_on_every_size_up_to_600():
    """Every (width, height) of 1..600 (360,000 sizes; the aspect limit of 200 excluded)."""
    ours = dynamic_processor(resolve_encoder(ENCODER))
    theirs = reference_processor()
    for width in range(1, 601):
        for height in range(1, 601):
            if max(width, height) / min(width, height) <= 200:
                assert ours.tokens_for_size(width, height) == theirs.get_number_of_image_patches(height, width, {}) // 4, (width, height)


def test_known_counts_at_the_checkpoints_bounds():
    """640 x 480: 20 x 15 tokens; a tiny image is scaled up to min_pixels (256 x 256: 64 tokens); a 4K frame
    fits under max_pixels as it is, each side rounded to 32 (2160 / 32 = 67.5: half to even, 68); 8000 x 6000
    is scaled down to at most 16,777,216 pixels."""
    p = dynamic_processor(resolve_encoder(ENCODER))
    assert p.grid_thw(640, 480) == (1, 30, 40) and p.tokens_for_size(640, 480) == 300
    assert p.resized_size(1, 1) == (256, 256) and p.tokens_for_size(1, 1) == 64
    assert p.resized_size(3840, 2160) == (2176, 3840) and p.tokens_for_size(3840, 2160) == 8160
    height, width = p.resized_size(8000, 6000)
    assert height * width <= 16777216 and (height, width) == (3520, 4704) and p.tokens_for_size(8000, 6000) == 16170
    assert p.tokens_for_size(1920, 1080) == 2040


# ---------------------------------------------------------------- pixels


@pytest.mark.parametrize("name", [ENCODER, "Qwen/Qwen3.5-9B"])
def test_pixels_are_bit_identical_to_the_processor_over_the_zoo(name):
    ours = dynamic_processor(resolve_encoder(name))
    theirs = reference_processor(name)
    images = zoo_images()
    stored = [ours.to_uint8(image) for image in images.values()]
    for (label, image), one in zip(images.items(), stored):
        expected = theirs(images=image, return_tensors="np")
        got = ours.model_inputs([one])
        assert got["pixel_values"].dtype == np.float32 and got["pixel_values"].shape[1] == 3 * 2 * 16 * 16, label
        assert np.array_equal(got["image_grid_thw"], expected["image_grid_thw"]), label
        assert np.array_equal(got["pixel_values"], expected["pixel_values"]), label
        assert one.tokens == int(np.prod(expected["image_grid_thw"])) // 4, label
    together = theirs(images=list(images.values()), return_tensors="np")
    got = ours.model_inputs(stored)
    assert np.array_equal(got["pixel_values"], together["pixel_values"])
    assert np.array_equal(got["image_grid_thw"], together["image_grid_thw"])


@pytest.mark.parametrize(
    "size", [(272, 304), (304, 272), (255, 257), (257, 255), (80, 48), (6000, 31), pytest.param((4097, 4096), marks=pytest.mark.slow)]
)
def test_pixels_on_both_sides_of_the_rounding_and_the_bounds(size):
    """Half-way sides (272 = 8.5 x 32 rounds to 256, 304 = 9.5 x 32 to 320), just under / over the
    256 x 256 minimum and the 4,096 x 4,096 maximum, an elongated strip."""
    image = random_rgb(*size, seed=sum(size))
    for max_pixels in (None, 32 * 32 * 256):
        ours = dynamic_processor(resolve_encoder(ENCODER), max_pixels=max_pixels)
        theirs = reference_processor(**({} if max_pixels is None else {"max_pixels": max_pixels}))
        expected = theirs(images=image, return_tensors="np")
        got = ours.model_inputs([ours.to_uint8(image)])
        assert np.array_equal(got["image_grid_thw"], expected["image_grid_thw"]), (size, max_pixels)
        assert np.array_equal(got["pixel_values"], expected["pixel_values"]), (size, max_pixels)


def test_the_count_from_the_header_is_the_decoded_images(tmp_path):
    ours = dynamic_processor(resolve_encoder(ENCODER))
    random_rgb(333, 517).save(tmp_path / "a.png")
    assert tokens_from_header(tmp_path / "a.png", ours) == ours.to_uint8(random_rgb(333, 517)).tokens


# ---------------------------------------------------------------- the template against the released chat template


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return stand_in_tokenizer(tmp_path_factory.mktemp("qwen3_tok"), "qwen")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_images")
    shutil.copy(MPL / "grace_hopper.jpg", folder / "grace_hopper.jpg")
    for name in ("coffee.png", "chelsea.png", "text.png"):
        shutil.copy(SKIMAGE / name, folder / name)
    for width, height in ((99, 88), (30, 40), (700, 60)):
        random_rgb(width, height, seed=width).save(folder / f"r{width}x{height}.png")
    return folder


def qwen3_reference(tokenizer_dir):
    """Qwen3VLProcessor with the checkpoint's PIL image processor and the released chat template. Its
    constructor insists on a video processor (torchvision, not installed): the instance gets what its
    __init__ sets, and its own __call__ does the work (expanding each <|image_pad|> by image_grid_thw)."""
    from transformers.models.qwen3_vl import Qwen3VLProcessor

    tokenizer = hf_tokenizer(tokenizer_dir)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.__dict__.update(
        image_processor=reference_processor(), tokenizer=tokenizer, video_processor=None, chat_template=CHAT_TEMPLATE.read_text(),
        image_token="<|image_pad|>", video_token="<|video_pad|>", image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    return processor


def messages_of(record: dict) -> list[dict]:
    """A LLaVA record as chat messages: each <image> an image item in place, the text around it (its
    newlines included) text items, as a user of the chat template writes the same conversation."""
    messages = [{"role": "system", "content": record["system"]}] if "system" in record else []
    for turn in record["conversations"]:
        if turn["from"] == "gpt":
            messages.append({"role": "assistant", "content": turn["value"]})
            continue
        content = []
        for k, text in enumerate(turn["value"].split("<image>")):
            if k:
                content.append({"type": "image"})
            if text:
                content.append({"type": "text", "text": text})
        messages.append({"role": "user", "content": content})
    return messages


def conversation(*turns, system=None) -> dict:
    data = {"id": "r", "conversations": [{"from": "gpt" if k % 2 else "human", "value": t} for k, t in enumerate(turns)]}
    images = [name for turn in turns[::2] for name in _names(turn)]
    if images:
        data["image"] = images
    if system is not None:
        data["system"] = system
    return data


def _names(turn: str) -> list[str]:
    """Image names written as <image:name> in these test turns."""
    return [part.split(">", 1)[0] for part in turn.split("<image:")[1:]]


def _llava(record: dict) -> dict:
    """<image:name> -> <image> (the record's "image" list keeps the names in order)."""
    import re

    turns = [{**turn, "value": re.sub(r"<image:[^>]*>", "<image>", turn["value"])} for turn in record["conversations"]]
    return {**record, "conversations": turns}


CONVERSATIONS = {
    "hopper": conversation("<image:grace_hopper.jpg>\nWho is this?", "Grace Hopper."),
    "two_rounds": conversation("<image:coffee.png><image:chelsea.png>\nCompare.", "A cup and a cat.", "And <image:text.png> this?", "Some text."),
    "odd_sizes": conversation("Odd: <image:r99x88.png>, <image:r30x40.png> and <image:r700x60.png>.", "Small, tiny and wide."),
    "text_only": conversation("No image here.", "Then text only.", "Sure?", "Yes."),
    "record_system": conversation("<image:chelsea.png>\nWhat animal?", "A cat.", system="Answer in three words."),
}


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_samples_are_the_released_chat_templates_ids(tokenizer_dir, image_folder, case):
    record = _llava(CONVERSATIONS[case])
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = resolve_encoder(ENCODER)
    builder = SampleBuilder(
        tokenizer=tokenizer, template=load_template("qwen3_vl"), image_source=ImageSource(image_folder),
        preprocessor=dynamic_processor(encoder), image_run=dynamic_image_run(tokenizer, encoder.family), max_seq_length=100_000,
    )  # fmt: skip
    sample = builder.build(RawRecord(index=0, value=record))
    reference = qwen3_reference(tokenizer_dir)
    text = reference.tokenizer.apply_chat_template(messages_of(record), chat_template=reference.chat_template, tokenize=False)
    assert text.startswith("<|im_start|>system\n") == ("system" in record)  # no default system block
    pictures = [Image.open(image_folder / name).convert("RGB") for name in record.get("image", [])]
    out = reference(text=[text], images=[pictures] if pictures else None)
    expected = np.asarray(out["input_ids"][0], dtype=np.int64)
    ids = np.concatenate([sample.tokens, sample.labels[-1:]]).astype(np.int64)
    np.testing.assert_array_equal(ids, expected)
    # labels: each answer and the <|im_end|>\n closing it (the chat template marks no generation span)
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
        grids = np.asarray(out["image_grid_thw"])
        np.testing.assert_array_equal(sample.image_tokens, grids.prod(axis=1) // 4 + 2)


def test_the_committed_chat_template_is_the_released_file():
    template = CHAT_TEMPLATE.read_text()
    assert hashlib.sha256(json.dumps({"chat_template": template}, indent=4).encode()).hexdigest() == CHAT_TEMPLATE_SHA256


# ---------------------------------------------------------------- a real run: positions and the training proof

SIZES = [(120, 90), (300, 200), (60, 400), (512, 288), (120, 90)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_dir):
    """A preprocess run with the shipped Qwen3-VL settings, the qwen3_vl template and the stand-in tokenizer:
    records of 0, 1 and 2 images of several sizes (each scaled up to the 65,536-pixel minimum or kept)."""
    folder = tmp_path_factory.mktemp("qwen3_run")
    write_mixed_records(folder, SIZES)
    out = folder / "out"
    code = main(["preprocess", "--quiet", "--data_path", str(folder / "data.json"), "--image_folder", str(folder),
                 "--tokenizer_path", str(tokenizer_dir), "--hf_vision_encoder", ENCODER, "--conv_template", "qwen3_vl",
                 "--output_format", "compact", "--max_seq_length", "600", "--output_dir", str(out)])  # fmt: skip
    assert code == 0
    return out


def tiny_model(vocab_size: int, ids: dict, deepstack=(0, 1)):
    """A tiny randomly initialised Qwen3VLForConditionalGeneration (float64, seeded): 16 px patches merged
    2 x 2 as the checkpoints, interleaved mRoPE, deepstack features from both vision layers."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 16,
                       "num_position_embeddings": 16, "deepstack_visual_indexes": list(deepstack)},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen3VLForConditionalGeneration(config).double()


@pytest.fixture(scope="module")
def model_and_data(run, tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = {token: tokenizer.token_to_id(token) for token in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    model = tiny_model(tokenizer.vocab_size, ids)
    assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
    return model, PackedSeqDataset(run), open_packed(run), ids["<|image_pad|>"]


def test_the_run_verifies_and_records_the_encoder(run):
    assert not verify(paths.packed_prefix(run), progress=False).problems
    record = PackedSeqDataset(run).meta.image_processor
    assert (record["family"], record["encoder"], record["patch_size"]) == ("native", ENCODER, 16)
    assert (record["min_pixels"], record["max_pixels"]) == (65536, 16777216)
    assert record["preprocessor_config"] == resolve_encoder(ENCODER).preprocessor_config


def test_every_samples_positions_equal_get_rope_index_on_the_sample_alone(model_and_data):
    model, dataset, _, image = model_and_data
    checked = 0
    for p in range(len(dataset)):
        item = dataset[p]
        bounds, real = item["cu_seqlens"].tolist(), item["cu_seqlens_unpadded"].tolist()
        counts = item["num_images"].tolist()
        grids = item["image_grid_thw"].reshape(-1, 3)
        first = 0
        for k, count in enumerate(counts):
            start, end = bounds[k], bounds[k] + real[k + 1] - real[k]
            ids = item["tokens"][start:end][None].long()
            own = grids[first : first + count]
            first += count
            with torch.no_grad():
                expected, _ = model.model.get_rope_index(ids, (ids == image).int(), image_grid_thw=own if count else None)
            assert torch.equal(item["position_ids"][:, start:end], expected[:, 0]), (p, k)
            assert np.array_equal(mrope_position_ids((ids[0] == image).numpy(), own.numpy()), expected[:, 0].numpy())
            checked += 1
    assert checked == 10


@pytest.fixture(scope="module")
def proof(model_and_data):
    """Packs of the run holding images (several, of several sizes), as one ``hf_collate`` row, and the
    loss and gradients of their samples run one by one as the model's processor would feed them (the
    model computing its own mRoPE ids from ``mm_token_type_ids``)."""
    model, dataset, reader, image = model_and_data
    packs = [p for p in range(len(dataset)) if dataset.sample_images(p).sum()][:3]
    assert sum(int(dataset.sample_images(p).sum()) for p in packs) >= 3
    batch = hf_collate(dataset, image)([dataset[p] for p in packs])
    alone = [run for p in packs for run in samples_alone(reader.pack(p), dataset.sample_images(p), dataset.processor, "native", image)]
    return model, batch, batch["shift_labels"][0], loss_and_gradients(model, alone), image


def test_a_tiny_qwen3_vl_trained_on_packed_rows_through_hf_collate_gets_the_samples_loss_and_gradients(proof):
    model, batch, targets, reference, _ = proof
    assert batch["position_ids"].shape == (4, 1, batch["input_ids"].shape[1]) and batch["pixel_values"].shape[1] == 1536
    assert any(name.startswith("model.visual.deepstack_merger_list") for name in reference[1])  # deepstack trained
    assert difference(loss_and_gradients(model, [(batch, targets)]), reference) < TOLERANCE


@pytest.mark.slow  # three more runs of the model; the default run's wrong rows: training/test_dynamic_training.py (Qwen2-VL, LLaVA-NeXT)
def test_wrong_rows_fail_clearly(proof):
    model, batch, targets, reference, image = proof
    # positions not restarting: the row's mRoPE ids as one sequence's, text row counting on
    ids = batch["input_ids"][0]
    whole = torch.from_numpy(mrope_position_ids((ids == image).numpy(), batch["image_grid_thw"].numpy()))[:, None]
    continuing = {**batch, "position_ids": torch.cat([torch.arange(len(ids))[None, None], whole])}
    assert difference(loss_and_gradients(model, [(continuing, targets)]), reference) > WRONG
    # a grid transposed (same patch count): the vision tower reads the image's rows as the wrong shape
    grids = batch["image_grid_thw"].clone()
    wide = int(torch.nonzero(grids[:, 1] != grids[:, 2])[0])
    grids[wide] = grids[wide][[0, 2, 1]]
    assert difference(loss_and_gradients(model, [({**batch, "image_grid_thw": grids}, targets)]), reference) > WRONG
    # the 3 mRoPE rows alone (no text row): no packed mask, the samples see each other
    three_rows = {**batch, "position_ids": batch["position_ids"][1:]}
    assert difference(loss_and_gradients(model, [(three_rows, targets)]), reference) > WRONG
