"""The ``llamafactory`` video profile against LLaMA-Factory 0.9.5's own Qwen2-VL / Qwen3-VL plugins, for
Qwen2.5-VL (patch 14) and Qwen3-VL (patch 16), from committed golden data
(``tests/golden/video/llamafactory_0.9.5.json.gz``, made by running LLaMA-Factory's ``mm_plugin`` in a
scratch directory outside the repository: ``tests/golden/video/make_llamafactory_golden.py``; LLaMA-Factory
itself is not importable here, it needs peft, torchaudio and more than the test extra holds):

- on a grid of (frames, fps, stream duration, height, width): the frames sampled (``video_fps`` 2 over
  the stream's duration, at most ``video_maxlen`` 128, a float64 linspace truncated), ``video_grid_thw``
  (each frame first fitted to 256 x 256, then the processor's size), the placeholder count, Qwen2.5-VL's
  ``second_per_grid_ts`` (from the sampled count over the stream's duration) and the run LLaMA-Factory
  writes, Qwen3-VL's timestamp texts (each before its temporal patch) included;
- on 56 generated clips (``make_random_clips``: MP4 and MOV, H.264 and MPEG-4, 1..40 frames, 2.5..60 fps,
  odd sizes, variable frame rates): the same from our header reader, which equals what PyAV reported to
  LLaMA-Factory, and its frame path's ``video_grid_thw`` and ``second_per_grid_ts`` (the frames it decoded
  run through transformers' processor) too; our decode finds every planned frame (slow).

Named differences: LLaMA-Factory resizes each frame twice (PIL bicubic to its 256 x 256 area, then the
processor's resize); the stored frames here are resized once, from the decoded frame to the planned size.
Its Qwen3-VL clip is the timestamped runs alone; here they sit inside one start and end id (as the
Hugging Face processor writes them), which every clip's run opens and closes with in the store.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from neva_pack.families import decode_frames
from neva_pack.files import read_video_header
from tests.families.test_video_native import (  # noqa: F401 -- the module's fixtures
    QWEN2_5,
    QWEN3,
    family,
    tokenizer,
    tokenizer_dir,
)
from tests.video_zoo import make_random_clips

PROFILE = "llamafactory"
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "video" / "llamafactory_0.9.5.json.gz"
PATCH = {QWEN2_5: 14, QWEN3: 16}


@pytest.fixture(scope="module")
def golden():
    data = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    assert data["reference"] == "LLaMA-Factory 0.9.5"
    assert data["settings"] == {"video_fps": 2.0, "video_maxlen": 128, "video_max_pixels": 65536, "video_min_pixels": 256}
    return data


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return make_random_clips(tmp_path_factory.mktemp("clips"))


def assert_layout(name, plan, case, sampling, tokenizer):
    """``plan`` (ours) against LLaMA-Factory's layout of the clip: indices, grid, placeholders, seconds, run."""
    fam_video = family(name, tokenizer, profile=PROFILE).video
    p = PATCH[name]
    assert list(plan.indices) == sampling["indices"], case
    grid = [math.ceil(len(plan.indices) / 2), plan.size[0] // p, plan.size[1] // p]
    assert grid == case["video_grid_thw"], case
    assert plan.tokens == case["pads"] == grid[0] * grid[1] * grid[2] // 4, case
    pads = [fam_video.pad_id] * (plan.tokens // grid[0])
    start, end = fam_video.start_id, fam_video.end_id
    if name == QWEN2_5:
        assert plan.grid_seconds == sampling["second_per_grid_ts"], case
        expected = [start, *pads * grid[0], end]
    else:
        assert plan.grid_seconds == 0.0 and len(sampling["timestamps"]) == grid[0], case
        inner = [i for stamp in sampling["timestamps"] for i in (*tokenizer.encode_literal(f"<{stamp} seconds>").ids, start, *pads, end)]
        expected = [start, *inner, end]  # LLaMA-Factory's run, inside the start and end a clip's run opens and closes with here
    assert plan.ids.tolist() == expected, case


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_frames_grid_seconds_and_run_equal_llamafactory_on_the_grid(name, golden, tokenizer):
    ours = family(name, tokenizer, profile=PROFILE)
    sampling = {(s["frames"], s["fps"], s["duration_s"]): s for s in golden["sampling"]}
    cases = [case for case in golden["grid"] if case["model"] == name]
    for case in cases:
        plan = ours.plan_video(case["frames"], case["fps"], case["width"], case["height"], tokenizer, duration_s=case["duration_s"])
        assert_layout(name, plan, case, sampling[case["frames"], case["fps"], case["duration_s"]], tokenizer)
    assert len(cases) == 400
    assert {len(s["indices"]) for s in golden["sampling"]} >= {1, 2, 3, 128}  # one frame, odd counts, the video_maxlen cap


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_generated_clips_equal_llamafactory_from_their_headers(name, golden, tokenizer, clips):
    ours = family(name, tokenizer, profile=PROFILE)
    cases = [case for case in golden["clips"] if case["model"] == name]
    assert len(cases) == len(clips) == 56
    for case in cases:
        data = clips[case["clip"]].read_bytes()
        header = read_video_header(data)
        assert (header.frame_count, header.duration_s, header.fps, header.width, header.height) == (
            case["frames"], case["duration_s"], case["fps"], case["width"], case["height"]), case["clip"]  # what PyAV told LLaMA-Factory
        plan = ours.plan_video(header.frame_count, header.fps, header.width, header.height, tokenizer, duration_s=header.duration_s)
        assert_layout(name, plan, case, case, tokenizer)
        assert case["decoded_grid_thw"] == case["video_grid_thw"], case["clip"]  # its frame path agrees with its header path
        if name == QWEN2_5:
            assert np.float32(plan.grid_seconds) == np.float32(case["decoded_second_per_grid_ts"]), case["clip"]


@pytest.mark.slow
def test_every_planned_frame_of_the_generated_clips_is_decoded(tokenizer, clips):
    ours = family(QWEN2_5, tokenizer, profile=PROFILE)
    for name, path in clips.items():
        data = path.read_bytes()
        header = read_video_header(data)
        plan = ours.plan_video(header.frame_count, header.fps, header.width, header.height, tokenizer, duration_s=header.duration_s)
        frames = decode_frames(data, plan.indices, plan.size, name=name, max_seconds=60, resize_api=plan.resize)
        assert frames.shape == (len(plan.indices), 3, *plan.size), name


def test_a_stream_without_a_duration_is_refused_in_one_line(tokenizer):
    """FFmpeg gives a Matroska stream no duration (nor a frame count): LLaMA-Factory samples it as an
    unbounded stream, indices 0..127 whatever its length; the profile refuses it (a counted skip)."""
    ours = family(QWEN3, tokenizer, profile=PROFILE)
    for duration in (None, 0.0, float("nan")):
        with pytest.raises(ValueError, match="duration"):
            ours.plan_video(30, 10.0, 64, 48, tokenizer, duration_s=duration)
    with pytest.raises(ValueError, match="duration"):
        ours.plan_video(0, 10.0, 64, 48, tokenizer, duration_s=3.0)
    assert ours.plan_video(30, 10.0, 64, 48, tokenizer, duration_s=3.0).indices == tuple(np.linspace(0, 29, 6).astype(int))


def test_the_profile_and_its_defaults_are_recorded(tokenizer):
    ours = family(QWEN2_5, tokenizer, profile=PROFILE)
    record = ours.video.to_json()
    assert (record["profile"], record["fps"], record["max_frames"]) == (PROFILE, 2.0, 128)
    again = ours.with_video_record(json.loads(json.dumps(record)))
    first, second = (f.plan_video(301, 30.0, 640, 480, tokenizer, duration_s=10.0) for f in (ours, again))
    assert (first.indices, first.size, first.grid_seconds, first.ids.tolist()) == (second.indices, second.size, second.grid_seconds, second.ids.tolist())
    asked = family(QWEN2_5, tokenizer, profile=PROFILE, fps=4.0, max_frames=8)
    assert len(asked.plan_video(301, 30.0, 640, 480, tokenizer, duration_s=10.0).indices) == 8
