"""Images whose headers lie, for every family that counts an image's tokens from its header size
(Qwen2-VL, Qwen3-VL, Gemma 4, InternVL, LLaVA-OneVision). By class, at random: a valid PNG, JPEG, WebP, GIF,
BMP or TIFF whose declared size was rewritten (IHDR, SOF, the VP8X canvas, the logical screen, BMP's
info header, a second IHDR or SOF), or whose bytes were overwritten or cut. The plan made from headers
(``SampleBuilder.layout``, what ``neva-pack plan --data_path`` counts) and the built sample agree: both
skip it with the same reason, or the sample is the layout (length, image runs, vision cost), or only the
decode finds the damage and the record is an image skip, named. Never an exception, never a sample
whose images hold another number of tokens than its plan."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from neva_pack.families import (
    ImageSource,
    dynamic_image_run,
    dynamic_processor,
    resolve_encoder,
)
from neva_pack.records import RawRecord
from neva_pack.samples import SampleBuilder, Skipped
from neva_pack.text import load_template, load_tokenizer
from tests.conftest import ROOT
from tests.dynamic_references import STAND_IN_TOKENIZER, stand_in_tokenizer

IMAGE_SKIPS = {"unreadable_image", "image_too_large", "image_too_slow"}
FAMILIES = {  # encoder -> its template (the file in this checkout's templates/)
    "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl",
    "Qwen/Qwen3-VL-2B-Instruct": "qwen3_vl",
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": "qwen_1_5",
    "google/gemma-4-E2B-it": "gemma4",
    "OpenGVLab/InternVL3_5-1B-HF": "internvl",
}


def _picture(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _sof(data: bytes) -> int:
    at = 2
    while data[at + 1] not in (0xC0, 0xC1, 0xC2):
        at += 2 + struct.unpack_from(">H", data, at + 2)[0]
    return at


def lie(data: bytes, fmt: str, width: int, height: int, how: str) -> bytes:
    """``data`` (a valid file of ``fmt``) declaring ``width`` x ``height`` where it states its size (at most
    what the field holds: 16 bits in JPEG and GIF, 24 in WebP's canvas, 31 elsewhere)."""
    largest = {"JPEG": 65535, "GIF": 65535, "WEBP": 1 << 24}.get(fmt, 2**31 - 1)
    width, height = min(width, largest), min(height, largest)
    if fmt == "PNG":
        ihdr = _chunk(b"IHDR", struct.pack(">II", width, height) + data[24:29])
        return data[:8] + ihdr + (data[33:] if how == "replace" else data[8:])  # "add": a second IHDR after ours
    if fmt == "JPEG":
        at = _sof(data)
        segment = data[at : at + 2 + struct.unpack_from(">H", data, at + 2)[0]]
        lying = segment[:5] + struct.pack(">HH", height, width) + segment[9:]
        return data[:at] + (lying if how == "replace" else segment + lying) + data[at + len(segment) :]
    if fmt == "WEBP":  # a VP8X canvas around the frame
        canvas = b"VP8X" + struct.pack("<I", 10) + bytes(4) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
        payload = b"WEBP" + canvas + data[12:]
        return b"RIFF" + struct.pack("<I", len(payload)) + payload
    if fmt == "GIF":
        return data[:6] + struct.pack("<HH", width, height) + data[10:]
    if fmt == "BMP":
        return data[:18] + struct.pack("<ii", width, height if how == "replace" else -height) + data[26:]
    assert fmt == "TIFF"
    return data.replace(struct.pack("<HHII", 256, 3, 1, 48), struct.pack("<HHII", 256, 3, 1, width), 1)


@st.composite
def hostile_images(draw) -> bytes:
    fmt = draw(st.sampled_from(["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"]))
    width, height = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    data = _saved(_picture(width, height).convert("P" if fmt == "GIF" else "RGB"), fmt)
    kind = draw(st.sampled_from(["lie", "lie", "bytes", "cut", "none"]))
    if kind == "lie":
        sizes = st.one_of(st.integers(0, 300), st.sampled_from([1, 2, 16383, 65535, 2**31 - 1]))
        return lie(data, fmt, draw(sizes) or 1, draw(sizes) or 1, draw(st.sampled_from(["replace", "add"])))
    if kind == "bytes":
        at = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        return data[:at] + junk + data[at + len(junk) :]
    if kind == "cut":
        return data[: draw(st.integers(1, len(data) - 1))]
    return data


@pytest.fixture(scope="module")
def builders(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    from tests.families import test_gemma4, test_internvl

    folder = tmp_path_factory.mktemp("hostile_dynamic")
    tokenizer = load_tokenizer(stand_in_tokenizer(folder, "qwen"))
    extended = Tokenizer.from_file(str(STAND_IN_TOKENIZER))
    extended.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*test_gemma4.SPECIALS, *test_internvl.SPECIALS)])
    (folder / "ext").mkdir()
    extended.save(str(folder / "ext" / "tokenizer.json"))
    (folder / "ext" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<|im_end|>"}))
    extended_tokenizer = load_tokenizer(folder / "ext")
    made = {}
    for name, template in FAMILIES.items():
        encoder = resolve_encoder(name)
        tok = tokenizer if encoder.family in ("native", "anyres") else extended_tokenizer
        made[name] = SampleBuilder(tokenizer=tok, template=load_template(str(ROOT / "templates" / f"{template}.yaml"), "nemo"), image_source=ImageSource(folder),
                                   preprocessor=dynamic_processor(encoder), image_run=dynamic_image_run(tok, encoder.family),
                                   max_seq_length=100_000)  # fmt: skip
    return folder, made


@pytest.mark.parametrize("encoder", sorted(FAMILIES))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hostile_images())
def test_a_lying_or_damaged_image_is_planned_as_it_is_built(builders, encoder, data):
    planned_as_built(builders, encoder, data)


@pytest.mark.slow
@pytest.mark.parametrize("encoder", sorted(FAMILIES))
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hostile_images())
def test_many_lying_or_damaged_images_are_planned_as_they_are_built(builders, encoder, data):
    planned_as_built(builders, encoder, data)


def planned_as_built(builders, encoder, data):
    folder, made = builders
    (folder / "x.img").write_bytes(data)
    builder = made[encoder]
    raw = RawRecord(index=0, value={"id": "r", "image": "x.img",
                                    "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A thing."}]})  # fmt: skip
    layout, sample = builder.layout(raw), builder.build(raw)
    if isinstance(layout, Skipped):
        assert isinstance(sample, Skipped) and (sample.reason, sample.detail) == (layout.reason, layout.detail), (layout, sample)
        assert layout.reason in IMAGE_SKIPS and "\n" not in layout.detail, layout
        return
    if isinstance(sample, Skipped):  # only the decode meets the damage: the record's image skip, named
        assert sample.reason in IMAGE_SKIPS and sample.detail.startswith("x.img: ") and "\n" not in sample.detail, sample
        return
    assert (layout.length, layout.vision_cost, layout.num_images) == (sample.length, sample.vision_cost, len(sample.images))
    np.testing.assert_array_equal(layout.image_tokens, sample.image_tokens)
