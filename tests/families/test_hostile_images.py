"""Hostile images: an image that is too large (in its header, its padded or resized size, its
bytes), not a regular file, damaged in any way or slow to decode is that record's skip, named,
found without reading it whole; the rest of the run is packed and verifies. The harness:
tests/hostile_inputs.py."""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from benchmarks.bench_hostile import (  # the same hostile files the benchmark measures
    blp_unknown_encoding,
    dds_unknown_pixel_format,
    jpeg_claiming,
    progressive_jpeg_with_scans,
)
from benchmarks.bench_hostile_images import (  # the classes the decoder benchmark measures
    animated_gif,
    apng,
    deflate_tiff_at_budget,
    eps_file,
    icns_file,
    ico_holding_png,
    jpeg_in_tiff,
    jpeg_with_exif_thumbnail,
    mpo_with_large_second_frame,
    multipage_tiff,
    png_zlib_bomb,
    psd_file,
    rle_bmp,
    webp_declaring,
)
from neva_pack.files import skipped_path
from neva_pack.records import RecordError
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import (  # noqa: F401 (images: the fixture)
    GOOD,
    HOSTILE_AT,
    NoCapture,
    image_record,
    images,
    png_bytes,
    run_on,
    run_with,
    skip_detail,
    write_data,
)


# ---------------------------------------------------------------------------------------------
# Hostile files: too large, not regular files


def wide_png(folder: Path) -> str:
    (folder / "wide.png").write_bytes(png_bytes(20_000, 1))  # ~100 bytes; 400 Mpx padded, 336 x 6.7M resized
    return "wide.png"


def fifo(folder: Path) -> str:
    os.mkfifo(folder / "x.jpg")  # opening it for reading would block forever
    return "x.jpg"


IMAGE_CASES = {
    "/dev/zero (outside the folder)": (lambda folder: "/dev/zero", (), "outside_image_folder"),
    "/dev/zero allowed outside: not a regular file": (lambda folder: "/dev/zero", ("--allow_outside_image_folder",),
                                                      "unreadable_image"),
    "a FIFO named x.jpg": (fifo, (), "unreadable_image"),
    "20000x1 PNG, square": (wide_png, (), "image_too_large"),
    "20000x1 PNG, pad": (wide_png, ("--image_aspect_ratio", "pad"), "image_too_large"),
    "over --max_image_bytes": (lambda folder: "chelsea.jpg", ("--max_image_bytes", "1000"), "image_too_large"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_a_hostile_image_is_skipped_without_reading_it_whole(tmp_path, capsys, images, case):
    make, extra, reason = IMAGE_CASES[case]
    run = run_with(tmp_path, capsys, images, image_record(make(images)), *extra, "--max_skip_fraction", "1")
    assert run.code == 0, run.err
    skipped = set(run.reasons.values())
    assert run.reasons.get(HOSTILE_AT) == reason
    assert skipped == {reason}  # with --max_image_bytes 1000, the good image record is skipped too
    assert run.verified


def test_the_image_budget_names_the_limit_and_the_flag(tmp_path, capsys, images):
    run = run_with(tmp_path, capsys, images, image_record(wide_png(images)), "--image_aspect_ratio", "pad")
    detail = json.loads(skipped_path(run.out).read_text())["detail"]
    assert detail == "wide.png: padded to 20000 x 20000 = 400,000,000 pixels > --max_image_pixels 36,000,000"


def test_a_16_bit_grayscale_png_is_scaled_not_whitened():
    from neva_pack.families import decode_image

    ramp = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16).astype(np.uint16)
    image = decode_image(png_bytes(64, 64, array=ramp), "ramp.png")
    pixels = np.asarray(image)
    assert image.mode == "RGB" and np.array_equal(pixels[..., 0], (ramp >> 8).astype(np.uint8))


def test_a_108_megapixel_jpeg_is_image_too_large_naming_the_limit_and_flag(tmp_path, capsys, images):
    (images / "huge.jpg").write_bytes(jpeg_claiming(12_000, 9_000))
    run = run_with(tmp_path, capsys, images, image_record("huge.jpg"))
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "image_too_large"}
    detail = json.loads(skipped_path(run.out).read_text())["detail"]
    assert detail == "huge.jpg: 12000 x 9000 = 108,000,000 pixels > --max_image_pixels 36,000,000"
    assert run.verified


