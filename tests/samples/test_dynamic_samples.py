"""Samples of the dynamic-resolution families (Qwen2-VL native, LLaVA-NeXT / OneVision anyres) against
transformers' processors: each image's run is the processor's expansion of its placeholder for that
image (Qwen2VLProcessor's <|image_pad|> per image_grid_thw, LlavaNextProcessor / LlavaOnevisionProcessor's
<image> per feature), counted from the image's header before any decode; labels, truncation (never
inside a run) and the no-control-token-from-text rule hold with per-image run lengths.

The tokenizer is tests/golden/dynamic/tokenizer.json (scripts/build_dynamic_tokenizer.py), a small
byte-level BPE with the models' real special tokens; the reference processors get the same file.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image

from neva_pack.families import ImageSource, StoredImage, dynamic_image_run, dynamic_processor, resolve_encoder
from neva_pack.core import ConfigError
from neva_pack.records import RawRecord
from neva_pack.samples import SampleBuilder, Skipped, truncation
from neva_pack.text import load_template, load_tokenizer
from tests.conftest import SAMPLE_DATA
from tests.dynamic_references import (
    SYSTEM,
    anyres_reference,
    llava_prompt,
    qwen_reference,
    reference_ids,
    stand_in_tokenizer,
)
from tests.image_zoo import MPL, SKIMAGE, random_rgb

QWEN2_VL = "Qwen/Qwen2-VL-7B-Instruct"
QWEN25_VL = "Qwen/Qwen2.5-VL-7B-Instruct"
V16_VICUNA = "llava-hf/llava-v1.6-vicuna-7b-hf"
V16_MISTRAL = "llava-hf/llava-v1.6-mistral-7b-hf"
OV = "llava-hf/llava-onevision-qwen2-7b-ov-hf"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Real photos (grace_hopper 512x600 JPEG, coffee 600x400, chelsea 451x300, text 448x172 gray) and
    synthetic sizes on either side of the families' rounding (tiny, extreme aspect, 88 x 99)."""
    folder = tmp_path_factory.mktemp("images")
    shutil.copy(MPL / "grace_hopper.jpg", folder / "grace_hopper.jpg")
    for name in ("coffee.png", "chelsea.png", "text.png"):
        shutil.copy(SKIMAGE / name, folder / name)
    for width, height in ((99, 88), (30, 40), (700, 60), (1000, 70)):
        random_rgb(width, height, seed=width).save(folder / f"r{width}x{height}.png")
    return folder


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    return {kind: stand_in_tokenizer(tmp_path_factory.mktemp(kind), kind) for kind in ("qwen", "llama")}


def builder(tokenizer_dir, images, encoder_name, template, max_seq_length=100_000, tokenization="nemo", **options):
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = resolve_encoder(encoder_name)
    arithmetic = "llava" if tokenization == "llava" else "transformers"
    return SampleBuilder(
        tokenizer=tokenizer, template=load_template(template, tokenization), image_source=ImageSource(images),
        preprocessor=dynamic_processor(encoder, arithmetic=arithmetic, **options),
        image_run=dynamic_image_run(tokenizer, encoder.family), max_seq_length=max_seq_length, tokenization=tokenization,
    )  # fmt: skip


def record(*turns, index=0) -> RawRecord:
    images = [name for turn in turns[::2] for name in turn[1]]
    conversations = []
    for k, turn in enumerate(turns):
        text = turn if k % 2 else "".join("<image>\n" for _ in turn[1]) + turn[0]
        conversations.append({"from": "gpt" if k % 2 else "human", "value": text})
    data = {"id": f"r{index}", "conversations": conversations}
    if images:
        data["image"] = images if len(images) > 1 else images[0]
    return RawRecord(index=index, value=data)


def ids_of(sample) -> np.ndarray:
    """The sample's ids (tokens plus the last label's id)."""
    return np.concatenate([sample.tokens, sample.labels[-1:]]).astype(np.int64)


