"""Video clips that the video tests read: small, deterministic, generated with PyAV (FFmpeg's
encoders) into a folder of the test's, each with the truth it was made with (``ZooClip``).

The zoo covers what real datasets hold: MP4 H.264 (with B-frames, so FFmpeg's muxer writes an
edit list of its own), MP4 MPEG-4 Part 2, WebM VP9, Matroska H.264, QuickTime MOV, 29.97 fps, a
``moov`` before the media (faststart) and after it (FFmpeg's default), a variable frame rate
(irregular timestamps), odd sizes (33x17: x264 needs 4:4:4 for that, MPEG-4 and VP9 take 4:2:0),
rotation metadata (the ``tkhd`` display matrix, Matroska's projection roll), one-frame clips
(shorter than a temporal patch of 2), and two edit lists patched into a finished file with the
small box writer below: one that starts the track late (an empty edit: every frame is still shown)
and one that trims the first frames (the decoder drops them, so fewer frames are presented than
``stts`` declares).

``mp4_box``/``mp4_boxes``/``rewrite_moov`` are the box writer; ``synthetic_mp4``, ``synthetic_mkv``
and ``ebml_element`` build header-only files for the hostile cases (no encoder can be asked for
10^9 frames or an 8K x 8K size at test speed); FFmpeg opens them too (PyAV's ``av.open``), so
declared timings can be checked against it.
"""

from __future__ import annotations

import fractions
import struct
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

