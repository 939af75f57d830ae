"""The compressed frame store (--frame_compression zstd) against the raw uint8 one, on frames of video:
bytes on disk per minute of video (raw uint8, zstd, and the float32 ``pixel_values_videos`` the processors
return), the cost of writing each into the pool, and the pool's read throughput -- compressed against raw,
measured in the same run on the same clips. Then the codecs zstd was chosen among, on the same frames.

The clips are made here with PyAV's H.264 encoder (30 fps, ``--seconds`` long): ``photo`` pans across
photographs (scikit-image's astronaut, coffee, chelsea and rocket, tiled): frames of real content with
camera motion and codec artefacts; ``gradient`` is ``bench_video.py``'s moving gradient with a little
noise. (The test zoo's clips are random noise, which no lossless codec shrinks: a worst case, not a
figure.) The frames kept and their size are the family's plan of the header (the ``hf`` profile, 2 fps).
Each time is the best of ``--repeats``.

Usage: python benchmarks/bench_frame_store.py [--seconds 10] [--repeats 3] [--folder DIR] [--no-codecs]
"""

from __future__ import annotations

import argparse
import fractions
import io
import sys
import tempfile
import time
import zlib
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_video import make_clip as make_gradient_clip  # noqa: E402
from neva_pack.families import (  # noqa: E402
    VideoRequest,
    decode_frames,
    dynamic_processor,
    resolve_encoder,
)
from neva_pack.files import read_video_header  # noqa: E402
from neva_pack.sample_store import ImagePool, PoolWriter, pool_segment  # noqa: E402
from neva_pack.text import load_tokenizer  # noqa: E402

ENCODERS = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
CLIPS = (("photo", 640, 360), ("photo", 1280, 720), ("gradient", 640, 360))
RATE = 30
READS = 8
"""Times each clip is read from the pool per measurement."""


