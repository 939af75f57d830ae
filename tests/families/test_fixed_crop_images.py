"""Image loading and CLIP/SigLIP preprocessing on real photos from registry wheels
(scikit-image and matplotlib sample data: public domain / CC0)."""

import importlib.resources
import io
import tarfile
import time

import numpy as np
import pytest
from PIL import Image

from neva_pack.families import ImageSource, decode_image, known_encoders, resolve_encoder
from neva_pack.core import ConfigError
from neva_pack.families.fixed import crop_size, encoder_tokens, expand_to_square, ImagePreprocessor
from neva_pack.records import RecordError

SKIMAGE = importlib.resources.files("skimage") / "data"
MPL = importlib.resources.files("matplotlib") / "mpl-data" / "sample_data"
PHOTOS = {
    "astronaut.png": "RGB 512x512",
    "coffee.png": "RGB 600x400, landscape",
    "camera.png": "L (grayscale)",
    "text.png": "L, 448x172, aspect 2.6",
    "logo.png": "RGBA",
    "horse.png": "RGBA/LA binary mask",
    "no_time_for_that_tiny.gif": "P (palette), animated, 14x25",
    "hubble_deep_field.jpg": "JPEG with ICC profile",
}


def photo_bytes(name: str) -> bytes:
    return (SKIMAGE / name).read_bytes()


@pytest.fixture(scope="module")
def clip336():
    return resolve_encoder("openai/clip-vit-large-patch14-336")


@pytest.mark.parametrize("name", sorted(PHOTOS))
@pytest.mark.parametrize("aspect", ["square", "pad"])
def test_every_mode_becomes_rgb_uint8_of_the_crop_size(clip336, name, aspect):
    image = decode_image(photo_bytes(name), name)
    assert image.mode == "RGB"
    pixels = ImagePreprocessor(clip336, aspect).to_uint8(image)
    assert pixels.shape == (3, 336, 336) and pixels.dtype == np.uint8


def test_two_halves_equal_the_processor_in_one_call(clip336):
    """uint8 stored, normalised at write time == transformers' processor on the photo directly."""
    from transformers.models.clip import CLIPImageProcessorPil

    image = decode_image((MPL / "grace_hopper.jpg").read_bytes(), "grace_hopper.jpg")
    pre = ImagePreprocessor(clip336, "square")
    ours = pre.normalize(pre.to_uint8(image)[None])[0]
    reference = CLIPImageProcessorPil(**{k: v for k, v in clip336.preprocessor_config.items() if k != "image_processor_type"})
    expected = reference(images=image, return_tensors="np")["pixel_values"][0]
    assert ours.dtype == np.float32
    assert np.array_equal(ours, expected)


def test_clip_normalisation_golden_values(clip336):
    pre = ImagePreprocessor(clip336, "square")
    pixels = np.zeros((1, 3, 336, 336), dtype=np.uint8)
    pixels[0, :, 0, 0] = 255
    out = pre.normalize(pixels)[0]
    mean = np.array([0.48145466, 0.4578275, 0.40821073])
    std = np.array([0.26862954, 0.26130258, 0.27577711])
    np.testing.assert_allclose(out[:, 0, 0], (1 - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(out[:, 1, 1], -mean / std, rtol=1e-6)


def test_pad_expands_to_a_square_with_the_mean_colour(clip336):
    text = decode_image(photo_bytes("text.png"), "text.png")  # 448x172
    padded = expand_to_square(text, (122, 116, 104))
    assert padded.size == (448, 448)
    assert padded.getpixel((0, 0)) == (122, 116, 104)
    pixels = ImagePreprocessor(clip336, "pad").to_uint8(text)
    assert tuple(pixels[:, 0, 0]) == (122, 116, 104)  # top rows are padding, LLaVA's int(mean * 255)
    square = ImagePreprocessor(clip336, "square").to_uint8(text)
    assert tuple(square[:, 0, 0]) != (122, 116, 104)


def test_rgba_alpha_is_dropped_not_composited():
    """LLaVA/NeMo: Image.open(...).convert('RGB') keeps the colour under transparent pixels."""
    rgba = Image.new("RGBA", (4, 4), (10, 200, 30, 0))
    buffer = io.BytesIO()
    rgba.save(buffer, format="PNG")
    assert decode_image(buffer.getvalue(), "t.png").getpixel((0, 0)) == (10, 200, 30)


def test_a_2x1_image_is_processed(clip336):
    tiny = Image.new("RGB", (2, 1), (255, 0, 0))
    pixels = ImagePreprocessor(clip336, "square").to_uint8(tiny)
    assert pixels.shape == (3, 336, 336)
    assert tuple(pixels[:, 100, 100]) == (255, 0, 0)


def test_siglip_resizes_without_crop():
    siglip = resolve_encoder("google/siglip-so400m-patch14-384")
    assert crop_size(siglip) == (384, 384) and encoder_tokens(siglip) == 729
    image = decode_image(photo_bytes("coffee.png"), "coffee.png")
    pre = ImagePreprocessor(siglip, "square")
    out = pre.normalize(pre.to_uint8(image)[None])
    assert out.shape == (1, 3, 384, 384) and -1.0 <= out.min() and out.max() <= 1.0


@pytest.mark.parametrize(
    "name, tokens", [("openai/clip-vit-large-patch14-336", 576), ("openai/clip-vit-large-patch14", 256),
                     ("google/siglip-so400m-patch14-384", 729)]
)
def test_image_token_counts_of_well_known_encoders(name, tokens):
    assert encoder_tokens(resolve_encoder(name)) == tokens
    assert name in known_encoders()


def test_local_encoder_directory(tmp_path, clip336):
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(clip336.preprocessor_config))
    with pytest.raises(ConfigError, match="patch size unknown"):
        resolve_encoder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14}}))
    spec = resolve_encoder(str(tmp_path))
    assert spec.processor == "clip" and encoder_tokens(spec) == 576