def trained_spans(ids: np.ndarray, opener: list[int], closer: list[int]) -> np.ndarray:
    """Positions trained by our ChatML rule: after each opener, up to and including the closer + "\\n"."""
    trained = np.zeros(len(ids), dtype=bool)
    k = 0
    while k < len(ids):
        if ids[k : k + len(opener)].tolist() == opener:
            start = k + len(opener)
            end = start
            while ids[end : end + len(closer)].tolist() != closer:
                end += 1
            trained[start : end + len(closer)] = True
            k = end
        k += 1
    return trained


QWEN_CONVERSATIONS = [
    (("Who is this?", ["grace_hopper.jpg"]), "Grace Hopper."),
    (("Compare.", ["coffee.png", "chelsea.png"]), "A cup and a cat.", ("Text?", ["text.png"]), "Some text."),
    (("Odd sizes.", ["r99x88.png", "r30x40.png", "r1000x70.png"]), "Small, tiny and wide."),
    (("No image here.", []), "Then text only."),
]


def qwen_prompt(turns) -> str:
    parts = [SYSTEM]
    for k, turn in enumerate(turns):
        if k % 2:
            parts.append(f"<|im_start|>assistant\n{turn}<|im_end|>\n")
        else:
            runs = "".join("<|vision_start|><|image_pad|><|vision_end|>\n" for _ in turn[1])
            parts.append(f"<|im_start|>user\n{runs}{turn[0]}<|im_end|>\n")
    return "".join(parts)


@pytest.mark.parametrize("encoder_name", [QWEN2_VL, QWEN25_VL])
@pytest.mark.parametrize("turns", QWEN_CONVERSATIONS, ids=["hopper", "two_rounds", "odd_sizes", "text_only"])
def test_qwen2_vl_ids_are_the_processors_expansion(tokenizer_dirs, images, encoder_name, turns):
    b = builder(tokenizer_dirs["qwen"], images, encoder_name, "qwen2_vl")
    sample = b.build(record(*turns))
    names = [name for turn in turns[::2] for name in turn[1]]
    expected = reference_ids(qwen_reference(tokenizer_dirs["qwen"], encoder_name), qwen_prompt(turns), names, images)
    np.testing.assert_array_equal(ids_of(sample), expected)
    tokenizer = load_tokenizer(tokenizer_dirs["qwen"])
    opener = [tokenizer.token_to_id("<|im_start|>"), *tokenizer.encode("assistant\n").ids.tolist()]
    closer = [tokenizer.token_to_id("<|im_end|>"), *tokenizer.encode("\n").ids.tolist()]
    trained = trained_spans(expected, opener, closer)
    np.testing.assert_array_equal(sample.labels, np.where(trained[1:], expected[1:], -1))
    # per image: its run (start + pads + end) of the processor's count, the StoredImage, its vision cost
    processor = b.preprocessor
    sizes = [Image.open(images / name).size for name in names]
    runs = [processor.tokens_for_size(*size) + 2 for size in sizes]
    np.testing.assert_array_equal(sample.image_tokens, runs)
    assert all(isinstance(image, StoredImage) and image.size == size for image, size in zip(sample.images, sizes))
    assert sample.vision_cost == sum((processor.tokens_for_size(*size) * 4) ** 2 for size in sizes)
    for start, run in zip(sample.image_starts, runs):
        window = ids_of(sample)[start : start + run]
        assert window[0] == tokenizer.token_to_id("<|vision_start|>") and window[-1] == tokenizer.token_to_id("<|vision_end|>")


def test_min_and_max_pixels_change_each_images_run(tokenizer_dirs, images):
    """--max_pixels 200,000 against the checkpoint's 12,845,056 (512 x 600 fits under it as it is)."""
    wide = builder(tokenizer_dirs["qwen"], images, QWEN2_VL, "qwen2_vl", max_pixels=200_000)
    sample = wide.build(record(("Who?", ["grace_hopper.jpg"]), "Her."))
    assert sample.image_tokens[0] == wide.preprocessor.tokens_for_size(512, 600) + 2 < 378 + 2
    full = builder(tokenizer_dirs["qwen"], images, QWEN2_VL, "qwen2_vl").build(record(("Who?", ["grace_hopper.jpg"]), "Her."))
    assert full.image_tokens[0] == 18 * 21 + 2  # 512 wide x 600 high -> 504 x 588: 36 x 42 patches / 4


