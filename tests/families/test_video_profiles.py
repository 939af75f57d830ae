"""The ``qwen-vl-utils`` video profile against Qwen's own qwen-vl-utils 0.0.14 (live, imported), for
Qwen2.5-VL (patch 14) and Qwen3-VL (patch 16):

- on a grid of (frames, fps, height, width): the frames sampled (``smart_nframes``, then the float32
  linspace every reader backend of 0.0.14 rounds), the frame size (``fetch_video``'s per-frame budget,
  then its ``smart_resize``), so ``video_grid_thw`` and the token count, Qwen2.5-VL's seconds per
  temporal patch from the sampled fps, and the same refusals;
- the same from committed golden data (``tests/golden/video/qwen_vl_utils_0.0.14.json``: 144 cases made by
  running 0.0.14's ``smart_nframes``, linspace and ``smart_resize`` with ``fetch_video``'s budget in a
  scratch directory outside the repository), so that the profile is held to it where qwen-vl-utils is absent;
- on the video zoo's clips: ``fetch_video``'s frames, bit for bit, against ours decoded once from the
  planned indices. Named difference: torchvision 0.29 has no ``io.read_video`` (0.0.14's torchvision
  backend), and neither decord nor torchcodec is installed, so the test registers a stand-in backend
  that decodes every frame with PyAV (``to_ndarray("rgb24")``, what torchvision's reader returned) and
  samples them as the three backends of 0.0.14 do; the rest of ``fetch_video`` (the budget, the resize)
  runs as shipped. Its resize is torchvision's v1 ``transforms.functional.resize``, whose uint8 bicubic
  differs from transformers' v2 by up to tens of levels: the profile's plan asks for v1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from neva_pack.families import decode_frames, resolve_encoder
from tests.families.test_video_native import FPS, FRAMES, QWEN2_5, QWEN3, SIZES, all_frames, family
from tests.families.test_video_native import tokenizer, tokenizer_dir  # noqa: F401 -- the module's fixtures
from tests.video_zoo import make_zoo

PROFILE = "qwen_vl_utils"
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "video" / "qwen_vl_utils_0.0.14.json"


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_frames_sizes_and_seconds_equal_the_golden_data(name, tokenizer):
    golden = json.loads(GOLDEN.read_text())
    assert golden["reference"] == "qwen-vl-utils 0.0.14"
    ours_family = family(name, tokenizer, profile=PROFILE)
    cases = [case for case in golden["cases"] if case["patch"] == patch_size(name)]
    for case in cases:
        args = (case["frames"], case["fps"], case["width"], case["height"], tokenizer)
        if "refused" in case:
            with pytest.raises(ValueError):
                ours_family.plan_video(*args)
            continue
        plan = ours_family.plan_video(*args)
        assert list(plan.indices) == case["indices"] and list(plan.size) == case["size"], case
        if name == QWEN2_5:
            assert np.float32(plan.grid_seconds) == np.float32(2 / case["sample_fps"])
    assert len(cases) == 72 and sum("refused" in case for case in cases) > 0


def reference_module():
    return pytest.importorskip("qwen_vl_utils.vision_process")


def patch_size(name: str) -> int:
    return int(resolve_encoder(name).preprocessor_config["patch_size"])


def reference_layout(name, frames, fps, width, height, target=2.0):
    """(indices, (h, w), sampled fps) as qwen-vl-utils 0.0.14 lays the clip out, or the exception it raises."""
    v = reference_module()
    factor = patch_size(name) * v.SPATIAL_MERGE_SIZE
    count = v.smart_nframes({"fps": target}, total_frames=frames, video_fps=fps)
    indices = torch.linspace(0, frames - 1, count).round().long().numpy()  # every 0.0.14 reader backend's sampling
    low = v.VIDEO_MIN_TOKEN_NUM * factor * factor
    total = v.MODEL_SEQ_LEN * factor * factor * 0.9
    high = max(min(v.VIDEO_MAX_TOKEN_NUM * factor * factor, total / count * v.FRAME_FACTOR), int(low * 1.05))  # fetch_video's budget
    size = v.smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
    return indices, size, count / max(frames, 1e-6) * fps


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_frames_sizes_and_seconds_equal_qwen_vl_utils_on_the_grid(name, tokenizer):
    ours_family = family(name, tokenizer, profile=PROFILE)
    p = patch_size(name)
    checked = refused = 0
    for frames in FRAMES:
        for fps in FPS:
            for height, width in SIZES:
                try:
                    indices, (h, w), sampled = reference_layout(name, frames, fps, width, height)
                except (ValueError, AssertionError):
                    with pytest.raises(ValueError):
                        ours_family.plan_video(frames, fps, width, height, tokenizer)
                    refused += 1
                    continue
                plan = ours_family.plan_video(frames, fps, width, height, tokenizer)
                where = (frames, fps, height, width)
                assert list(plan.indices) == indices.tolist(), where
                assert plan.size == (h, w), where
                grid = (len(indices) // 2, h // p, w // p)
                assert plan.tokens == grid[0] * grid[1] * grid[2] // 4, where
                if name == QWEN2_5:  # the processor's second_per_grid_ts: temporal_patch_size / the sampled fps
                    assert np.float32(plan.grid_seconds) == np.float32(2 / sampled), where
                else:
                    assert plan.grid_seconds == 0.0 and len(plan.ids) > plan.tokens + 2 * grid[0] + 2
                checked += 1
    assert checked > 500 and refused > 0


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return make_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture
def pyav_backend(monkeypatch):
    """qwen-vl-utils' reader backend stood in by PyAV (the module's docstring says why)."""
    vision_process = reference_module()

    def read(ele):
        video = torch.from_numpy(all_frames(ele["video"])).permute(0, 3, 1, 2)
        import av

        with av.open(ele["video"]) as container:
            fps = float(container.streams.video[0].average_rate)
        total = len(video)
        count = vision_process.smart_nframes(ele, total_frames=total, video_fps=fps)
        indices = torch.linspace(0, total - 1, count).round().long()
        return video[indices], {"fps": fps, "frames_indices": indices, "total_num_frames": total}, count / max(total, 1e-6) * fps

    monkeypatch.setitem(vision_process.VIDEO_READER_BACKENDS, "pyav", read)
    monkeypatch.setattr(vision_process, "get_video_reader_backend", lambda: "pyav")
    return vision_process


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_decoded_frames_equal_fetch_video_bit_for_bit(name, zoo, pyav_backend, tokenizer):
    vision_process = pyav_backend
    from neva_pack.files import read_video_header

    ours_family = family(name, tokenizer, profile=PROFILE)
    compared = 0
    for clip in zoo.values():
        data = clip.path.read_bytes()
        header = read_video_header(data)
        if header.frames_disagree or clip.rotation or clip.frames < 4:
            continue  # a skip of ours (frames a decoder does not present), or a clip the reference refuses
        plan = ours_family.plan_video(header.frame_count, header.fps, header.width, header.height, tokenizer)
        (video, metadata), sampled = vision_process.fetch_video({"video": str(clip.path)}, image_patch_size=patch_size(name),
                                                                return_video_sample_fps=True, return_video_metadata=True)  # fmt: skip
        assert list(plan.indices) == metadata["frames_indices"].tolist(), clip.name
        assert name != QWEN2_5 or np.float32(plan.grid_seconds) == np.float32(2 / sampled), clip.name
        frames = decode_frames(data, plan.indices, plan.size, name=clip.name, max_seconds=60, resize_api=plan.resize)
        assert torch.equal(torch.from_numpy(frames).float(), video), clip.name
        compared += 1
    assert compared >= 8