def test_unknown_encoder_never_downloads():
    with pytest.raises(ConfigError, match="never downloads"):
        resolve_encoder("facebook/dinov2-large")


def test_corrupt_and_non_image_files_are_unreadable():
    with pytest.raises(RecordError) as caught:
        decode_image(b"this is not an image", "notes.txt")
    assert caught.value.reason == "unreadable_image"
    truncated_jpeg = (MPL / "grace_hopper.jpg").read_bytes()[:2000]
    with pytest.raises(RecordError) as caught:
        decode_image(truncated_jpeg, "cut.jpg")
    assert caught.value.reason == "unreadable_image"


def _sequential_jpeg_of_empty_scans(side: int, scans: int) -> bytes:
    """A baseline (sequential) JPEG of ``side`` x ``side`` whose luma is scanned ``scans`` times with
    no coded data: each scan header (10 bytes) makes the decoder walk every luma block again."""
    small = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(small, "JPEG", quality=90)
    data, at, head = small.getvalue(), 2, bytearray(small.getvalue()[:2])
    while data[at : at + 2] != b"\xff\xda":  # every segment before the first scan, the frame's size patched
        segment = bytearray(data[at : at + 2 + int.from_bytes(data[at + 2 : at + 4], "big")])
        if segment[:2] == b"\xff\xc0":
            segment[5:9] = side.to_bytes(2, "big") * 2
        head += segment
        at += len(segment)
    luma_scan = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"
    return bytes(head) + luma_scan * scans + b"\xff\xd9"


def test_jpegs_of_many_scans_are_stopped_by_the_decode_budget_or_refused():
    """A baseline JPEG whose first scan holds every component is decoded in larger chunks than other
    files: its decoder refuses any later scan. One whose first scan holds the luma only may have
    thousands (each walking a 36-megapixel image again): the budget must still stop it."""
    image = decode_image(_sequential_jpeg_of_empty_scans(64, 3), "few.jpg")  # a valid file: it decodes
    assert image.size == (64, 64) and image.mode == "RGB"
    started = time.thread_time()
    with pytest.raises(RecordError) as caught:
        decode_image(_sequential_jpeg_of_empty_scans(6000, 5000), "scans.jpg", max_seconds=0.2)
    assert caught.value.reason == "image_too_slow"
    assert time.thread_time() - started < 2.0  # stopped within a few scans of the budget, not after all of a chunk's
    one_scan = io.BytesIO()
    Image.new("RGB", (2000, 2000), (10, 200, 30)).save(one_scan, "JPEG", quality=90)
    data = one_scan.getvalue()
    scan = data[data.index(b"\xff\xda") : -2]
    with pytest.raises(RecordError) as caught:
        decode_image(data[:-2] + scan * 1000 + data[-2:], "rescanned.jpg", max_seconds=0.2)
    assert caught.value.reason == "unreadable_image"


def test_folder_source_missing_file(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"x")
    source = ImageSource(tmp_path)
    assert source.read("a.jpg") == b"x"
    with pytest.raises(RecordError) as caught:
        source.read("b.jpg")
    assert caught.value.reason == "missing_image"
    with pytest.raises(RecordError) as caught:
        ImageSource(None).read("a.jpg")
    assert caught.value.reason == "missing_image"


def test_tar_source_is_indexed_once_and_pickles_without_the_file_handle(tmp_path):
    import pickle

    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("coffee.png", "camera.png"):
            info = tarfile.TarInfo(f"./sub/{name}")
            data = photo_bytes(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    source = ImageSource(archive)
    assert source.read("sub/coffee.png") == photo_bytes("coffee.png")
    clone = pickle.loads(pickle.dumps(source))
    assert clone.read("sub/camera.png") == photo_bytes("camera.png")
    with pytest.raises(RecordError) as caught:
        clone.read("sub/missing.png")
    assert caught.value.reason == "missing_image"


def test_bad_image_folder_is_a_config_error(tmp_path):
    not_tar = tmp_path / "x.txt"
    not_tar.write_text("hello")
    with pytest.raises(ConfigError, match="not a directory or a .tar archive"):
        ImageSource(not_tar)
    with pytest.raises(ConfigError, match="choose one of square, pad"):
        ImagePreprocessor(resolve_encoder("openai/clip-vit-large-patch14"), "stretch")
