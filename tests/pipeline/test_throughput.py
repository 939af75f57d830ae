"""The fast paths of the throughput work give exactly the bytes of the slow ones they replace.

- image geometry (PIL resize + centre crop) and normalisation (formats.meta.Normalisation, read
  from the encoder's settings) == transformers' processor, over an image zoo of every PIL mode and
  odd size, both aspect-ratio modes, every shipped encoder;
- the tokenizer's compiled reading of sentencepiece's serialized proto == the protobuf objects;
- the whole run == golden checksums of the .bin/.idx written before any of this work (main at
  e49daae), for image and text workloads, several templates, tokenizers, encoders and pack sizes.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from neva_pack.files import bin_path, idx_path, packed_prefix
from neva_pack.families import EncoderSpec, decode_image, known_encoders, resolve_encoder
from neva_pack.families.fixed import (
    ImagePreprocessor,
    expand_to_square,
    fast_geometry,
    normalisation_from_settings,
    normalisation_of,
    processor_class,
    processor_halves,
)
from neva_pack.text import SentencePieceTokenizer

SKIMAGE = importlib.resources.files("skimage") / "data"


def _synthetic(mode: str, size: tuple[int, int], seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    if mode == "I;16":
        image = Image.fromarray(rng.integers(0, 65536, (size[1], size[0]), dtype=np.uint16))
    elif mode == "P":
        image = rgb.convert("P", palette=Image.Palette.ADAPTIVE)
    else:
        image = rgb.convert(mode)
    out = io.BytesIO()
    image.save(out, format="TIFF" if mode in ("CMYK", "I;16") else "PNG")
    return out.getvalue()


ZOO = {
    "astronaut.png (RGB 512x512)": lambda: (SKIMAGE / "astronaut.png").read_bytes(),
    "coffee.png (RGB 600x400)": lambda: (SKIMAGE / "coffee.png").read_bytes(),
    "hubble_deep_field.jpg (ICC)": lambda: (SKIMAGE / "hubble_deep_field.jpg").read_bytes(),
    "camera.png (L)": lambda: (SKIMAGE / "camera.png").read_bytes(),
    "text.png (L, aspect 2.6)": lambda: (SKIMAGE / "text.png").read_bytes(),
    "logo.png (RGBA)": lambda: (SKIMAGE / "logo.png").read_bytes(),
    "horse.png (RGBA mask)": lambda: (SKIMAGE / "horse.png").read_bytes(),
    "no_time_for_that_tiny.gif (P, animated, 14x25)": lambda: (SKIMAGE / "no_time_for_that_tiny.gif").read_bytes(),
    "LA 40x30": lambda: _synthetic("LA", (40, 30)),
    "CMYK 50x70": lambda: _synthetic("CMYK", (50, 70)),
    "I;16 33x21": lambda: _synthetic("I;16", (33, 21)),
    "1 (bilevel) 64x48": lambda: _synthetic("1", (64, 48)),
    "P 31x17": lambda: _synthetic("P", (31, 17)),
    "1x1": lambda: _synthetic("RGB", (1, 1)),
    "2x1": lambda: _synthetic("RGB", (2, 1)),
    "1x2": lambda: _synthetic("RGB", (1, 2)),
    "700x3 (extreme landscape)": lambda: _synthetic("RGB", (700, 3)),
    "5x900 (extreme portrait)": lambda: _synthetic("RGB", (5, 900)),
    "337x335 (odd, one pixel off the crop)": lambda: _synthetic("RGB", (337, 335)),
}


def _reference(encoder: EncoderSpec, image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    """transformers' processor: (uint8 after resize/crop, float32 in one call)."""
    settings_ = {k: v for k, v in encoder.preprocessor_config.items() if k != "image_processor_type"}
    processor = processor_class(encoder.processor)
    geometry = processor(**{**settings_, "do_rescale": False, "do_normalize": False})
    uint8 = geometry(images=image, return_tensors="np")["pixel_values"][0].astype(np.uint8)
    full = processor(**settings_)(images=image, return_tensors="np")["pixel_values"][0]
    return uint8, full


@pytest.fixture(scope="module")
def zoo() -> dict[str, Image.Image]:
    return {name: decode_image(load(), name) for name, load in ZOO.items()}


