"""Video clips: which frames to keep, how large, and the kept frames decoded once, resized, as uint8.

A clip's token count depends only on its header (frame count, frame rate, width, height): the frames
sampled and the size they are resized to are arithmetic on those numbers (the family that reads
videos chooses which arithmetic: ``ModelFamily.plan_video``). The decode then keeps exactly those
frames::

    header (frame count, fps, W x H)  --sampling-->  indices i_0 < i_1 < ... (decode order)
    bytes --PyAV, one pass, stopping after the last index--> RGB24 frame i_k --resize--> uint8 (3, h, w)

Frames are numbered in the order the decoder gives them (presentation order), as transformers'
PyAV reader numbers them; the RGB conversion is PyAV's (``to_ndarray(format="rgb24")``) and the resize
is torchvision's on the uint8 tensor (bicubic, antialiased), the operations transformers' video
processors run (``transforms.v2``), or qwen-vl-utils' (``transforms.functional``, the v1 API: its uint8
bicubic rounds differently), so the stored frames are the reference's bit for bit. Each frame is resized as soon as it is
decoded: a worker never holds more than one full-size frame.

A clip whose stream ends before the last frame its header promised is a skip of its own
(``video_frames_mismatch``): the reference would silently train on fewer frames than it counted.
The decode runs under the image decode budget in CPU seconds, checked between packets.
"""

from __future__ import annotations

import io
import math
import time

import numpy as np

from neva_pack.records import RecordError

__all__ = [
    "arange_indices", "bounded_frame_count", "decode_frames", "duration_indices", "fit_frame_area", "frames_at_fps",
    "linspace_indices", "paired_times", "paired_timestamps", "patch_frame_count", "rate_frame_count", "stack_frames",
    "temporal_smart_resize", "torch_linspace_indices", "unstack_frames", "video_timestamp",
]  # fmt: skip


def arange_indices(total: int, count: int) -> np.ndarray:
    """int64 ``count`` indices spread over ``total`` frames by a fractional step ``total / count``, each
    truncated: torch's float arange, as the reference computes it (its float32 rounding included)."""
    import torch

    if count < 1:
        raise ValueError(f"{count} frames to sample")
    return torch.arange(0, total, total / count).int().numpy().astype(np.int64)


def linspace_indices(total: int, count: int) -> np.ndarray:
    """int64 ``count`` indices evenly from the first frame to the last, rounded half to even."""
    if count < 1:
        raise ValueError(f"{count} frames to sample")
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def torch_linspace_indices(total: int, count: int) -> np.ndarray:
    """int64 ``count`` indices evenly from the first frame to the last: torch's float32 linspace, rounded
    half to even (qwen-vl-utils' sampling; for long clips it differs from a float64 linspace)."""
    import torch

    if count < 1:
        raise ValueError(f"{count} frames to sample")
    return torch.linspace(0, total - 1, count).round().long().numpy().astype(np.int64)


def duration_indices(total: int, duration_s: float | None, target_fps: float, max_frames: int) -> np.ndarray:
    """int64 indices sampled by the stream's duration: ``floor(duration x target_fps)`` frames (at least
    one; at most ``max_frames`` and the clip) spread evenly from the first frame to the last by a float64
    linspace, each truncated (LLaMA-Factory's sampling). ValueError for a stream without a duration or
    a frame count (FFmpeg reports none for Matroska): that reference samples such a clip as unbounded."""
    if not total or duration_s is None or not duration_s > 0:
        raise ValueError(f"the stream declares {total} frames over {duration_s} s: sampling by its duration needs both")
    count = min(total, max_frames, max(1, math.floor(duration_s * target_fps)))
    return np.linspace(0, total - 1, count).astype(np.int32).astype(np.int64)


