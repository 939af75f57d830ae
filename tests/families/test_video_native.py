"""Video clips of the native-resolution family (Qwen2.5-VL, Qwen3-VL) against transformers 5.24's own video
processors, run here for real:

- the frames sampled and the size each is resized to, from the header's numbers alone, equal the
  processors' ``sample_frames`` and ``resize`` over a grid of (frames, fps, height, width), target fps
  1 / 2 / 4, ``cap_pixels_per_frame`` off and on;
- clips decoded once (PyAV, only the kept frames, torchvision's resize) give ``pixel_values_videos``
  and ``video_grid_thw`` bit-identical to the processor fed by transformers' PyAV reader, and
  Qwen2.5-VL's ``second_per_grid_ts`` / Qwen3-VL's run of ids (its ``<t seconds>`` text before each
  temporal patch) equal the model processors' (``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor``);
- each sample's mRoPE positions equal ``get_rope_index`` of the models with the clip sampled at 1, 2
  and 4 fps.

transformers' video processors decode with torchcodec by default, which needs a system FFmpeg; the
reference here is the same processor fed by transformers' own PyAV reader (``load_video(backend="pyav")``),
the decoder and colour conversion we use."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from neva_pack.families import dynamic_processor, resolve_encoder
from neva_pack.families.base import VideoRequest
from neva_pack.families.native import (  # the family's own module
    mrope_position_ids,
    smart_resize,
)
from neva_pack.families.video_frames import decode_frames
from neva_pack.text import load_tokenizer
from tests.dynamic_references import hf_tokenizer, stand_in_tokenizer

QWEN2_5 = "Qwen/Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen/Qwen3-VL-8B-Instruct"
QWEN3_VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 25165824}
"""The released Qwen3-VL video_preprocessor_config.json's size."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return stand_in_tokenizer(tmp_path_factory.mktemp("tok"), "qwen")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def family(name, tokenizer, **request):
    return dynamic_processor(resolve_encoder(name)).with_videos(VideoRequest(**request), tokenizer)


def reference(name, cap: bool = False):
    """transformers' video processor of the checkpoint: Qwen2.5-VL's reads its preprocessor_config.json
    (it ships no video one), Qwen3-VL's the released video_preprocessor_config.json's size."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import (
        Qwen2VLVideoProcessor,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )

    config = dict(resolve_encoder(name).preprocessor_config)
    settings = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class", "size", "min_pixels", "max_pixels")}
    if name == QWEN3:
        return Qwen3VLVideoProcessor(size=QWEN3_VIDEO_SIZE, cap_pixels_per_frame=cap, **settings)
    return Qwen2VLVideoProcessor(min_pixels=config["min_pixels"], max_pixels=config["max_pixels"], cap_pixels_per_frame=cap, **settings)


def write_clip(path, *, codec="libx264", width=64, height=48, frames=30, rate=10, fmt="mp4", pix_fmt="yuv420p", seed=0):
    """A clip of random frames (until the shared video zoo lands: tests/video_zoo.py)."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for _ in range(frames):
            picture = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return path


def header(path):
    """(frame count, fps, width, height) as PyAV reports them (what transformers' reader uses); a
    Matroska file declares no count: its packets are counted."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        return frames, float(stream.average_rate), stream.width, stream.height


def all_frames(path):
    """uint8 (N, H, W, 3): every frame as transformers' PyAV reader converts it (``to_ndarray("rgb24")``)."""
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


# ---------------------------------------------------------------- arithmetic from headers