@pytest.mark.parametrize("encoder_name", known_encoders(family="fixed"))
@pytest.mark.parametrize("aspect", ["square", "pad"])
def test_fast_image_paths_are_bit_identical_to_the_processor(zoo, encoder_name, aspect):
    encoder = resolve_encoder(encoder_name)
    assert fast_geometry(encoder) is not None and normalisation_from_settings(encoder) is not None  # fast paths taken
    pre = ImagePreprocessor(encoder, aspect)
    mean = encoder.preprocessor_config["image_mean"]
    background = tuple(int(channel * 255) for channel in mean)  # LLaVA's expand2square colour
    for name, image in zoo.items():
        source = image if aspect == "square" else expand_to_square(image, background)
        expected_uint8, expected_full = _reference(encoder, source)
        ours = pre.to_uint8(image)
        assert ours.dtype == np.uint8 and ours.flags.c_contiguous, name
        assert np.array_equal(ours, expected_uint8), f"{encoder_name} {aspect} {name}: geometry differs"
        assert np.array_equal(pre.normalize(ours[None])[0], expected_full), f"{encoder_name} {aspect} {name}: values differ"


@pytest.mark.parametrize("encoder_name", known_encoders(family="fixed"))
def test_normalisation_read_from_the_settings_is_the_processors(encoder_name):
    encoder = resolve_encoder(encoder_name)
    _, values = processor_halves(encoder)
    assert normalisation_from_settings(encoder) == normalisation_of(values) == ImagePreprocessor(encoder, "square").normalisation()


def test_settings_outside_the_proven_ones_go_through_the_processor(zoo):
    clip = resolve_encoder("openai/clip-vit-large-patch14-336")
    for change in ({"size": 336}, {"resample": None}, {"do_pad": True}, {"crop_size": {"height": 400, "width": 400}},
                   {"rescale_factor": 1}, {"image_mean": 0.5}):  # fmt: skip
        odd = EncoderSpec(name="odd", processor="clip", family="fixed", preprocessor_config={**clip.preprocessor_config, **change},
                          patch_size=14)  # fmt: skip
        assert fast_geometry(odd) is None or normalisation_from_settings(odd) is None, change
    plain = EncoderSpec(name="plain", processor="clip", family="fixed", preprocessor_config={**clip.preprocessor_config, "do_pad": False},
                        patch_size=14)  # fmt: skip
    pre = ImagePreprocessor(plain, "square")
    image = zoo["coffee.png (RGB 600x400)"]
    expected_uint8, expected_full = _reference(plain, image)
    assert np.array_equal(pre.to_uint8(image), expected_uint8)
    assert np.array_equal(pre.normalize(pre.to_uint8(image)[None])[0], expected_full)


# ---------------------------------------------------------------------------------------------
# tokenizer


def _protobuf_encoding(reference, text: str):
    """The previous implementation: protobuf objects, offsets mapped byte by byte in Python."""
    pieces = reference.encode(text, out_type="proto").pieces
    table = np.array([(p.id, p.begin, p.end) for p in pieces], dtype=np.int64).reshape(-1, 3)
    widths = [len(ch.encode("utf-8", "surrogatepass")) for ch in text]
    char_of_byte = np.append(np.repeat(np.arange(len(text)), widths), len(text)).astype(np.int64)
    return table[:, 0], char_of_byte[table[:, 1]], char_of_byte[table[:, 2]]


@pytest.fixture(scope="module")
def tokenizers(sample_tokenizer_path, mistral_tokenizer_path):
    """Each of our tokenizers with sentencepiece's own processor of the same model."""
    import sentencepiece

    paths = (sample_tokenizer_path, mistral_tokenizer_path)
    return [(SentencePieceTokenizer(path), sentencepiece.SentencePieceProcessor(model_file=str(path))) for path in paths]


EDGE_TEXTS = ["", " ", "  \n\t ", "héllo  world", "日本語 テキスト", "a\u0301", "🙂🙂 x", "<extra_id_4>x", "x" * 5000]


@pytest.mark.parametrize("text", EDGE_TEXTS)
def test_encoding_equals_the_protobuf_objects_on_edge_cases(tokenizers, text):
    for tokenizer, reference in tokenizers:
        encoding = tokenizer.encode(text)
        for ours, expected in zip((encoding.ids, encoding.starts, encoding.ends), _protobuf_encoding(reference, text)):
            assert ours.dtype == np.int64 and np.array_equal(ours, expected), text


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_encoding_equals_the_protobuf_objects(tokenizers, text):
    for tokenizer, reference in tokenizers:
        encoding = tokenizer.encode(text)
        for ours, expected in zip((encoding.ids, encoding.starts, encoding.ends), _protobuf_encoding(reference, text)):
            assert np.array_equal(ours, expected), text