__all__ = ["NTSC", "ZOO", "ZooClip", "ebml_element", "make_clip", "make_random_clips", "make_zoo", "mp4_box", "mp4_boxes", "rewrite_moov", "synthetic_mkv", "synthetic_mp4"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ZooClip:
    """One generated clip and what it was made to be."""

    name: str
    path: Path
    container: str
    """"mp4" (MP4, MOV) or "matroska" (WebM)."""
    codec: str
    """The sample entry (MP4) or CodecID (Matroska)."""
    width: int
    height: int
    rotation: int
    """Clockwise degrees a player turns the picture by (0, 90, 180, 270)."""
    frames: int
    """Samples the container declares (``stts`` for MP4; blocks for Matroska)."""
    decoded: int
    """Frames a decoder presents (fewer than ``frames`` where an edit list trims the start)."""
    fps: float
    """Average frame rate: frames over the track's duration."""
    duration_s: float


@dataclass(frozen=True, slots=True)
class _Spec:
    fmt: str
    """FFmpeg's muxer: mp4, mov, webm, matroska."""
    encoder: str
    width: int
    height: int
    count: int
    rate: fractions.Fraction = fractions.Fraction(10)
    pix_fmt: str = "yuv420p"
    times_ms: tuple[int, ...] | None = None
    """Frame times of a variable-rate clip (None: one frame each 1/rate s)."""
    options: tuple[tuple[str, str], ...] = ()
    """Encoder options."""
    mux: tuple[tuple[str, str], ...] = ()
    """Muxer options."""
    rotation: int = 0
    edit: str | None = None
    """"delay" (an empty edit first) or "trim" (the first frames cut) patched into the edit list."""


NTSC = fractions.Fraction(30000, 1001)
_SPECS = {
    "h264.mp4": _Spec("mp4", "libx264", 32, 24, 10),
    "mpeg4.mp4": _Spec("mp4", "mpeg4", 32, 24, 8),
    "vp9.webm": _Spec("webm", "libvpx-vp9", 32, 24, 6),
    "h264.mov": _Spec("mov", "libx264", 32, 24, 5),
    "ntsc.mp4": _Spec("mp4", "libx264", 32, 24, 7, rate=NTSC),
    "ntsc.mkv": _Spec("matroska", "libx264", 32, 24, 7, rate=NTSC),
    "faststart.mp4": _Spec("mp4", "libx264", 32, 24, 6, rate=fractions.Fraction(25), mux=(("movflags", "faststart"),)),
    "vfr.mp4": _Spec("mp4", "libx264", 32, 24, 6, times_ms=(0, 100, 150, 400, 410, 700)),
    "odd_444.mp4": _Spec("mp4", "libx264", 33, 17, 4, pix_fmt="yuv444p"),
    "odd_mpeg4.mp4": _Spec("mp4", "mpeg4", 33, 17, 5),
    "odd.webm": _Spec("webm", "libvpx-vp9", 33, 17, 3),
    "rotated_90.mp4": _Spec("mp4", "libx264", 32, 16, 4, rotation=90),
    "rotated_270.mov": _Spec("mov", "mpeg4", 32, 16, 3, rotation=270),
    "rotated_90.webm": _Spec("webm", "libvpx-vp9", 32, 16, 3, rotation=90),
    "one_frame.mp4": _Spec("mp4", "mpeg4", 16, 16, 1),
    "one_frame.webm": _Spec("webm", "libvpx-vp9", 16, 16, 1),
    "edit_delay.mp4": _Spec("mp4", "mpeg4", 32, 24, 6, edit="delay"),
    "edit_trim.mp4": _Spec("mp4", "mpeg4", 32, 24, 8, options=(("g", "1"),), edit="trim"),
}
ZOO = tuple(_SPECS)
"""The clip names, in a fixed order."""

TRIMMED = 2
"""Frames the trimming edit list cuts from the start of ``edit_trim.mp4``."""
DELAY_MS = 300
"""How late the delaying edit list starts ``edit_delay.mp4``'s track."""
_CODECS = {("libx264", False): "avc1", ("mpeg4", False): "mp4v", ("libx264", True): "V_MPEG4/ISO/AVC",
           ("libvpx-vp9", True): "V_VP9"}


def make_zoo(folder: Path) -> dict[str, ZooClip]:
    """Every zoo clip written into ``folder`` (a test's tmp dir), by name."""
    return {name: make_clip(folder, name) for name in ZOO}


def make_random_clips(folder: Path, count: int = 56, seed: int = 30) -> dict[str, Path]:
    """``count`` more small clips, each drawn from ``seed`` (the same clips for the same seed): MP4
    or MOV, H.264 or MPEG-4, 1 to 40 frames at 2.5 to 60 fps (29.97 and 23.976 among them), 16 to 96
    pixels a side (odd sides by MPEG-4 or 4:4:4 H.264), some short H.264 ones with a variable frame rate."""
    rng = np.random.default_rng(seed)
    rates = (fractions.Fraction(5, 2), fractions.Fraction(10), fractions.Fraction(24000, 1001), fractions.Fraction(25), NTSC,
             fractions.Fraction(30), fractions.Fraction(60))  # fmt: skip
    clips = {}
    for k in range(count):
        encoder = ("libx264", "mpeg4")[int(rng.integers(2))]
        width, height = (int(v) for v in rng.integers(16, 97, 2))
        odd = width % 2 or height % 2
        frames = int(rng.integers(1, 41))
        rate = rates[int(rng.integers(len(rates)))]
        times = None
        if encoder == "libx264" and 1 < frames <= 8 and rng.random() < 0.5:  # irregular timestamps, increasing
            times = tuple(int(t) for t in np.cumsum(np.concatenate([[0], rng.integers(10, 300, frames - 1)])))
        fmt = ("mp4", "mov")[int(rng.integers(2))]
        spec = _Spec(fmt, encoder, width, height, frames, rate=rate, times_ms=times,
                     pix_fmt="yuv444p" if odd and encoder == "libx264" else "yuv420p")  # fmt: skip
        path = Path(folder) / f"random_{k:02d}.{fmt}"
        _encode(path, spec)
        clips[path.name] = path
    return clips


def make_clip(folder: Path, name: str) -> ZooClip:
    spec = _SPECS[name]
    path = Path(folder) / name
    _encode(path, spec)
    count, decoded, duration_s = spec.count, spec.count, float(spec.count / spec.rate)
    if spec.times_ms is not None:
        # FFmpeg's muxer makes the sample durations add up to the span of the timestamps
        duration_s = (spec.times_ms[-1] - spec.times_ms[0]) / 1000
    if spec.edit == "trim":
        ticks = 10240 // int(spec.rate)  # FFmpeg's MP4 muxer picks a timescale of 10240 for 10 fps
        path.write_bytes(rewrite_moov(path.read_bytes(), edit=(TRIMMED * ticks, None)))
        decoded, duration_s = count - TRIMMED, float((count - TRIMMED) / spec.rate)
    elif spec.edit == "delay":
        path.write_bytes(rewrite_moov(path.read_bytes(), edit=(0, DELAY_MS)))
    matroska = spec.fmt in ("webm", "matroska")
    return ZooClip(
        name=name, path=path, container="matroska" if matroska else "mp4", codec=_CODECS[spec.encoder, matroska],
        width=spec.width, height=spec.height, rotation=spec.rotation, frames=count, decoded=decoded,
        fps=count / duration_s if spec.times_ms else float(spec.rate), duration_s=duration_s,
    )


def _encode(path: Path, spec: _Spec) -> None:
    with av.open(str(path), "w", format=spec.fmt, options=dict(spec.mux)) as container:
        stream = container.add_stream(spec.encoder, rate=spec.rate, options=dict(spec.options))
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, spec.pix_fmt
        if spec.times_ms is not None:
            stream.time_base = fractions.Fraction(1, 1000)
        if spec.rotation:
            stream.set_display_rotation(-spec.rotation)  # FFmpeg's angle turns counter-clockwise
        rng = np.random.default_rng(len(path.name))
        for index in range(spec.count):
            picture = rng.integers(0, 256, (spec.height, spec.width, 3), dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            if spec.times_ms is not None:
                frame.pts, frame.time_base = spec.times_ms[index], fractions.Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


# -- MP4 boxes ------------------------------------------------------------------------------------

_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"udta"}


def mp4_box(kind: bytes, payload: bytes) -> bytes:
    """One box: 32-bit size, four-character type, payload."""
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def mp4_boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """The (type, payload) of each top-level box of ``data`` (written by FFmpeg: 32-bit sizes)."""
    boxes, at = [], 0
    while at + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        if size == 1:
            size = struct.unpack_from(">Q", data, at + 8)[0]
            boxes.append((kind, data[at + 16:at + size]))
        else:
            size = size or len(data) - at
            boxes.append((kind, data[at + 8:at + size]))
        at += size
    return boxes


def rewrite_moov(data: bytes, *, edit: tuple[int, int | None] | None = None) -> bytes:
    """The file with its ``moov`` (FFmpeg writes it last, so no chunk offset moves) rebuilt.

    ``edit=(media_time, delay_ms)`` replaces each track's edit list (a zoo clip has one track): ``delay_ms`` None gives one
    edit that starts ``media_time`` ticks into the media (the frames before it are not shown);
    otherwise an empty edit of ``delay_ms`` then the whole media from ``media_time``."""
    out = []
    for kind, payload in mp4_boxes(data):
        if kind == b"moov":
            payload = _rewrite(payload, b"moov", edit, _movie_timescale(payload))
        out.append(mp4_box(kind, payload))
    return b"".join(out)


def _movie_timescale(moov: bytes) -> int:
    mvhd = dict(mp4_boxes(moov))[b"mvhd"]
    return struct.unpack_from(">I", mvhd, 20 if mvhd[0] == 1 else 12)[0]


def _rewrite(payload: bytes, parent: bytes, edit, movie_scale: int) -> bytes:
    children = mp4_boxes(payload)
    if parent == b"trak" and edit is not None:
        mdhd = dict(mp4_boxes(dict(children)[b"mdia"]))[b"mdhd"]
        media_scale, media_duration = struct.unpack_from(">II", mdhd, 12)
        media_time, delay_ms = edit
        kept = media_duration - media_time
        entries = [(kept * movie_scale // media_scale, media_time)]
        if delay_ms is not None:
            entries.insert(0, (delay_ms * movie_scale // 1000, -1))
        elst = mp4_box(b"elst", struct.pack(">II", 0, len(entries)) + b"".join(
            struct.pack(">Iii", duration, time, 1 << 16) for duration, time in entries))
        children = [(k, p) for k, p in children if k != b"edts"]
        children.insert(1, (b"edts", elst))  # after tkhd, where muxers put it
        return b"".join(mp4_box(k, p) for k, p in children)
    return b"".join(mp4_box(k, _rewrite(p, k, edit, movie_scale) if k in _CONTAINERS - {b"udta"} else p)
                    for k, p in children)


# -- header-only files for the hostile cases ------------------------------------------------------

def _full(kind: bytes, body: bytes, version: int = 0) -> bytes:
    return mp4_box(kind, struct.pack(">I", version << 24) + body)


def synthetic_mp4(*, width: int = 64, height: int = 48, timescale: int = 1000, stts=((10, 100),),
                  handler: bytes = b"vide", entry: bytes = b"avc1", duration: int | None = None,
                  sizes: int | None = None, matrix=(1, 0, 0, 1)) -> bytes:
    """A header-only MP4 (``ftyp`` + ``moov``, no media data) declaring what it is told: the sample
    table's ``stts`` runs (count, ticks), a media ``timescale``, a size, a handler, a sample entry."""
    frames = sum(count for count, _ in stts)
    ticks = (sum(count * delta for count, delta in stts) if duration is None else duration) & 0xFFFFFFFF
    a, b, c, d = (int(v * 65536) & 0xFFFFFFFF for v in matrix)
    tkhd = _full(b"tkhd", struct.pack(">IIIII", 0, 0, 1, 0, ticks) + bytes(16)
                 + struct.pack(">9I", a, b, 0, c, d, 0, 0, 0, 1 << 30) + struct.pack(">II", width << 16, height << 16))
    mdhd = _full(b"mdhd", struct.pack(">IIIIHH", 0, 0, timescale, ticks, 0x55C4, 0))
    hdlr = _full(b"hdlr", struct.pack(">I4s12s", 0, handler, bytes(12)) + b"handler\0")
    sample = bytes(6) + struct.pack(">H", 1) + bytes(16) + struct.pack(">HH", width, height) + bytes(50)
    stsd = _full(b"stsd", struct.pack(">I", 1) + mp4_box(entry, sample))
    stts_box = _full(b"stts", struct.pack(">I", len(stts)) + b"".join(struct.pack(">II", n, t) for n, t in stts))
    stsz = _full(b"stsz", struct.pack(">II", 1, (frames if sizes is None else sizes) & 0xFFFFFFFF))
    stbl = mp4_box(b"stbl", stsd + stts_box + stsz)
    mdia = mp4_box(b"mdia", mdhd + hdlr + mp4_box(b"minf", stbl))
    mvhd = _full(b"mvhd", struct.pack(">IIII", 0, 0, timescale, ticks) + bytes(80))
    moov = mp4_box(b"moov", mvhd + mp4_box(b"trak", tkhd + mdia))
    return mp4_box(b"ftyp", b"isom\0\0\2\0isomiso2") + moov


def ebml_element(element_id: int, payload: bytes, *, size: int | None = None) -> bytes:
    """One EBML element: its ID (as written, e.g. 0x1A45DFA3), an 8-byte size (``size`` declared
    instead of the payload's length when given; 0x01FFFFFFFFFFFFFF is "unknown"), the payload."""
    id_bytes = element_id.to_bytes((element_id.bit_length() + 7) // 8, "big")
    declared = len(payload) if size is None else size
    return id_bytes + (0x01 << 56 | declared).to_bytes(8, "big") + payload


def _uint(value: int) -> bytes:
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def synthetic_mkv(*, width: int = 64, height: int = 48, track_type: int = 1, codec: bytes = b"V_VP9",
                  default_duration: int | None = 100_000_000, duration_ms: float | None = 1000.0,
                  blocks=((1, 1),) * 10, grouped: bool = False, doctype: bytes = b"webm",
                  cluster: bytes | None = None) -> bytes:
    """A Matroska file declaring what it is told, its blocks a few bytes of no codec's data: one track
    (number 1) of ``track_type`` (1 video, 2 audio), and one Cluster of ``blocks`` (track number,
    frames in the block: more than 1 is a laced block), SimpleBlocks or (``grouped``) BlockGroups;
    ``cluster`` the Cluster's payload instead."""
    info = ebml_element(0x2AD7B1, _uint(1_000_000))
    if duration_ms is not None:
        info += ebml_element(0x4489, struct.pack(">d", duration_ms))
    video = ebml_element(0xB0, _uint(width)) + ebml_element(0xBA, _uint(height))
    entry = (ebml_element(0xD7, _uint(1)) + ebml_element(0x83, _uint(track_type)) + ebml_element(0x86, codec)
             + (ebml_element(0x23E383, _uint(default_duration)) if default_duration else b"")
             + ebml_element(0xE0, video))
    generated = ebml_element(0xE7, _uint(0))
    for index, (track, frames) in enumerate(blocks):
        laced = frames > 1
        block = bytes([0x80 | track]) + struct.pack(">h", index) + bytes([0x80 | (0x02 if laced else 0)])
        block += (bytes([frames - 1]) + bytes(frames - 1) if laced else b"") + b"\x00\x01\x02"
        generated += ebml_element(0xA0, ebml_element(0xA1, block)) if grouped else ebml_element(0xA3, block)
    segment = (ebml_element(0x1549A966, info) + ebml_element(0x1654AE6B, ebml_element(0xAE, entry))
               + ebml_element(0x1F43B675, cluster if cluster is not None else generated))
    return ebml_element(0x1A45DFA3, ebml_element(0x4282, doctype)) + ebml_element(0x18538067, segment)