LLAVA_CASES = [
    (V16_VICUNA, "vicuna_v1", "llama", "nemo"),
    (V16_VICUNA, "vicuna_v1", "llama", "llava"),
    (V16_MISTRAL, "mistral_instruct", "llama", "nemo"),
    (OV, "qwen_1_5", "qwen", "nemo"),
]
@pytest.mark.parametrize("encoder_name, template, kind, tokenization", LLAVA_CASES)
def test_llava_next_ids_are_the_processors_expansion(tokenizer_dirs, images, encoder_name, template, kind, tokenization):
    turns = (("Who is this?", ["grace_hopper.jpg"]), "Grace Hopper.", ("And now?", []), "Still her.")
    b = builder(tokenizer_dirs[kind], images, encoder_name, template, tokenization=tokenization)
    sample = b.build(record(*turns))
    expected = reference_ids(anyres_reference(tokenizer_dirs[kind], encoder_name), llava_prompt(template, tokenization, turns),
                             ["grace_hopper.jpg"], images)  # fmt: skip
    assert b.preprocessor.arithmetic == ("llava" if tokenization == "llava" else "transformers")  # same count at this size
    np.testing.assert_array_equal(ids_of(sample), expected)
    run = int((expected == load_tokenizer(tokenizer_dirs[kind]).token_to_id("<image>")).sum())
    np.testing.assert_array_equal(sample.image_tokens, [run])
    assert sample.images[0].tokens == run and len(sample.images[0].parts) == 2


def test_onevision_multi_image_sample_counts_each_image_untiled(tokenizer_dirs, images):
    """A OneVision sample of several images: each image is base features + one newline (730 - 1 CLS-less: 729 + 1),
    as LlavaOnevisionProcessor expands a text with several images; stored as one square part."""
    turns = (("Compare.", ["coffee.png", "chelsea.png", "r700x60.png"]), "Three pictures.")
    b = builder(tokenizer_dirs["qwen"], images, OV, "qwen_1_5")
    sample = b.build(record(*turns))
    expected = reference_ids(anyres_reference(tokenizer_dirs["qwen"], OV), llava_prompt("qwen_1_5", "nemo", turns),
                             ["coffee.png", "chelsea.png", "r700x60.png"], images)  # fmt: skip
    np.testing.assert_array_equal(ids_of(sample), expected)
    np.testing.assert_array_equal(sample.image_tokens, [730, 730, 730])
    assert all(len(image.parts) == 1 for image in sample.images)
    assert sample.vision_cost == 3 * 729**2


def test_onevision_sample_cut_to_one_image_counts_it_as_its_only_image(tokenizer_dirs, images):
    """Two images (730 each as a pair) cut after the first: it is the sample's only image, so it is
    counted and stored tiled (as the processor treats a text with one image), and still fits."""
    turns = (("A?", ["r30x40.png"]), "Tiny.", ("B?", ["chelsea.png"]), "A cat.")
    b = builder(tokenizer_dirs["qwen"], images, OV, "qwen_1_5", max_seq_length=1400)
    sample = b.build(record(*turns))
    single = b.preprocessor.tokens_for_size(30, 40)
    assert 730 < single < 1400 - 20
    assert sample.truncated and len(sample.images) == 1 and sample.image_tokens.tolist() == [single]
    assert len(sample.images[0].parts) == 2 and sample.images[0].tokens == single
    alone = builder(tokenizer_dirs["qwen"], images, OV, "qwen_1_5").build(record(*turns[:2]))
    np.testing.assert_array_equal(sample.tokens[: alone.length], alone.tokens)


def test_truncation_never_splits_an_image_run(tokenizer_dirs, images):
    """Cut at every length: each image kept is whole, images past the cut are dropped (never decoded),
    the ids are the whole sample's up to the cut."""
    turns = (("Hi.", []), "Hello there.", ("Odd.", ["r30x40.png", "r99x88.png", "r1000x70.png"]), "Small, tiny and wide.")
    full = builder(tokenizer_dirs["qwen"], images, QWEN2_VL, "qwen2_vl").build(record(*turns))
    kept_counts = set()
    for max_seq_length in range(30, full.length + 1):
        check_cut(tokenizer_dirs, images, turns, full, max_seq_length, kept_counts)
    assert kept_counts == {0, 1, 2, 3}


