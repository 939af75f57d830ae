"""Video clips decoded, resized and written, against the sequential-decode floor: one core, CPU time,
the same frames of the same files with the same library (PyAV), in the same run.

- floor: ``av.open`` + demux + decode of the clip's frames in order, stopping after the last frame the
  family keeps, nothing converted (what any reader of those frames must pay);
- ours: ``families.decode_frames`` (the same sequential decode, the kept frames converted to RGB and
  resized as decoded, torchvision's bicubic) + ``video_to_stored`` + the sample store's
  ``PoolWriter`` writing the uint8 frames (content key, files) -- what a worker and the store do per clip.

The frames kept and their size are the family's plan of the header's numbers (Qwen2.5-VL and Qwen3-VL,
the ``hf`` profile at 2 fps). The clips are made here with PyAV's encoders: 640x360 and 1280x720 H.264
(30 fps, 20 s, a moving gradient, so the encoder does real work). Each figure is the best of
``--repeats`` runs of ``time.process_time``; the ratio's goal is <= 1.25.

``--frame_compression zstd`` writes the frames as the compressed pool does (one zstd frame per clip,
compressed where the run's workers compress it): what that option costs against the same floor.

Usage: python benchmarks/bench_video.py [--seconds 20] [--repeats 3] [--folder DIR] [--frame_compression zstd]
"""

from __future__ import annotations

import argparse
import fractions
import io
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neva_pack.families import VideoRequest, decode_frames, dynamic_processor, resolve_encoder  # noqa: E402
from neva_pack.files import read_video_header  # noqa: E402
from neva_pack.sample_store import PoolWriter, pool_segment  # noqa: E402
from neva_pack.text import load_tokenizer  # noqa: E402

ENCODERS = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
SIZES = ((640, 360), (1280, 720))
RATE = 30


def make_clip(path: Path, width: int, height: int, seconds: int) -> None:
    """An H.264 MP4 of a moving gradient with a little noise (not trivially compressible)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(RATE))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast"}
        for k in range(seconds * RATE):
            frame = np.stack([(x + 3 * k) % 256, (y + 2 * k) % 256, (x + y + k) % 256], axis=-1).astype(np.uint8)
            frame[::7, ::5] = rng.integers(0, 256, frame[::7, ::5].shape, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def floor(data: bytes, last: int) -> int:
    """Decode frames 0..last in order, nothing converted; the frames decoded."""
    decoded = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            for _ in packet.decode():
                decoded += 1
                if decoded > last:
                    return decoded
    return decoded


def ours(data: bytes, family, plan, size, folder: Path, k: int, codec: str | None = None) -> int:
    frames = decode_frames(data, plan.indices, plan.size, name="bench", max_seconds=3600)
    stored = family.video_to_stored(frames, plan, size)
    writer = PoolWriter(pool_segment(folder, f"shard_{k:05d}", 0, dynamic=True, codec=codec), {}, 0)
    writer.add(stored)
    writer.close()
    return writer.segment.images_file.stat().st_size  # the bytes on disk (compressed or not)


def best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        function()
        times.append(time.process_time() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--frame_compression", choices=("zstd",), default=None, help="write the frames compressed")
    args = parser.parse_args(argv)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench_video_"))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = folder / "tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    from tests.dynamic_references import stand_in_tokenizer  # the stand-in tokenizer: Qwen's special tokens

    tokenizer = load_tokenizer(stand_in_tokenizer(tokenizer_dir, "qwen"))
    print(f"{'clip':<22} {'model':<12} {'kept':>5} {'size':>9} {'floor s':>8} {'ours s':>8} {'ratio':>6} {'MB stored':>10}")
    worst = 0.0
    for width, height in SIZES:
        path = folder / f"clip_{width}x{height}.mp4"
        if not path.is_file():
            make_clip(path, width, height, args.seconds)
        data = path.read_bytes()
        header = read_video_header(data)
        for name in ENCODERS:
            family = dynamic_processor(resolve_encoder(name)).with_videos(VideoRequest(profile="hf"), tokenizer)
            plan = family.plan_video(header.frame_count, header.fps, header.width, header.height, tokenizer)
            last = int(plan.indices[-1])
            floor_s = best(lambda: floor(data, last), args.repeats)
            counter = iter(range(10**6))
            stored = {}
            ours_s = best(lambda: stored.setdefault("bytes", ours(data, family, plan, (header.width, header.height), folder, next(counter), args.frame_compression)),
                          args.repeats)  # fmt: skip
            ratio = ours_s / floor_s
            worst = max(worst, ratio)
            print(f"{path.name:<22} {name.split('/')[1][:11]:<12} {len(plan.indices):>5} {plan.size[1]}x{plan.size[0]:<4} "
                  f"{floor_s:>8.3f} {ours_s:>8.3f} {ratio:>6.2f} {stored['bytes'] / 1e6:>10.1f}")  # fmt: skip
    print(f"worst ratio {worst:.2f} (goal <= 1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