def test_an_image_over_pils_own_limit_is_image_too_large_and_a_larger_budget_lifts_it(tmp_path, capsys, images, monkeypatch):
    from neva_pack.families import decode_image

    (images / "vast.jpg").write_bytes(jpeg_claiming(15_000, 15_000))  # PIL refuses over 178,956,970 in open
    run = run_with(tmp_path, capsys, images, image_record("vast.jpg"))
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "image_too_large"}
    detail = json.loads(skipped_path(run.out).read_text())["detail"]
    assert detail == "vast.jpg: size = 225,000,000 pixels > --max_image_pixels 36,000,000"
    # a budget the user raised above PIL's limit is the one checked, from the header, as below it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    with pytest.raises(RecordError) as caught:
        decode_image(jpeg_claiming(15_000, 15_000), "vast.jpg", max_pixels=200_000_000)
    assert (caught.value.reason, caught.value.detail) == (
        "image_too_large", "vast.jpg: 15000 x 15000 = 225,000,000 pixels > --max_image_pixels 200,000,000")


# ---------------------------------------------------------------------------------------------
# An image can fail to decode in any way, or decode slowly: one record's skip, named


NOT_DECODED = "a format not decoded here (only JPEG, PNG, GIF, BMP, TIFF, WEBP)"

DECODER_CASES = {
    "BLP, a format not vetted": (
        "odd.blp", blp_unknown_encoding, (), "unreadable_image", f"odd.blp: BLP (by its first bytes), {NOT_DECODED}"),
    "DDS, a format not vetted": ("odd.dds", dds_unknown_pixel_format, (), "unreadable_image", f"odd.dds: DDS (by its first bytes), {NOT_DECODED}"),
    "ICO decoding a PNG of 2,000 x 2,000 inside Image.open": (
        "big.ico", lambda: ico_holding_png(2_000), ("--max_image_pixels", "1000000"), "unreadable_image",
        f"big.ico: ICO (by its first bytes), {NOT_DECODED}"),
    "a damaged BMP (struct.error or the like from a vetted decoder)": (
        "odd.bmp", lambda: rle_bmp(64, 64)[:60], (), "unreadable_image", None),
    "bytes no decoder knows (no object address in the detail)": (
        "x.jpg", lambda: b"not an image at all", (), "unreadable_image",
        "x.jpg: UnidentifiedImageError: cannot identify image file x.jpg"),
    "progressive JPEG of 400 repeated scans": (
        "slow.jpg", lambda: progressive_jpeg_with_scans(2_000, 2_000, 400), ("--max_image_decode_seconds", "0.2"),
        "image_too_slow", "slow.jpg: decoding took more than --max_image_decode_seconds 0.2 (CPU time)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DECODER_CASES))
def test_any_decoder_failure_or_slow_decode_is_that_records_skip_named(tmp_path, capsys, images, case):
    name, make, extra, reason, detail = DECODER_CASES[case]
    (images / name).write_bytes(make())
    run = run_with(tmp_path, capsys, images, image_record(name), *extra)
    assert run.code == 0, run.err
    assert run.reasons == {HOSTILE_AT: reason}
    assert detail is None or skip_detail(run) == detail
    assert run.verified

HOSTILE_CLASSES = {
    "decodes inside open: ICO holding a PNG over the budget": (lambda: ico_holding_png(1_200), "unreadable_image", "unreadable_image"),
    "allocates inside open: WebP declaring a canvas over the budget": (lambda: webp_declaring(4_000, 4_000), "image_too_large", (4_000, 4_000)),
    "multi-frame: GIF, the first frame decoded": (lambda: animated_gif(300, 40), (300, 300), (300, 300)),
    "multi-frame: APNG, the first frame decoded": (lambda: apng(300, 20), (300, 300), (300, 300)),
    "multi-frame: TIFF of 200 pages, the first decoded": (lambda: multipage_tiff(200), (64, 64), (64, 64)),
    "embedded preview: MPO whose second frame is over the budget": (lambda: mpo_with_large_second_frame(1_500), (640, 480), (640, 480)),
    "embedded preview: JPEG with an EXIF thumbnail": (jpeg_with_exif_thumbnail, (640, 480), (640, 480)),
    "one decoder call: JPEG-in-TIFF refused": (lambda: jpeg_in_tiff(64), "unreadable_image", "unreadable_image"),
    "one decoder call: Deflate TIFF at the budget": (lambda: deflate_tiff_at_budget(1_000, 1_000), (1_000, 1_000), (1_000, 1_000)),
    "decoder in Python: RLE BMP at the budget": (lambda: rle_bmp(1_000, 1_000), (1_000, 1_000), (1_000, 1_000)),
    "zlib bomb: PNG over the budget": (lambda: png_zlib_bomb(1_500, 1_500), "image_too_large", (1_500, 1_500)),
    "not vetted: PSD": (psd_file, "unreadable_image", "unreadable_image"),
    "not vetted: ICNS": (icns_file, "unreadable_image", "unreadable_image"),
    "not vetted: EPS, never handed to Ghostscript": (eps_file, "unreadable_image", "unreadable_image"),
}  # fmt: skip
"""Each class of hostile image (benchmarks/bench_hostile_images.py measures each at full size against
the budgets): what decoding it under a budget of 1,000,000 pixels gives, and what its header read gives."""


@pytest.mark.parametrize("case", sorted(HOSTILE_CLASSES))
def test_every_decoder_is_bounded_before_it_decodes(case):
    from neva_pack.families import decode_image, header_size

    make, decoded, header = HOSTILE_CLASSES[case]
    data = make()
    for outcome, run in ((decoded, lambda: decode_image(data, "x.img", max_pixels=1_000_000).size), (header, lambda: header_size(data, "x.img"))):
        if isinstance(outcome, str):
            with pytest.raises(RecordError) as caught:
                run()
            assert caught.value.reason == outcome, caught.value.detail
            assert outcome != "unreadable_image" or "a format not decoded here" in caught.value.detail or "compressed with" in caught.value.detail
        else:
            assert tuple(run()) == outcome


def test_a_slow_image_in_a_worker_is_stopped_and_the_workers_later_records_are_packed(tmp_path, capsys, images):
    (images / "slow.jpg").write_bytes(progressive_jpeg_with_scans(2_000, 2_000, 400))
    records = [image_record("slow.jpg"), *GOOD, GOOD[1]]
    data = write_data(tmp_path / "data.jsonl", records, "jsonl")
    run = run_on(tmp_path, capsys, data, images, "--num_workers", "1", "--max_image_decode_seconds", "0.2")
    assert run.code == 0, run.err
    assert run.reasons == {0: "image_too_slow"}  # the worker went on: records 1..4 are packed
    assert run.verified


def test_the_skip_report_is_the_same_bytes_in_two_runs_of_the_same_input(tmp_path, capsys, images):
    (images / "x.jpg").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    data = write_data(tmp_path / "data.jsonl", [GOOD[0], image_record("x.jpg"), GOOD[1]], "jsonl")
    reports = []
    for attempt in ("first", "second"):
        (tmp_path / attempt).mkdir()
        run = run_on(tmp_path / attempt, capsys, data, images)
        assert run.code == 0 and run.reasons == {1: "unreadable_image"}
        reports.append(skipped_path(run.out).read_bytes())
    assert reports[0] == reports[1] and b" at 0x" not in reports[0]


@functools.cache
def valid_image(fmt: str) -> bytes:
    """A small picture saved in ``fmt``, in the first mode PIL's writer for it accepts."""
    gradient = np.add.outer(np.arange(24), np.arange(32)).astype(np.uint8) * 4
    picture = Image.fromarray(np.stack([gradient, gradient[::-1], 255 - gradient], axis=-1))
    for mode in ("RGB", "P", "L", "1", "F"):
        buffer = io.BytesIO()
        try:
            picture.convert(mode).save(buffer, fmt)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return buffer.getvalue()
    raise AssertionError(f"PIL cannot write {fmt}")


def _writable_formats() -> list[str]:
    Image.init()
    formats = []
    for fmt in ("BLP", "BMP", "DDS", "GIF", "ICO", "JPEG", "JPEG2000", "MSP", "PCX", "PNG", "PPM", "QOI",
                "SGI", "SPIDER", "TGA", "TIFF", "WEBP", "XBM"):  # fmt: skip
        try:
            valid_image(fmt)
        except (AssertionError, KeyError):  # a format this PIL build cannot write (no codec)
            continue
        formats.append(fmt)
    return formats


FORMATS = _writable_formats()
IMAGE_SKIPS = {"unreadable_image", "image_too_large", "image_too_slow"}


@st.composite
def damaged_images(draw) -> bytes:
    """Random bytes, or a valid file of a random PIL format with random bytes overwritten and/or
    its end cut off (the header often survives: the decoder itself meets the damage)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(valid_image(draw(st.sampled_from(FORMATS))))
    for _ in range(draw(st.integers(0, 4))):
        position = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        data[position : position + len(junk)] = junk
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=300, deadline=None)
@given(data=damaged_images())
def test_property_any_damaged_image_decodes_to_rgb_or_is_one_named_skip(data):
    from neva_pack.families import decode_image

    try:
        image = decode_image(data, "x.img", max_seconds=5)
    except RecordError as error:
        assert error.reason in IMAGE_SKIPS
        assert error.detail.startswith("x.img: ") and "\n" not in error.detail and " at 0x" not in error.detail
    else:
        assert image.mode == "RGB" and image.width * image.height > 0


@settings(max_examples=8, deadline=None)
@given(data=damaged_images())
def test_property_a_run_over_a_damaged_image_packs_the_rest_and_verifies(tmp_path_factory, data):
    tmp_path = tmp_path_factory.mktemp("damaged")
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", folder)
    (folder / "x.img").write_bytes(data)
    run = run_with(tmp_path, NoCapture(), folder, image_record("x.img"))
    assert run.code == 0, run.err
    assert set(run.reasons) <= {HOSTILE_AT} and set(run.reasons.values()) <= IMAGE_SKIPS
    assert run.verified
