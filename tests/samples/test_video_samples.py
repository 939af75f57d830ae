"""Records with video clips (LLaVA-Video / ms-swift / LLaMA-Factory style: ``video`` / ``videos`` beside
``image``, ``<video>`` in the text) built into samples: each clip's run is its family's, planned from the
container header, the clip decoded once into one stored uint8 part; images and clips keep their
placeholder order; a family that reads no video skips the record with its own reason; and a packed row
of a clip sample, an image sample and a text sample gives a tiny random Qwen2.5-VL / Qwen3-VL (float64)
the samples' one-by-one loss and gradients, while a wrong sampled fps, dropped timestamps or frames out of
order do not."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from neva_pack.families import (
    ImageSource,
    VideoRequest,
    dynamic_image_run,
    dynamic_processor,
    resolve_encoder,
)
from neva_pack.formats import ReadPack
from neva_pack.reading import dynamic_pack_item
from neva_pack.records import RawRecord, RecordError, parse_record
from neva_pack.samples import SampleBuilder, Skipped
from neva_pack.text import load_template, load_tokenizer
from tests.dynamic_references import stand_in_tokenizer
from tests.families.test_video_native import QWEN2_5, QWEN3, write_clip

TEMPLATES = {QWEN2_5: "qwen2_vl", QWEN3: "qwen3_vl"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    write_clip(folder / "clip.mp4", codec="libx264", width=64, height=48, frames=20, rate=10)
    write_clip(folder / "odd.webm", codec="libvpx-vp9", fmt="webm", width=40, height=30, frames=9, rate=5, seed=3)
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(folder / "a.png")
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(stand_in_tokenizer(tmp_path_factory.mktemp("tok"), "qwen"))


def builder(name, folder, tokenizer, videos=True, **request):
    encoder = resolve_encoder(name)
    family = dynamic_processor(encoder)
    if videos:
        family = family.with_videos(VideoRequest(**request), tokenizer)
    return SampleBuilder(tokenizer=tokenizer, template=load_template(TEMPLATES[name]), image_source=ImageSource(folder),
                         preprocessor=family, image_run=dynamic_image_run(tokenizer, encoder.family), max_seq_length=100_000)  # fmt: skip


def record(conversations, **media):
    return RawRecord(index=0, value={"id": "r", "conversations": conversations, **media})


MIXED = record([{"from": "human", "value": "<video>\nand <image> and <video>?"}, {"from": "gpt", "value": "Both."}],
               image="a.png", videos=["clip.mp4", "odd.webm"])  # fmt: skip


def test_records_name_clips_in_placeholder_order():
    conversation = parse_record(MIXED)
    assert conversation.images == ("clip.mp4", "a.png", "odd.webm") and conversation.video_slots == (0, 2)
    single = parse_record(record([{"from": "human", "value": "<video> what?"}, {"from": "gpt", "value": "x"}], video="clip.mp4"))
    assert single.images == ("clip.mp4",) and single.video_slots == (0,)
    for bad, reason in (
        (record([{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]), "placeholder_mismatch"),
        (record([{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}], video="clip.mp4"), "placeholder_mismatch"),
        (record([{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}], video="a", videos=["b"]), "malformed_record"),
        (record([{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "<video>"}], video="clip.mp4"), "placeholder_mismatch"),
    ):
        with pytest.raises(RecordError) as caught:
            parse_record(bad)
        assert caught.value.reason == reason


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_a_mixed_record_keeps_each_clip_run_and_its_frames(name, folder, tokenizer):
    build = builder(name, folder, tokenizer)
    sample = build.build(MIXED)
    assert not isinstance(sample, Skipped), sample
    clips = [image for image in sample.images if image.frames]
    assert [bool(image.frames) for image in sample.images] == [True, False, True]
    family = build.preprocessor
    for clip, (file, (count, fps, width, height)) in zip(clips, [("clip.mp4", (20, 10.0, 64, 48)), ("odd.webm", (9, 5.0, 40, 30))]):
        plan = family.plan_video(count, fps, width, height, tokenizer)
        assert clip.frames == len(plan.indices) and clip.parts[0].shape == (3, len(plan.indices) * plan.size[0], plan.size[1])
        assert clip.size == (width, height)
        start = sample.image_starts[sample.images.index(clip)]
        assert sample.tokens[start : start + len(plan.ids)].tolist() == plan.ids.tolist()
    layout = build.layout(MIXED)
    assert layout.length == sample.length and layout.vision_cost == sample.vision_cost
    assert layout.image_tokens.tolist() == sample.image_tokens.tolist()


def test_a_family_reading_no_video_skips_the_record_with_its_own_reason(folder, tokenizer):
    skipped = builder(QWEN2_5, folder, tokenizer, videos=False).build(MIXED)
    assert isinstance(skipped, Skipped) and skipped.reason == "videos_not_read"


def test_hostile_clips_are_skips_with_their_own_reasons(folder, tokenizer, tmp_path):
    (tmp_path / "audio.mp4").write_bytes((folder / "clip.mp4").read_bytes()[:200])
    (tmp_path / "noise.mp4").write_bytes(b"\x00" * 5000)
    build = builder(QWEN2_5, tmp_path, tokenizer)
    for file in ("audio.mp4", "noise.mp4"):
        skipped = build.build(record([{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}], video=file))
        assert isinstance(skipped, Skipped) and skipped.reason.startswith("video_"), skipped


def with_sample_entry_size(data: bytes, width: int, height: int) -> bytes:
    """The MP4 with its video sample entry (avc1) declaring ``width`` x ``height``; its frames as they were."""
    from tests.video_zoo import mp4_box, mp4_boxes

    def rebuilt(payload: bytes, path: tuple[bytes, ...]) -> bytes:
        out = []
        for kind, body in mp4_boxes(payload):
            if kind == path[0] and len(path) == 1:
                body = body[:24] + struct.pack(">HH", width, height) + body[28:]
            elif kind == path[0]:
                body = body[:8] + rebuilt(body[8:], path[1:]) if kind == b"stsd" else rebuilt(body, path[1:])
            out.append(mp4_box(kind, body))
        return b"".join(out)

    return rebuilt(data, (b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsd", b"avc1"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.tuples(st.integers(16, 640), st.integers(16, 480)).filter(lambda size: size != (64, 48)))
def test_a_clip_whose_header_declares_another_frame_size_is_a_frames_mismatch_skip(folder, tokenizer, tmp_path_factory, size):
    """Its tokens were counted from the header's size: frames of another size were stored resized to it
    (a sample entry of 320 x 240 over 32 x 24 frames gave 198 tokens where the model's processor counts 12)."""
    media = tmp_path_factory.mktemp("lying")
    (media / "lying.mp4").write_bytes(with_sample_entry_size((folder / "clip.mp4").read_bytes(), *size))
    skipped = builder(QWEN2_5, media, tokenizer).build(record([{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}], video="lying.mp4"))
    assert isinstance(skipped, Skipped), skipped
    if skipped.reason == "video_frames_mismatch":
        assert f"declares {size[0]} x {size[1]} frames, a decoder presents 64 x 48" in skipped.detail, skipped
    else:  # a size the header's own checks refuse first
        assert skipped.reason.startswith("video_") or skipped.reason == "unreadable_video", skipped


# ---------------------------------------------------------------- proof on tiny models


def as_pack(samples) -> tuple[ReadPack, np.ndarray]:
    """The samples laid end to end as a pack (no padding) and the visual items of each."""
    tokens = np.concatenate([s.tokens for s in samples]).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum([s.length for s in samples])]).astype(np.int64)
    images = [image for s in samples for image in s.images]
    pack = ReadPack(cu_seqlens=bounds, cu_seqlens_unpadded=bounds, tokens=tokens,
                    labels=np.concatenate([s.labels for s in samples]).astype(np.int64), pixels=None, images=None,
                    num_images=len(images), image_lengths=None, stored_images=images)  # fmt: skip
    return pack, np.array([len(s.images) for s in samples], dtype=np.int32)