def make_photo_clip(path: Path, width: int, height: int, seconds: int) -> None:
    """An H.264 MP4 panning across four photographs (a 2x2 mosaic, each 1080x1440 tile's share)."""
    from skimage import data
    from skimage.transform import resize

    tiles = [resize(image, (height * 3 // 2, width * 3 // 2), preserve_range=True, anti_aliasing=True).astype(np.uint8)
             for image in (data.astronaut(), data.coffee(), data.chelsea(), data.rocket())]  # fmt: skip
    canvas = np.concatenate([np.concatenate(tiles[:2], 1), np.concatenate(tiles[2:], 1)], 0)
    rows, columns = canvas.shape[0] - height, canvas.shape[1] - width
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(RATE))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"}
        count = seconds * RATE
        for k in range(count):
            t = k / count
            top, left = int(rows * 0.5 * (1 - np.cos(np.pi * t))), int(columns * t)
            frame = np.ascontiguousarray(canvas[top : top + height, left : left + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def pool_of(folder: Path, stored, codec: str | None, repeats: int) -> tuple[ImagePool, float, int]:
    """The clip written into a fresh pool segment (the best write time of ``repeats``), its pool and size on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    counter = iter(range(10**6))

    def write():
        name = f"shard_{next(counter):05d}"
        writer = PoolWriter(pool_segment(folder, name, 0, dynamic=True, codec=codec), {}, 0)
        writer.add(stored)
        return name, writer.close(), writer.checksums()

    seconds = best(write, repeats)
    name, count, checksums = write()
    segment = pool_segment(folder, name, count, checksums, dynamic=True, codec=codec)
    return ImagePool([segment], None, mmap=False), seconds, segment.images_file.stat().st_size


def codecs(frames: np.ndarray, count: int, repeats: int) -> list[tuple[str, int, float, float]]:
    """(codec, bytes, encode s, decode s) of ``count`` planar uint8 frames stacked (3, count * h, w) by each
    candidate: zstd and zlib on the bytes as the pool holds them, PNG and WebP on each frame as a picture."""
    import zstandard

    raw = frames.tobytes()
    results = []
    for level in (1, 3, 9):
        compressor, decompressor = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        blob = compressor.compress(raw)
        results.append((f"zstd level {level}", len(blob), best(lambda: compressor.compress(raw), repeats),
                        best(lambda: decompressor.decompress(blob), repeats)))  # fmt: skip
    blob = zlib.compress(raw, 6)
    results.append(("zlib level 6", len(blob), best(lambda: zlib.compress(raw, 6), repeats), best(lambda: zlib.decompress(blob), repeats)))
    pictures = [np.ascontiguousarray(picture.transpose(1, 2, 0)) for picture in frames.reshape(3, count, -1, frames.shape[2]).transpose(1, 0, 2, 3)]
    return results + [_pil(pictures, name, options, repeats) for name, options in (("PNG", {}), ("WEBP", {"lossless": True}))]


def _pil(pictures: list[np.ndarray], name: str, options: dict, repeats: int) -> tuple[str, int, float, float]:
    from PIL import Image

    def encode():
        out = []
        for picture in pictures:
            buffer = io.BytesIO()
            Image.fromarray(picture).save(buffer, name, **options)
            out.append(buffer.getvalue())
        return out

    blobs = encode()
    decoded = [np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")) for blob in blobs]
    assert all(np.array_equal(a, b) for a, b in zip(decoded, pictures)), f"{name} is not lossless here"
    return (f"{name} lossless (PIL)", sum(map(len, blobs)), best(encode, repeats),
            best(lambda: [np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")) for blob in blobs], repeats))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--no-codecs", dest="codecs", action="store_false", help="skip the comparison of codecs")
    args = parser.parse_args(argv)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench_frame_store_"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer").mkdir(exist_ok=True)
    from tests.dynamic_references import (
        stand_in_tokenizer,  # the stand-in tokenizer: Qwen's special tokens
    )

    tokenizer = load_tokenizer(stand_in_tokenizer(folder / "tokenizer", "qwen"))
    per_minute = 60 / args.seconds
    print("bytes on disk per minute of video (30 fps source, 2 fps kept), and the pool's write and read of one clip")
    print(f"{'clip':<15} {'model':<11} {'frames kept':>16} {'uint8 MB':>9} {'zstd MB':>8} {'ratio':>6} {'float32 MB':>10} "
          f"{'decode s':>8} {'write raw s':>11} {'write zstd s':>12} {'read raw MB/s':>13} {'read zstd MB/s':>14} {'read ratio':>10}")  # fmt: skip
    samples = []
    for kind, width, height in CLIPS:
        path = folder / f"{kind}_{width}x{height}.mp4"
        if not path.is_file():
            (make_photo_clip if kind == "photo" else make_gradient_clip)(path, width, height, args.seconds)
        data = path.read_bytes()
        header = read_video_header(data)
        for name in ENCODERS:
            family = dynamic_processor(resolve_encoder(name)).with_videos(VideoRequest(profile="hf"), tokenizer)
            plan = family.plan_video(header.frame_count, header.fps, header.width, header.height, tokenizer)
            decode_s = best(lambda: decode_frames(data, plan.indices, plan.size, name=path.name, max_seconds=3600), 1)
            frames = decode_frames(data, plan.indices, plan.size, name=path.name, max_seconds=3600)
            stored = family.video_to_stored(frames, plan, (header.width, header.height))
            raw_pool, raw_write, raw_size = pool_of(folder / "raw", stored, None, args.repeats)
            zstd_pool, zstd_write, zstd_size = pool_of(folder / "zstd", stored, "zstd", args.repeats)
            (a,), (b,) = raw_pool.read_stored([0]), zstd_pool.read_stored([0])
            assert np.array_equal(a.parts[0], b.parts[0]) and np.array_equal(a.parts[0], stored.parts[0]), "not lossless"
            raw_read = best(lambda: [raw_pool.read_stored([0]) for _ in range(READS)], args.repeats) / READS
            zstd_read = best(lambda: [zstd_pool.read_stored([0]) for _ in range(READS)], args.repeats) / READS
            mb = raw_size / 1e6
            print(f"{kind + f' {width}x{height}':<15} {name.split('/')[1][:10]:<11} "
                  f"{f'{stored.frames} x {plan.size[0]}x{plan.size[1]}':>16} {mb * per_minute:>9.1f} {zstd_size / 1e6 * per_minute:>8.1f} "
                  f"{raw_size / zstd_size:>6.2f} {4 * mb * per_minute:>10.1f} {decode_s:>8.3f} {raw_write:>11.3f} {zstd_write:>12.3f} "
                  f"{mb / raw_read:>13.0f} {mb / zstd_read:>14.0f} {zstd_read / raw_read:>10.2f}")  # fmt: skip
            if name == ENCODERS[0]:
                samples.append((f"{kind} {width}x{height}", stored.parts[0], stored.frames))
    if args.codecs:
        print("\nthe codecs on the same frames (Qwen2.5-VL's), one core: ratio, encode and decode MB/s of uint8")
        print(f"{'clip':<15} {'codec':<22} {'ratio':>6} {'encode MB/s':>11} {'decode MB/s':>11}")
        for label, frames, count in samples:
            for codec, size, encode_s, decode_s in codecs(np.ascontiguousarray(frames), count, args.repeats):
                print(f"{label:<15} {codec:<22} {frames.nbytes / size:>6.2f} {frames.nbytes / encode_s / 1e6:>11.0f} "
                      f"{frames.nbytes / decode_s / 1e6:>11.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
