"""A plan reads each image's header only: ``ImageSource.open`` gives the file (a folder's or an archive
member's) unread, with ``read``'s confinement, budget and skips; PIL reads from it only as far as the
header goes; and a record a layout skips is skipped by its build for the same reason with the same
detail, which names the image (never "image bytes").
"""

from __future__ import annotations

import json
import shutil
import tarfile

import numpy as np
import pytest

from neva_pack.config import PackConfig, RecordBudgets, SampleConfig
from neva_pack.families import ImageSource, dynamic_image_run, dynamic_processor, header_size, resolve_encoder
from neva_pack.pipeline import sample_builder_for
from neva_pack.records import RecordError, iter_raw_records
from neva_pack.samples import SampleBuilder, Skipped
from neva_pack.text import load_template, load_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA
from tests.image_zoo import random_rgb

BIG = (1600, 1200)
"""A noise JPEG of this size is megabytes: its header is a sliver of it."""
BAD = {
    "junk.jpg": b"\xff\xd8\xff" + bytes(range(256)) * 4,  # a JPEG's magic, then no header
    "notes.png": b"not an image at all\n",
}


@pytest.fixture(scope="module", params=["folder", "tar"])
def images(request, tmp_path_factory):
    """Good images (a big noise JPEG, the sample photos), unreadable headers, a file over a 3 MB
    budget; as a folder, or the same files as an uncompressed .tar archive."""
    root = tmp_path_factory.mktemp("header_reads")
    folder = root / "images"
    folder.mkdir()
    random_rgb(*BIG, seed=1).save(folder / "big.jpg", quality=95)
    for photo in ("astronaut.jpg", "chelsea.jpg"):
        shutil.copy(SAMPLE_DATA / "images" / photo, folder / photo)
    for name, data in BAD.items():
        (folder / name).write_bytes(data)
    (folder / "huge.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(4 << 20))
    if request.param == "folder":
        return folder
    archive = root / "images.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return archive


def test_an_opened_image_is_its_bytes_and_its_header_is_read_from_its_first_bytes(images):
    source = ImageSource(images, max_bytes=3 << 20)
    data = source.read("big.jpg")
    assert len(data) > 1 << 20
    with source.open("big.jpg") as file:
        assert file.read() == data
    with source.open("big.jpg") as file:
        assert header_size(file, "big.jpg") == BIG
        assert file.raw.tell() <= 64 << 10  # bytes taken from the file system: the header's, not the image's


@pytest.mark.parametrize("name", ["nope.jpg", "../astronaut.jpg", "/etc/hostname", "huge.png"])
def test_open_refuses_what_read_refuses_with_the_same_reason_and_detail(images, name):
    source = ImageSource(images, max_bytes=3 << 20)
    with pytest.raises(RecordError) as read:
        source.read(name)
    with pytest.raises(RecordError) as opened:
        source.open(name)
    assert (opened.value.reason, opened.value.detail) == (read.value.reason, read.value.detail)
    assert opened.value.detail.startswith(f"{name}: ")


def records(path, names: list[str]):
    """One record per image name (the sample photos' question and answer)."""
    items = []
    for k, name in enumerate(names):
        conversations = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A picture."}]
        items.append({"id": f"{k}-{name}", "images": [name], "conversations": conversations})
    path.write_text(json.dumps(items))
    return path


def fixed_builder(images, tmp_path) -> SampleBuilder:
    sample = SampleConfig(
        data_path=tmp_path / "data.json", image_folder=images, tokenizer_path=SAMPLE_DATA / "tokenizer.model",
        conv_template="nvgpt", budgets=RecordBudgets(max_image_bytes=3 << 20),
    )  # fmt: skip
    return sample_builder_for(sample, PackConfig(max_seq_length=4096))


def dynamic_builder(images, tmp_path) -> SampleBuilder:
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    shutil.copy(ROOT / "tests" / "golden" / "dynamic" / "tokenizer.json", tokenizer_dir / "tokenizer.json")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = resolve_encoder("Qwen/Qwen2-VL-7B-Instruct")
    return SampleBuilder(
        tokenizer=tokenizer, template=load_template("qwen2_vl", "nemo"), image_source=ImageSource(images, max_bytes=3 << 20),
        preprocessor=dynamic_processor(encoder), image_run=dynamic_image_run(tokenizer, encoder.family),
        max_seq_length=100_000,
    )  # fmt: skip


@pytest.mark.parametrize("make_builder", [fixed_builder, dynamic_builder], ids=["fixed", "dynamic"])
def test_a_layout_skips_what_its_build_skips_before_decoding_with_the_same_detail_naming_the_image(
    images, tmp_path, make_builder
):
    names = ["big.jpg", "astronaut.jpg", *BAD, "huge.png", "nope.jpg", "../chelsea.jpg"]
    data = records(tmp_path / "data.json", names)
    builder = make_builder(images, tmp_path)
    skipped = {}
    for raw in iter_raw_records(data):
        layout, sample = builder.layout(raw), builder.build(raw)
        assert isinstance(layout, Skipped) == isinstance(sample, Skipped)
        if isinstance(layout, Skipped):
            assert (layout.reason, layout.detail) == (sample.reason, sample.detail)
            skipped[raw.record_id.split("-", 1)[1]] = layout
        else:
            assert layout.length == sample.length
            np.testing.assert_array_equal(layout.image_tokens, sample.image_tokens)
    assert {name: s.reason for name, s in skipped.items()} == {
        "junk.jpg": "unreadable_image", "notes.png": "unreadable_image", "huge.png": "image_too_large",
        "nope.jpg": "missing_image", "../chelsea.jpg": "outside_image_folder",
    }  # fmt: skip
    for name, skip in skipped.items():
        assert skip.detail.startswith(f"{name}: ") and "image bytes" not in skip.detail
    assert "UnidentifiedImageError" in skipped["notes.png"].detail


def test_a_header_read_for_a_plan_cannot_be_decoded(images, tmp_path):
    from neva_pack.samples import HeaderImages

    builder = dynamic_builder(images, tmp_path)
    loader = HeaderImages(builder.preprocessor, builder.image_source)
    (planned,) = loader.read(["astronaut.jpg"], header_only=True)
    (built,) = loader.read(["astronaut.jpg"])
    assert planned.data is None and (planned.size, planned.tokens) == (built.size, built.tokens)
    with pytest.raises(ValueError, match="astronaut.jpg: read for its header only"):
        loader.load(planned)


@pytest.mark.parametrize("kind", ["jpeg_icc", "tiff", "png", "small"])
def test_a_header_from_a_path_is_the_header_from_the_bytes_however_far_it_reaches(tmp_path, kind):
    """A path's header is parsed from one read of its first ``HEADER_READ`` bytes; one that does not end
    there (a JPEG whose ICC profile and EXIF come before its frame header) is read from the file: the
    size is the same either way, and the same as from bytes."""
    from PIL import Image

    from neva_pack.families.headers import HEADER_READ

    image = random_rgb(*((40, 30) if kind == "small" else (700, 500)), seed=2)
    path = tmp_path / f"image.{kind}"
    if kind == "jpeg_icc":
        image.save(path, "JPEG", icc_profile=bytes(range(256)) * 60, exif=b"Exif\x00\x00" + b"\x00" * 6_000)
        assert path.read_bytes().find(b"\xff\xc0") > HEADER_READ  # the frame header is past the first read
    elif kind == "tiff":
        image.save(path, "TIFF")
    else:
        image.save(path, "PNG")
    assert header_size(path) == header_size(path.read_bytes()) == image.size
    with Image.open(path) as opened:
        assert opened.size == image.size


def test_an_unreadable_header_from_a_path_is_the_same_skip_as_from_its_bytes(tmp_path):
    path = tmp_path / "junk.jpg"
    path.write_bytes(b"\xff\xd8\xff" + bytes(range(256)) * 40)  # past the first read, and no header in it
    with pytest.raises(RecordError) as from_path:
        header_size(path, "junk.jpg")
    with pytest.raises(RecordError) as from_bytes:
        header_size(path.read_bytes(), "junk.jpg")
    assert (from_path.value.reason, str(from_path.value)) == (from_bytes.value.reason, str(from_bytes.value))