def without_timestamps(sample, kept_ids):
    """The sample with each clip's run stripped of its timestamp text: only the ids in ``kept_ids`` (the
    video pads and the vision delimiters) stay in the run; its labels there were ignored, so the trained
    targets are the same ones."""
    keep = np.ones(sample.length, dtype=bool)
    for image, start, length in zip(sample.images, sample.image_starts.tolist(), sample.image_tokens.tolist()):
        if image.frames:
            run = sample.tokens[start : start + length]
            keep[start : start + length] = np.isin(run, list(kept_ids))
    removed_before = np.cumsum(~keep) - ~keep
    starts = sample.image_starts - removed_before[sample.image_starts]
    lengths = np.array([int(keep[s : s + n].sum()) for s, n in zip(sample.image_starts.tolist(), sample.image_tokens.tolist())])
    return dataclasses.replace(sample, tokens=sample.tokens[keep], labels=sample.labels[keep],
                               image_starts=starts.astype(sample.image_starts.dtype),
                               image_tokens=lengths.astype(sample.image_tokens.dtype))  # fmt: skip


def tiny_model(name, tokenizer):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    torch.manual_seed(0)
    text = {"vocab_size": tokenizer.vocab_size, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    ids = {"image_token_id": tokenizer.token_to_id("<|image_pad|>"), "video_token_id": tokenizer.token_to_id("<|video_pad|>"),
           "vision_start_token_id": tokenizer.token_to_id("<|vision_start|>"), "vision_end_token_id": tokenizer.token_to_id("<|vision_end|>")}  # fmt: skip
    if name == QWEN3:
        config = Qwen3VLConfig(text_config={**text, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
                               vision_config={"depth": 2, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 16,
                                              "patch_size": 16, "deepstack_visual_indexes": [1]}, **ids)  # fmt: skip
        model = Qwen3VLForConditionalGeneration(config)
    else:
        config = Qwen2_5_VLConfig(text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
                                  vision_config={"depth": 2, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 16,
                                                 "fullatt_block_indexes": [1], "tokens_per_second": 2, "window_size": 56}, **ids)  # fmt: skip
        model = Qwen2_5_VLForConditionalGeneration(config)
    config._attn_implementation = "sdpa"
    return model.double()


VIDEO_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def summed_loss(model, inputs, targets):
    inputs = dict(inputs)
    for key in ("pixel_values", "pixel_values_videos"):
        if key in inputs:
            inputs[key] = inputs[key].double()
    logits = model(**inputs, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none").where(targets >= 0, 0).sum()


def loss_and_gradients(model, runs):
    model.zero_grad()
    total = sum(summed_loss(model, inputs, targets) for inputs, targets in runs)
    total.backward()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_run(item):
    """The pack as one row: our positions (3, 1, L) with the text row, every sample's visual inputs."""
    inputs = {"input_ids": item["tokens"][None], "position_ids": torch.cat([item["position_ids"][:1] * 0 + torch.arange(len(item["tokens"])), item["position_ids"]])[:, None]}
    bounds = item["cu_seqlens"].long()
    inputs["position_ids"][0, 0] = torch.cat([torch.arange(int(e - s)) for s, e in zip(bounds[:-1], bounds[1:])])
    inputs.update({key: item[key] for key in VIDEO_KEYS if key in item and len(item[key])})
    return inputs, item["labels"]


def alone_runs(samples, family, image_pad, video_pad):
    """Each sample alone as the model's processor feeds it: the model computes its own positions."""
    runs = []
    for sample in samples:
        pack, counts = as_pack([sample])
        item = dynamic_pack_item(pack, counts, family, image_pad)
        ids = item["tokens"][None]
        inputs = {"input_ids": ids, "mm_token_type_ids": torch.where(ids == image_pad, 1, torch.where(ids == video_pad, 2, 0))}
        inputs.update({key: item[key] for key in VIDEO_KEYS if key in item and len(item[key])})
        runs.append((inputs, item["labels"]))
    return runs


def difference(a, b) -> float:
    worst = abs(a[0] - b[0]) / abs(b[0])
    for name in b[1]:
        worst = max(worst, float((a[1][name] - b[1][name]).norm() / b[1][name].norm().clamp(min=1e-6)))
    return worst


def proof_samples(name, folder, tokenizer, **request):
    build = builder(name, folder, tokenizer, **request)
    raw = [MIXED, record([{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "A picture."}], image="a.png"),
           record([{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi, how are you?"}])]  # fmt: skip
    samples = [build.build(r) for r in raw]
    assert not any(isinstance(s, Skipped) for s in samples), samples
    return build.preprocessor, samples


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_a_packed_row_gives_the_samples_one_by_one_loss_and_gradients(name, folder, tokenizer):
    family, samples = proof_samples(name, folder, tokenizer)
    model = tiny_model(name, tokenizer)
    image_pad, video_pad = tokenizer.token_to_id("<|image_pad|>"), tokenizer.token_to_id("<|video_pad|>")
    pack, counts = as_pack(samples)
    packed = loss_and_gradients(model, [packed_run(dynamic_pack_item(pack, counts, family, image_pad))])
    alone = loss_and_gradients(model, alone_runs(samples, family, image_pad, video_pad))
    assert difference(packed, alone) < 1e-9
    # wrong variants: a wrong sampled fps (Qwen2.5-VL's seconds per patch), frames out of order
    _, wrong_samples = proof_samples(name, folder, tokenizer, fps=4.0)
    if name == QWEN2_5:
        item = dynamic_pack_item(pack, counts, family, image_pad)
        inputs = {key: item[key].numpy() for key in VIDEO_KEYS}
        inputs["second_per_grid_ts"] = inputs["second_per_grid_ts"] * 2  # the clip's frames said twice as far apart
        wrong = family.position_ids(pack.tokens, pack.cu_seqlens, np.diff(pack.cu_seqlens), counts, inputs, image_pad)
        item["position_ids"] = torch.from_numpy(wrong)
        assert difference(loss_and_gradients(model, [packed_run(item)]), alone) > 1e-6
    else:  # timestamps dropped: the clip's run without its <t seconds> text (fewer positions, and a wrong loss)
        assert any(len(a.tokens) != len(b.tokens) for a, b in zip(samples, wrong_samples))
        kept = {tokenizer.token_to_id(t) for t in ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
        stripped = [without_timestamps(sample, kept) for sample in samples]
        assert sum(s.length for s in stripped) < sum(s.length for s in samples)
        pack_t, counts_t = as_pack(stripped)
        item = dynamic_pack_item(pack_t, counts_t, family, image_pad)
        assert int((item["labels"] >= 0).sum()) == int((dynamic_pack_item(pack, counts, family, image_pad)["labels"] >= 0).sum())
        assert difference(loss_and_gradients(model, [packed_run(item)]), alone) > 1e-6
    item = dynamic_pack_item(pack, counts, family, image_pad)
    rows = item["pixel_values_videos"]
    half = len(rows) // 2
    item["pixel_values_videos"] = torch.cat([rows[half:], rows[:half]])  # temporal patches swapped
    assert difference(loss_and_gradients(model, [packed_run(item)]), alone) > 1e-6
