"""Video planning from container headers on one core, CPU time, same files, same run: our header
reader against opening the file with PyAV and reading its stream metadata (what the reference video
loaders do before they sample frame indices).

- ours: ``open(path)`` + ``read_video_header_file``: the top-level box headers and the ``moov`` of an
  MP4 (wherever it is), the element headers of a Matroska file; never the media;
- PyAV: ``av.open(path)`` + ``streams.video[0]``'s frames, average_rate, duration, width, height (the
  open probes the streams by decoding their first packets).

Both are checked to agree (frames, fps, size) on every file before anything is timed. The clips are
made here with PyAV's encoders, 160x120 pixels by default (the header's size does not depend on the
picture's, only on the frame count; PyAV's open decodes a few frames, so it costs more on larger
ones: the default understates PyAV's cost on real clips): one minute at 30 fps (1,800 frames, the sample tables of a typical clip)
as H.264 MP4 with ``moov`` at the end (FFmpeg's default), the same with ``moov`` first (faststart),
MPEG-4 Part 2 MP4, VP9 WebM (Matroska: every block header is read to count the frames; a second row
estimates them from the durations, ``count_frames=False``, checked equal first), and 10 s clips of
each. Each figure is the best of 3 repeats of ``time.process_time`` over all the files.

Usage: python benchmarks/bench_video_headers.py [--copies 20] [--min_seconds 0.5] [--folder DIR]
"""

from __future__ import annotations

import argparse
import fractions
import sys
import tempfile
import time
import timeit
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neva_pack.files import read_video_header_file

KINDS = {
    "H.264 MP4, moov last": ("mp4", "libx264", {"preset": "ultrafast", "bf": "2"}, {}),
    "H.264 MP4, moov first": ("mp4", "libx264", {"preset": "ultrafast", "bf": "2"}, {"movflags": "faststart"}),
    "MPEG-4 MP4": ("mp4", "mpeg4", {}, {}),
    "VP9 WebM": ("webm", "libvpx-vp9", {"deadline": "realtime", "cpu-used": "8"}, {}),
}
SECONDS = (60, 10)
RATE = 30


def make_clip(path: Path, fmt: str, encoder: str, options: dict, mux: dict, frames: int, size: tuple[int, int]) -> None:
    """A clip of moving noise (8 pictures in turn), so the encoder makes frames of a realistic weight."""
    width, height = size
    rng = np.random.default_rng(0)
    pictures = rng.integers(0, 256, (8, height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w", format=fmt, options=mux) as container:
        stream = container.add_stream(encoder, rate=fractions.Fraction(RATE), options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pictures[index % 8], format="rgb24")))
        container.mux(stream.encode())


def ours(path: Path, count_frames: bool = True):
    with open(path, "rb", buffering=0) as file:  # reads are pread calls: no buffer to fill
        header = read_video_header_file(file, count_frames=count_frames)
    return header.frame_count, header.fps, header.width, header.height


def ours_estimated(path: Path):
    """Matroska's frame count estimated from its durations (``count_frames=False``), not counted."""
    return ours(path, count_frames=False)


def pyav(path: Path):
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return stream.frames, float(stream.average_rate), stream.width, stream.height, stream.duration


def machine_speed() -> float:
    """CPU microseconds this core takes for ``sum(range(1000))`` (about 10 on an idle 3 GHz core): a
    shared or throttled core shows here, so figures from two machines can be set side by side."""
    return min(timeit.repeat("sum(range(1000))", number=20_000, repeat=5, timer=time.process_time)) / 20_000 * 1e6


def per_second(work, paths: list[Path], min_seconds: float) -> float:
    """Best rate (files/s of CPU time) over 3 repeats of ``work`` on every path, each at least ``min_seconds``."""
    best = float("inf")
    for _ in range(3):
        rounds, start = 0, time.process_time()
        while True:
            for path in paths:
                work(path)
            rounds += 1
            spent = time.process_time() - start
            if spent >= min_seconds:
                break
        best = min(best, spent / rounds)
    return len(paths) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=20, help="files of each kind (copies of one clip)")
    parser.add_argument("--min_seconds", type=float, default=0.5)
    parser.add_argument("--folder", type=Path, default=None, help="where the clips are written (default: a temp dir)")
    parser.add_argument("--size", type=int, nargs=2, default=(160, 120), metavar=("WIDTH", "HEIGHT"),
                        help="frame size of the clips (PyAV's open decodes their first frames; ours reads none)")
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="bench_video_headers_"))
    folder.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[Path]] = {}
    for seconds in SECONDS:
        for kind, (fmt, encoder, options, mux) in KINDS.items():
            name = f"{kind}, {seconds} s"
            first = folder / f"{len(groups)}_0.{fmt}"
            make_clip(first, fmt, encoder, options, mux, seconds * RATE, tuple(args.size))
            data = first.read_bytes()
            groups[name] = [first]
            for copy in range(1, args.copies):
                path = folder / f"{len(groups) - 1}_{copy}.{fmt}"
                path.write_bytes(data)
                groups[name].append(path)
    for name, paths in groups.items():
        mine, theirs = ours(paths[0]), pyav(paths[0])
        frames = theirs[0] or mine[0]  # Matroska: PyAV reports 0 frames, ours counts the blocks
        assert (mine[0], mine[1], mine[2], mine[3]) == (frames, theirs[1], theirs[2], theirs[3]), (name, mine, theirs)
        assert ours_estimated(paths[0]) == mine, name
    print(f"{sum(map(len, groups.values()))} files in {folder}; one core, CPU time, best of 3; "
          f"this core runs sum(range(1000)) in {machine_speed():.1f} us")
    print(f"{'clips':32s} {'bytes':>9s} {'ours videos/s':>14s} {'PyAV videos/s':>14s} {'ratio':>7s}")
    everything: list[Path] = []
    for name, paths in groups.items():
        everything += paths
        mine = per_second(ours, paths, args.min_seconds)
        theirs = per_second(pyav, paths, args.min_seconds)
        print(f"{name:32s} {paths[0].stat().st_size:9,d} {mine:14,.0f} {theirs:14,.0f} {mine / theirs:6,.0f}x")
        if paths[0].suffix == ".webm":
            estimated = per_second(ours_estimated, paths, args.min_seconds)
            print(f"{'  frames estimated, not counted':32s} {'':9s} {estimated:14,.0f} {theirs:14,.0f} "
                  f"{estimated / theirs:6,.0f}x")
    mp4 = [path for path in everything if path.suffix == ".mp4"]
    for label, paths in (("all MP4 files", mp4), ("all files", everything)):
        mine = per_second(ours, paths, args.min_seconds)
        theirs = per_second(pyav, paths, args.min_seconds)
        print(f"{label:32s} {'':9s} {mine:14,.0f} {theirs:14,.0f} {mine / theirs:6,.0f}x")


if __name__ == "__main__":
    main()