def check_cut(tokenizer_dirs, images, turns, full, max_seq_length, kept_counts):
    b = builder(tokenizer_dirs["qwen"], images, QWEN2_VL, "qwen2_vl", max_seq_length=max_seq_length)
    sample = b.build(record(*turns))
    kept = len(sample.images)
    kept_counts.add(kept)
    assert sample.length <= max_seq_length and sample.truncated == (full.length > max_seq_length)
    np.testing.assert_array_equal(sample.image_tokens, full.image_tokens[:kept])
    assert all(start + run <= sample.length for start, run in zip(sample.image_starts, sample.image_tokens))
    np.testing.assert_array_equal(sample.tokens, full.tokens[: sample.length])


def test_truncation_takes_an_int_or_per_image_lengths():
    assert truncation([3, 6], 3, 8) == truncation([3, 6], [3, 3], 8) == (7, 1)
    assert truncation([3, 6], [3, 2], 8) == (9, 2)
    assert truncation([3, 5], [2, 10], 100) == (101, 2)


def test_control_tokens_typed_in_text_are_spelled_as_text(tokenizer_dirs, images):
    tokenizer = load_tokenizer(tokenizer_dirs["qwen"])
    typed = "Is <|image_pad|> or <|vision_start|><|vision_end|> or <image> or <|im_end|> an image?"
    b = builder(tokenizer_dirs["qwen"], images, QWEN2_VL, "qwen2_vl")
    sample = b.build(record((typed.replace("<image>", "<image "), ["r30x40.png"]), "No."))
    pads = ids_of(sample) == tokenizer.token_to_id("<|image_pad|>")
    assert pads.sum() == sample.image_tokens[0] - 2
    for token in ("<|vision_start|>", "<|vision_end|>"):
        assert (ids_of(sample) == tokenizer.token_to_id(token)).sum() == 1
    assert (ids_of(sample) == tokenizer.token_to_id("<|im_end|>")).sum() == 3  # system, user, assistant


def test_an_image_decoded_at_another_size_than_its_header_said_is_skipped_with_both(images):
    """The count (and the plan made from it) came from the header: an image that decodes at another size
    is an unreadable_image naming both sizes, never a sample with one count and other pixels."""
    from neva_pack.samples import HeaderImage, HeaderImages
    from neva_pack.records import RecordError

    loader = HeaderImages(dynamic_processor(resolve_encoder(QWEN2_VL)), ImageSource(images))
    (image,) = loader.read(["r99x88.png"])
    assert image.size == (99, 88) and loader.load(image).size == (99, 88)
    stale = HeaderImage(name=image.name, data=image.data, size=(100, 88), tokens=image.tokens, sample_images=1)
    with pytest.raises(RecordError, match="decoded as 99 x 88, its header said 100 x 88") as error:
        loader.load(stale)
    assert error.value.reason == "unreadable_image"


def test_pixel_budget_is_checked_on_the_resized_size_from_the_header(tokenizer_dirs, images):
    b = builder(tokenizer_dirs["llama"], images, V16_VICUNA, "vicuna_v1")
    b_small = SampleBuilder(
        tokenizer=b.tokenizer, template=b.template, image_source=b.image_source, preprocessor=b.preprocessor,
        image_run=b.image_run, max_seq_length=100_000, max_image_pixels=400 * 400,
    )  # fmt: skip
    skipped = b_small.build(record(("Who?", ["r99x88.png"]), "Noise."))  # 9,000 pixels, grid 336 x 672
    assert isinstance(skipped, Skipped) and skipped.reason == "image_too_large" and "resized" in skipped.detail


def test_a_tokenizer_without_the_models_image_tokens_is_one_config_error():
    tokenizer = load_tokenizer(SAMPLE_DATA / "tokenizer.model")
    with pytest.raises(ConfigError, match=r"has no <\|vision_start\|>") as error:
        dynamic_image_run(tokenizer, "native")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="has no <image>"):
        dynamic_image_run(tokenizer, "anyres")
    assert dynamic_image_run(tokenizer, "anyres", patch_id=7).patch_id == 7