def fit_frame_area(width: int, height: int, max_pixels: int, min_pixels: int, min_side: int, max_ratio: float, ratio_to: int) -> tuple[int, int]:
    """(width, height) of a frame first fitted to an area: scaled down (sides truncated) past
    ``max_pixels``, up below ``min_pixels``, each side at least ``min_side``, and a side over
    ``max_ratio`` times the other cut to ``ratio_to`` times it (LLaMA-Factory's frame regularisation)."""
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    if width * height < min_pixels:
        scale = math.sqrt(min_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    if min(width, height) < min_side:
        width, height = max(width, min_side), max(height, min_side)
    if width / height > max_ratio:
        width = height * ratio_to
    if height / width > max_ratio:
        height = width * ratio_to
    return width, height


def rate_frame_count(total: int, fps: float, target_fps: float, min_frames: int, max_frames: int, factor: int) -> int:
    """The frames sampled at ``target_fps`` from a clip of ``total`` frames at ``fps``, within
    [min_frames, max_frames] (each rounded to ``factor``) and the clip, rounded down to a multiple of
    ``factor``: qwen-vl-utils 0.0.14's ``smart_nframes``. ValueError below ``factor`` frames (its refusal)."""
    low = math.ceil(min_frames / factor) * factor
    high = math.floor(min(max_frames, total) / factor) * factor
    count = math.floor(min(max(frames_at_fps(total, fps, target_fps), low), high, total) / factor) * factor
    if not factor <= count <= total:
        raise ValueError(f"{total} frame(s): {count} sampled, fewer than the temporal patch of {factor}")
    return count


def patch_frame_count(total: int, fps: float, target_fps: float, min_frames: int, max_frames: int, factor: int) -> int:
    """The frames sampled at ``target_fps`` from a clip of ``total`` frames at ``fps``, at least
    ``min_frames``, at most ``max_frames`` and the clip (that bound rounded down to ``factor``), then
    rounded down to a multiple of ``factor``: transformers' Qwen2-VL video processor's ``sample_frames``.
    ValueError below ``factor`` frames."""
    top = math.floor(min(max_frames, total) / factor) * factor
    wanted = min(max(frames_at_fps(total, fps, target_fps), min_frames), top, total)
    count = math.floor(wanted / factor) * factor
    if count < 1:
        raise ValueError(f"{total} frame(s): fewer than one temporal patch of {factor}")
    return count


def bounded_frame_count(total: int, fps: float, target_fps: float, min_frames: int, max_frames: int) -> int:
    """The frames sampled at ``target_fps`` from a clip of ``total`` frames at ``fps`` (truncated), at
    least ``min_frames``, at most ``max_frames`` and the clip: transformers' Qwen3-VL video processor's."""
    return min(max(int(frames_at_fps(total, fps, target_fps)), min_frames), max_frames, total)


def frames_at_fps(total: int, fps: float, target_fps: float) -> float:
    """The frame count that samples a clip of ``total`` frames at ``fps`` with ``target_fps`` (unrounded)."""
    return total / fps * target_fps


def paired_timestamps(indices, fps: float, group: int) -> list[float]:
    """Seconds of each group of ``group`` consecutive sampled frames (the mean of the group's first and
    last frame times); a last incomplete group is filled with the last index repeated."""
    return paired_times([int(i) for i in indices], fps, group)


def paired_times(positions, rate: float, group: int) -> list[float]:
    """``paired_timestamps`` of positions counted at ``rate`` a second, taken as they are (floats too)."""
    positions = list(positions)
    if len(positions) % group:
        positions.extend([positions[-1]] * (group - len(positions) % group))
    seconds = [p / rate for p in positions]
    return [(seconds[k] + seconds[k + group - 1]) / 2 for k in range(0, len(seconds), group)]


def video_timestamp(seconds: float) -> str:
    """The text written before a temporal patch of a clip: ``<1.5 seconds>``."""
    return f"<{seconds:.1f} seconds>"


def temporal_smart_resize(frames: int, height: int, width: int, temporal_factor: int, factor: int,
                          min_pixels: int, max_pixels: int) -> tuple[int, int]:  # fmt: skip
    """(height, width) of every frame of a clip whose pixel budget covers all its frames: each side a
    multiple of ``factor``, frames x height x width within [min_pixels, max_pixels] (up to rounding);
    a side under ``factor`` is first scaled up (truncated). ValueError for fewer frames than
    ``temporal_factor`` or an aspect ratio over 200, the reference's refusals."""
    if frames < temporal_factor:
        raise ValueError(f"{frames} frame(s) sampled, fewer than the temporal patch of {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"{width} x {height}: the aspect ratio must be at most 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def stack_frames(frames: np.ndarray) -> np.ndarray:
    """uint8 (T, C, h, w) -> one stored part (C, T h, w), the frames top to bottom."""
    count, channels, height, width = frames.shape
    return np.ascontiguousarray(frames.transpose(1, 0, 2, 3)).reshape(channels, count * height, width)


def unstack_frames(part: np.ndarray, count: int, multiple: int = 1) -> np.ndarray:
    """A stored part (C, T h, w) of ``count`` frames -> (T', C, h, w): the frames in order (a view), the
    last repeated up to T', the next multiple of ``multiple`` (a copy then)."""
    frames = part.reshape(part.shape[0], count, part.shape[1] // count, part.shape[2]).transpose(1, 0, 2, 3)
    if count % multiple:
        frames = np.concatenate([frames, np.repeat(frames[-1:], multiple - count % multiple, axis=0)])
    return frames


def decode_frames(data: bytes, indices, size: tuple[int, int], *, name: str, max_seconds: float, resize_api: str = "v2",
                  declared: tuple[int, int] | None = None) -> np.ndarray:  # fmt: skip
    """uint8 (len(indices), 3, h, w): the frames at ``indices`` (increasing, decode order) of the clip's
    first video stream, each resized to ``size`` (h, w) as decoded (module docstring).

    RecordError ``unreadable_video`` for bytes PyAV cannot demux or decode, ``video_frames_mismatch``
    for a stream that ends before the last index or whose frames are not the ``declared`` (width, height)
    of its header (the size its tokens were counted from: a sample entry saying 320 x 240 over 32 x 24
    frames was stored upscaled, 198 tokens where the model's processor counts 12), ``video_too_slow``
    past ``max_seconds`` of CPU.
    ``resize_api``: "v2" (torchvision's ``transforms.v2.functional.resize``) or "v1" (``transforms.functional``'s)."""
    import av
    import torch
    from torchvision.transforms import InterpolationMode, functional
    from torchvision.transforms.v2 import functional as functional_v2

    resize = {"v1": functional.resize, "v2": functional_v2.resize}[resize_api]

    wanted = np.asarray(indices, dtype=np.int64)
    if not len(wanted) or np.any(np.diff(wanted) <= 0) or wanted[0] < 0:
        raise ValueError(f"{name}: frame indices must be increasing and non-negative")
    height, width = size
    out = np.empty((len(wanted), 3, height, width), dtype=np.uint8)
    deadline = time.thread_time() + max_seconds
    last = int(wanted[-1])
    decoded = kept = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise RecordError("unreadable_video", f"{name}: no video stream")
            stream = container.streams.video[0]
            for packet in container.demux(stream):
                for frame in packet.decode():
                    if declared is not None and (frame.width, frame.height) != tuple(declared):
                        raise RecordError("video_frames_mismatch", f"{name}: its header declares {declared[0]} x {declared[1]} frames, "
                                                                   f"a decoder presents {frame.width} x {frame.height}")  # fmt: skip
                    if decoded == wanted[kept]:
                        rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                        resized = resize(rgb, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)
                        out[kept] = resized.numpy()
                        kept += 1
                    decoded += 1
                    if kept == len(wanted):
                        return out
                if time.thread_time() > deadline:
                    raise RecordError("video_too_slow", f"{name}: decoding took more than {max_seconds:g} CPU seconds")
    except RecordError:
        raise
    except Exception as exc:  # noqa: BLE001 -- FFmpeg's errors reach us as many classes (av.error.*, ValueError, ...)
        raise RecordError("unreadable_video", f"{name}: {type(exc).__name__}: {str(exc)[:200]}") from None
    raise RecordError("video_frames_mismatch", f"{name}: the stream ends after {decoded} frames; frame {last} was planned from its header")