def reference_layout(processor, frames, fps, width, height, target):
    """(indices, (h, w)) the processor chooses, its final resize not run (a meta tensor of the clip)."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict
    from transformers.video_utils import VideoMetadata

    indices = np.asarray(processor.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=target), dtype=np.int64)
    chosen = {}

    def capture(self, image, size, resample=None, **kwargs):
        chosen["size"] = (size.height, size.width)
        return image

    original = TorchvisionBackend.resize
    TorchvisionBackend.resize = capture
    try:
        video = torch.empty((1, len(indices), 3, height, width), device="meta")
        processor.resize(video, size=processor.size if isinstance(processor.size, SizeDict) else SizeDict(**processor.size), resample=processor.resample,
                         factor=processor.patch_size * processor.merge_size, temporal_factor=processor.temporal_patch_size,
                         cap_pixels_per_frame=processor.cap_pixels_per_frame)  # fmt: skip
    finally:
        TorchvisionBackend.resize = original
    return indices, chosen["size"]


FRAMES = (1, 2, 3, 4, 5, 7, 9, 16, 31, 60, 301, 1000, 5000)
FPS = (1.0, 2.5, 10.0, 24000 / 1001, 30000 / 1001, 30.0, 60.0)
SIZES = ((17, 33), (33, 17), (240, 320), (480, 854), (720, 1280), (1080, 1920), (2160, 3840), (20, 4000))
SMALL = {"frames": (1, 3, 4, 9, 301, 5000), "fps": (2.5, 30000 / 1001, 60.0), "sizes": ((17, 33), (720, 1280), (2160, 3840), (20, 4000))}


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
@pytest.mark.parametrize("cap", [False, True])
def test_frames_and_sizes_from_the_header_equal_the_processor(name, cap, tokenizer):
    """A small grid (the whole one: the slow test below)."""
    checked, refused = compare_grid(name, cap, tokenizer, SMALL["frames"], SMALL["fps"], SMALL["sizes"])
    assert checked > 100 and refused > 3


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
@pytest.mark.parametrize("cap", [False, True])
def test_frames_and_sizes_from_the_header_equal_the_processor_on_the_whole_grid(name, cap, tokenizer):
    checked, refused = compare_grid(name, cap, tokenizer, FRAMES, FPS, SIZES)
    assert checked > 2000 and refused > 10


def compare_grid(name, cap, tokenizer, frame_counts, rates, sizes) -> tuple[int, int]:
    """(cases equal, cases both refuse) over the grid at target fps 1, 2 and 4."""
    processor = reference(name, cap)
    checked = refused = 0
    for target in (1.0, 2.0, 4.0):
        ours = family(name, tokenizer, fps=target, cap_pixels_per_frame=cap)
        for frames in frame_counts:
            for fps in rates:
                for height, width in sizes:
                    try:
                        indices, size = reference_layout(processor, frames, fps, width, height, target)
                    except (ValueError, ZeroDivisionError):
                        with pytest.raises(ValueError):
                            ours.plan_video(frames, fps, width, height, tokenizer)
                        refused += 1
                        continue
                    plan = ours.plan_video(frames, fps, width, height, tokenizer)
                    assert plan.indices == tuple(indices.tolist()), (frames, fps, target)
                    assert plan.size == size, (frames, fps, height, width, target)
                    checked += 1
    return checked, refused


def test_a_clip_shorter_than_a_temporal_patch_is_refused(tokenizer):
    for name in (QWEN2_5, QWEN3):
        with pytest.raises(ValueError, match="temporal patch"):
            family(name, tokenizer).plan_video(1, 10.0, 64, 48, tokenizer)


# ---------------------------------------------------------------- decoded clips


CLIPS = {
    "h264.mp4": {"codec": "libx264"},
    "mpeg4_odd.mp4": {"codec": "mpeg4", "width": 33, "height": 17, "frames": 9},
    "vp9.webm": {"codec": "libvpx-vp9", "fmt": "webm", "frames": 12, "rate": 24},
    "long_h264.mp4": {"codec": "libx264", "width": 96, "height": 54, "frames": 61, "rate": 30},
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return {name: write_clip(folder / name, seed=k, **spec) for k, (name, spec) in enumerate(CLIPS.items())}


def decoded(path, processor, target):
    """The processor's frames and metadata: every frame decoded as transformers' PyAV reader does, then
    sampled by the processor's own ``sample_frames`` (as its reader would)."""
    from transformers.video_utils import VideoMetadata

    frames, fps, width, height = header(path)
    video = all_frames(path)
    assert len(video) == frames
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, width=width, height=height)
    indices = np.asarray(processor.sample_frames(metadata, fps=target), dtype=np.int64)
    metadata.frames_indices = indices
    return video[indices], metadata


def processor_inputs(name, path, target, cap=False):
    """The video processor's outputs (and the metadata) for the clip."""
    processor = reference(name, cap)
    frames, metadata = decoded(path, processor, target)
    out = processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt")
    return out, metadata


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
@pytest.mark.parametrize("clip", list(CLIPS))
def test_decoded_clips_give_the_processors_pixels_bit_for_bit(name, clip, clips, tokenizer):
    path = clips[clip]
    frames, fps, width, height = header(path)
    ours = family(name, tokenizer)
    plan = ours.plan_video(frames, fps, width, height, tokenizer)
    stored = ours.video_to_stored(decode_frames(path.read_bytes(), plan.indices, plan.size, name=clip, max_seconds=10), plan, (width, height))
    inputs = ours.model_inputs([stored])
    expected, metadata = processor_inputs(name, path, 2.0)
    assert plan.indices == tuple(int(i) for i in metadata.frames_indices)
    assert np.array_equal(inputs["video_grid_thw"], expected["video_grid_thw"].numpy())
    assert inputs["pixel_values_videos"].dtype == np.float32
    assert np.array_equal(inputs["pixel_values_videos"], expected["pixel_values_videos"].numpy())
    assert plan.tokens == int(expected["video_grid_thw"][0].prod()) // 4