# ---------------------------------------------------------------------------------------------
# whole runs: bytes pinned before the throughput work

def packed_file(pack_size, kind: str) -> str:
    """The name of a nemo prefix's .bin or .idx (of one pack size), as the code names it."""
    prefix = packed_prefix(Path("."), pack_size)
    return (bin_path if kind == "bin" else idx_path)(prefix).name


MISTRAL = "<the Mistral v0.1 tokenizer>"
GOLDEN = {
    # name: (workload, flags, {file: sha256}) -- written by main at e49daae (issues 8-11 merged, before
    # batching, the fast tokenizer and image paths; the same runs on commit 1fd5a10 before issues 8-11
    # gave other bytes: issue 8 changed the tokenization and the sample tokenizer); any change here is a
    # change of the output format
    "image_v1_pad_clip336": ("image", ["--conv_template", "v1", "--image_aspect_ratio", "pad", "--max_seq_length", "4096",
                                       "--packing_algorithm", "near_optimal"], {
        packed_file(None, "bin"): "d6b7d6b19acf72dd44f03c8ee89fb7a9dbab857761dbee3455333e78d6994862",
        packed_file(None, "idx"): "a23e59485182f6642068ac9ccf50fa554934d34e012554eca703ed9f44868c51"}),
    "image_plain_square_siglip_mistral": ("image", ["--conv_template", "plain", "--image_aspect_ratio", "square",
                                                    "--hf_vision_encoder", "google/siglip-so400m-patch14-384",
                                                    "--max_seq_length", "2048", "--tokenizer_path", MISTRAL,
                                                    "--max_skip_fraction", "1"], {  # plain: multi-turn records skipped
        packed_file(None, "bin"): "38a679a9fc4d27701be41cd61feedd2b035229318fdd7b433e93b1106a9639b6",
        packed_file(None, "idx"): "3654a97f49f6e7861f151b4fdcb777046adfd56487524fa4006387fd565c589c"}),
    "image_sizes_mistral_tpl": ("image", ["--conv_template", "mistral", "--image_aspect_ratio", "pad",
                                          "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--pack_sizes", "256", "1024",
                                          "--tokenizer_path", MISTRAL], {
        packed_file(1024, "bin"): "7935cf26bbea875b22c1bcb8c387848caaeaa6cc8c80d063009cbfc7e61a3175",
        packed_file(1024, "idx"): "9274f9dedb11428e3f56ca513b1cc164a63e545bc29ba4148e856c9e60380ad5",
        packed_file(256, "bin"): "e7f145c4aa9d0a17bb01ac3781190d9591484971be4a01c3f7673729832534af",
        packed_file(256, "idx"): "a766db263f45319ca3b6ee32f09af81fcda11826be6d1f36a635baac6a627252"}),
    "text_v1": ("text", ["--conv_template", "v1", "--max_seq_length", "1024", "--packing_algorithm", "near_optimal"], {
        packed_file(None, "bin"): "7034a02cbd5c5ec2499f93daa78fe6144df99345da6431a43c90114fb98031a2",
        packed_file(None, "idx"): "5a00c2a2a07359486e4710661664bc608d69889a5e6af405b0a5abaeccf55c54"}),
    "text_llama2_mistral": ("text", ["--conv_template", "llama_2", "--max_seq_length", "2048", "--tokenizer_path", MISTRAL], {
        packed_file(None, "bin"): "61840456906f17780ebde21e86a74500213fb0409a4eea0e65e0ff291ea5e341",
        packed_file(None, "idx"): "d95910c3c99e73d5af575fef796f0fb9711471e99c053da15b72a66a14600959"}),
}  # fmt: skip
FAST = {"image_v1_pad_clip336": 2, "text_v1": 0}
"""Cases in the default suite (with this many workers); the others run with -m slow."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_golden(name, workers, workloads, output_dir, sample_tokenizer_path, mistral_tokenizer_path, extra=()) -> dict:
    from neva_pack.cli import main

    workload, flags, expected = GOLDEN[name]
    flags = [str(mistral_tokenizer_path) if flag == MISTRAL else flag for flag in flags]
    if "--tokenizer_path" not in flags:
        flags += ["--tokenizer_path", str(sample_tokenizer_path)]
    args = ["preprocess", "--quiet", *map(str, workloads[workload]), *flags, "--output_dir", str(output_dir),
            "--num_workers", str(workers), *extra]  # fmt: skip
    assert main(args) == 0
    return {file: _sha256(output_dir / file) for file in expected}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in GOLDEN]
)
def test_output_bytes_equal_the_golden_run(name, workloads, tmp_path, sample_tokenizer_path, mistral_tokenizer_path):
    got = run_golden(name, FAST.get(name, 3), workloads, tmp_path / "out", sample_tokenizer_path, mistral_tokenizer_path)
    assert got == GOLDEN[name][2]


# ---------------------------------------------------------------------------------------------
# worker batching


def record_indices(batch) -> list[int]:
    """The records of a StoredBatch message, samples and skips, by the index each one carries."""
    from neva_pack.sample_store import SAMPLE_ROW

    samples = np.frombuffer(batch.rows, dtype=SAMPLE_ROW)["record_index"].tolist()
    return sorted(samples + [skip.index for skip in batch.skipped])


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_batches_arrive_in_input_order_for_any_number_of_workers(workers, sample_tokenizer_path):
    from torch.utils.data import DataLoader

    from neva_pack.config import PreprocessConfig
    from neva_pack.pipeline import build_sample_builder
    from neva_pack.samples import SampleStream
    from neva_pack.core import passthrough
    from tests.conftest import SAMPLE_DATA

    config = PreprocessConfig(data_path=SAMPLE_DATA / "llava_sample.json", image_folder=SAMPLE_DATA / "images",
                              tokenizer_path=sample_tokenizer_path, output_dir=Path("unused"),
                              hf_vision_encoder="openai/clip-vit-base-patch32")  # fmt: skip
    stream = SampleStream(config.data_path, build_sample_builder(config), start=2, end=19, batch_size=3)
    loader = DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=passthrough)
    batches = list(loader)
    assert [batch.records for batch in batches] == [3, 3, 3, 3, 3, 2]  # records 2..18, one message per batch
    assert [index for batch in batches for index in record_indices(batch)] == list(range(2, 19))


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_a_small_first_message_per_worker_keeps_the_input_order(workers, sample_tokenizer_path):
    """Each worker's first message holds first_batch_size records (the first sample arrives after one
    record's work), the later ones batch_size: same records, same order, for any number of workers."""
    from torch.utils.data import DataLoader

    from neva_pack.config import PreprocessConfig
    from neva_pack.pipeline import build_sample_builder
    from neva_pack.samples import SampleStream
    from neva_pack.core import passthrough
    from tests.conftest import SAMPLE_DATA

    config = PreprocessConfig(data_path=SAMPLE_DATA / "llava_sample.json", image_folder=SAMPLE_DATA / "images",
                              tokenizer_path=sample_tokenizer_path, output_dir=Path("unused"),
                              hf_vision_encoder="openai/clip-vit-base-patch32")  # fmt: skip
    stream = SampleStream(config.data_path, build_sample_builder(config), start=2, end=19, batch_size=3, first_batch_size=1)
    batches = list(DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=passthrough))
    firsts = max(workers, 1)  # without workers the main process is the one worker
    rest = 17 - firsts
    assert [batch.records for batch in batches] == [1] * firsts + [3] * (rest // 3) + ([rest % 3] if rest % 3 else [])
    assert [index for batch in batches for index in record_indices(batch)] == list(range(2, 19))


@pytest.mark.slow  # in the default run: cli/test_preprocess_imports.py asks the same of its image runs' process
def test_a_run_with_images_never_imports_transformers(tmp_path, sample_tokenizer_path):
    """The fast image paths make transformers (seconds, hundreds of MB per process) unnecessary."""
    import subprocess
    import sys

    from tests.conftest import SAMPLE_DATA

    code = (
        "import sys\nfrom neva_pack.cli import main\n"
        f"code = main(['preprocess', '--quiet', '--data_path', {str(SAMPLE_DATA / 'llava_sample.json')!r}, "
        f"'--image_folder', {str(SAMPLE_DATA / 'images')!r}, '--tokenizer_path', {str(sample_tokenizer_path)!r}, "
        f"'--output_dir', {str(tmp_path / 'out')!r}, '--image_aspect_ratio', 'pad', '--num_workers', '0'])\n"
        "print(code, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split()[-2:] == ["0", "False"]