def model_processor(name, tokenizer_dir):
    """The model's processor (text + images + videos) with the stand-in tokenizer."""
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl import Qwen3VLProcessor

    cls = Qwen3VLProcessor if name == QWEN3 else Qwen2_5_VLProcessor
    settings = {k: v for k, v in resolve_encoder(name).preprocessor_config.items() if k not in ("image_processor_type", "processor_class")}
    return cls(image_processor=Qwen2VLImageProcessorPil(**settings), tokenizer=hf_tokenizer(tokenizer_dir), video_processor=reference(name))


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
@pytest.mark.parametrize("target", [1.0, 2.0, 4.0])
def test_the_run_of_ids_and_seconds_equal_the_model_processor(name, target, clips, tokenizer, tokenizer_dir):
    path = clips["long_h264.mp4"]
    frames, fps, width, height = header(path)
    plan = family(name, tokenizer, fps=target).plan_video(frames, fps, width, height, tokenizer)
    processor = model_processor(name, tokenizer_dir)
    video, metadata = decoded(path, processor.video_processor, target)
    out = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[video], video_metadata=[metadata],
                    do_sample_frames=False, return_tensors="pt")  # fmt: skip
    assert out["input_ids"][0].tolist() == plan.ids.tolist()
    if name == QWEN2_5:
        assert np.float32(plan.grid_seconds) == out["second_per_grid_ts"][0].item()
    else:
        assert "seconds>" in processor.tokenizer.decode(out["input_ids"][0])


# ---------------------------------------------------------------- positions


def tiny_model(name):
    """A tiny random model of the family (its ``get_rope_index`` is what is compared)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    text = {"vocab_size": 200, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    ids = {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}
    if name == QWEN3:
        config = Qwen3VLConfig(text_config={**text, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
                               vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 16,
                                              "patch_size": 16, "deepstack_visual_indexes": []}, **ids)  # fmt: skip
        return Qwen3VLForConditionalGeneration(config)
    config = Qwen2_5_VLConfig(text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
                              vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 16,
                                             "fullatt_block_indexes": [0], "tokens_per_second": 2}, **ids)  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
@pytest.mark.parametrize("target", [1.0, 2.0, 4.0])
def test_positions_equal_get_rope_index(name, target, tokenizer):
    """text, an image, text, a clip, text: our (3, L) ids against the model's over the same ids."""
    ours = family(name, tokenizer, fps=target)
    video = ours.video
    model = tiny_model(name)
    start, image_pad, end = video.start_id, tokenizer.token_to_id("<|image_pad|>"), video.end_id
    plan = ours.plan_video(301, 30000 / 1001, 640, 360, tokenizer)
    h, w = smart_resize(120, 200, ours.settings.factor, 3136, 100_000)
    image_grid = (1, h // ours.settings.patch_size, w // ours.settings.patch_size)
    image_run = [start] + [image_pad] * (image_grid[1] * image_grid[2] // 4) + [end]
    text = tokenizer.encode("hello there").ids.tolist()
    ids = np.array(text + image_run + text + plan.ids.tolist() + text, dtype=np.int64)
    from neva_pack.core import StoredImage

    grid_t = -(-len(plan.indices) // 2)
    clip = StoredImage(size=(640, 360), parts=(np.zeros((3, len(plan.indices) * plan.size[0], plan.size[1]), np.uint8),),
                       tokens=plan.tokens, frames=len(plan.indices), grid_seconds=plan.grid_seconds)  # fmt: skip
    inputs = {"image_grid_thw": np.array([image_grid]), "video_grid_thw": np.array([[grid_t, plan.size[0] // ours.settings.patch_size,
                                                                                     plan.size[1] // ours.settings.patch_size]])}  # fmt: skip
    if video.timing == "seconds":
        inputs["second_per_grid_ts"] = np.array([clip.grid_seconds], dtype=np.float32)
    positions = ours.position_ids(ids, np.array([0, len(ids)]), np.array([len(ids)]), np.array([2]), inputs, image_pad)
    kinds = torch.from_numpy(np.where(ids == image_pad, 1, np.where(ids == video.pad_id, 2, 0)))[None]
    extra = {"second_per_grid_ts": torch.from_numpy(inputs["second_per_grid_ts"])} if video.timing == "seconds" else {}
    expected, _ = model.model.get_rope_index(torch.from_numpy(ids)[None], kinds, image_grid_thw=torch.tensor([image_grid]),
                                             video_grid_thw=torch.from_numpy(inputs["video_grid_thw"]), **extra)  # fmt: skip
    assert np.array_equal(positions, expected[:, 0].numpy())
    if video.timing == "seconds":  # the clip's temporal ids step by tokens_per_second x seconds per patch
        assert len(set(positions[0][ids == video.pad_id].tolist())) == grid_t


def test_mrope_of_an_image_is_unchanged_by_time_intervals():
    mask = np.array([0, 1, 1, 1, 1, 0], dtype=bool)
    assert np.array_equal(mrope_position_ids(mask, [[1, 4, 4]], 2), mrope_position_ids(mask, [[1, 4, 4]], 2, time_intervals=[3.7]))
