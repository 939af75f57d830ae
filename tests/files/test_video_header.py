"""Video container headers: every zoo clip's header equals what PyAV reports for it (and what the clip
was made to be), read from the bytes a header needs only; every hostile header is one
``VideoHeaderError`` with its own reason, never another exception, a hang or a large allocation."""

from __future__ import annotations

import io
import math
import struct
import time

import av
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from video_zoo import (
    ZOO,
    ebml_element,
    make_zoo,
    mp4_box,
    mp4_boxes,
    rewrite_moov,
    synthetic_mkv,
    synthetic_mp4,
)

from neva_pack.files import (
    MAX_VIDEO_FRAMES,
    VIDEO_HEADER_REASONS,
    VideoHeaderError,
    read_video_header,
    read_video_header_at,
    read_video_header_file,
)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return make_zoo(tmp_path_factory.mktemp("video_zoo"))


def pyav_facts(path):
    """What the reference loaders read: PyAV's stream metadata, the decoded frames and their rotation."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.rotation for frame in container.decode(stream)]
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        duration = float(stream.duration * stream.time_base) if stream.duration else container.duration / 1e6
        return {"frames": stream.frames, "fps": float(stream.average_rate), "duration_s": duration,
                    "width": stream.width, "height": stream.height, "decoded": len(frames), "rotation": (-frames[0]) % 360}


@pytest.mark.parametrize("name", ZOO)
def test_header_equals_pyav_and_the_clip_as_made(zoo, name):
    clip = zoo[name]
    header = read_video_header(clip.path.read_bytes())
    ref = pyav_facts(clip.path)
    assert (header.container, header.codec) == (clip.container, clip.codec)
    assert (header.width, header.height) == (ref["width"], ref["height"]) == (clip.width, clip.height)
    assert header.rotation == ref["rotation"] == clip.rotation
    assert header.fps == ref["fps"]
    assert header.fps == pytest.approx(clip.fps, rel=1e-12)
    assert header.duration_s == pytest.approx(ref["duration_s"], abs=1e-9)
    # Matroska counts time in TimecodeScale units (FFmpeg writes milliseconds)
    assert header.duration_s == pytest.approx(clip.duration_s, abs=1e-3 if clip.container == "matroska" else 1e-9)
    assert header.presented_frames == ref["decoded"] == clip.decoded
    if clip.container == "mp4":
        assert header.frame_count == ref["frames"] == clip.frames
    else:  # Matroska declares no count: PyAV says 0, the header counts the frames in the blocks
        assert ref["frames"] == 0
        assert header.frame_count == ref["decoded"] == clip.frames


def test_an_edit_list_that_trims_the_start_is_flagged_before_any_decode(zoo):
    trimmed = read_video_header(zoo["edit_trim.mp4"].path.read_bytes())
    assert (trimmed.frame_count, trimmed.presented_frames, trimmed.frames_disagree) == (8, 6, True)
    for name in ("h264.mp4", "edit_delay.mp4", "vfr.mp4"):  # B-frame and delaying edit lists present every frame
        assert not read_video_header(zoo[name].path.read_bytes()).frames_disagree


@pytest.mark.parametrize("edit", [(2048, 300), (3072, 0), (1024, None), (0, 250)])
def test_edit_lists_combining_delay_and_trim_match_pyav(zoo, tmp_path, edit):
    path = tmp_path / "edited.mp4"
    path.write_bytes(rewrite_moov(zoo["mpeg4.mp4"].path.read_bytes(), edit=edit))
    header, ref = read_video_header(path.read_bytes()), pyav_facts(path)
    assert (header.frame_count, header.presented_frames) == (ref["frames"], ref["decoded"])
    assert header.duration_s == pytest.approx(ref["duration_s"], abs=1e-9)
    assert header.fps == ref["fps"]


@pytest.mark.parametrize(("version", "media_time"), [(0, 0), (0, 1024), (1, 0), (1, 1024)])
def test_negative_composition_offsets_are_read_as_ffmpeg_reads_them(zoo, tmp_path, version, media_time):
    """An encoder may write ctts offsets below zero (version 1, and in version 0 boxes too): the
    frames whose composition time falls before the edit are the ones the decoder drops."""
    data = bytearray(zoo["h264.mp4"].path.read_bytes())
    at = data.index(b"ctts") + 4
    data[at] = version
    for entry in range(struct.unpack_from(">I", data, at + 4)[0]):
        count, offset = struct.unpack_from(">Ii", data, at + 8 + 8 * entry)
        struct.pack_into(">Ii", data, at + 8 + 8 * entry, count, offset - 2048)  # two frames earlier
    struct.pack_into(">i", data, data.index(b"elst") + 4 + 12, media_time)
    path = tmp_path / "negative.mp4"
    path.write_bytes(bytes(data))
    header, ref = read_video_header(bytes(data)), pyav_facts(path)
    assert (header.frame_count, header.presented_frames) == (ref["frames"], ref["decoded"])
    assert header.duration_s == ref["duration_s"]


class CountingFile(io.BytesIO):
    """A file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, size=-1):
        data = super().read(size)
        self.read_bytes += len(data)
        return data


@pytest.mark.parametrize("name", ZOO)
def test_a_file_is_read_for_its_header_only(zoo, name):
    """The media data is never read: with moov after mdat (FFmpeg's default), the first 64 KiB (the
    whole of a zoo clip) then moov; padded with 1 MB of media, the reads stay as small."""
    data = zoo[name].path.read_bytes()
    if zoo[name].container == "mp4":
        boxes = mp4_boxes(data)
        padded = b"".join(mp4_box(kind, payload + bytes(1 << 20) if kind == b"mdat" else payload)
                          for kind, payload in boxes)
        file = CountingFile(padded)
        assert read_video_header_file(file) == read_video_header(data)
        assert file.read_bytes < (1 << 16) + len(dict(boxes)[b"moov"]) + 64
    else:
        file = CountingFile(data)
        assert read_video_header_file(file) == read_video_header(data)


def test_a_reader_callable_sees_only_ranges_inside_the_file(zoo):
    data = zoo["h264.mp4"].path.read_bytes()
    asked = []

    def read(offset, size):
        asked.append((offset, size))
        return data[offset:offset + size]

    assert read_video_header_at(read, len(data)) == read_video_header(data)
    assert all(0 <= offset and offset + size <= len(data) for offset, size in asked)


# -- hostile headers ----------------------------------------------------------------------------------

def refused(data: bytes, reason: str, **limits) -> VideoHeaderError:
    with pytest.raises(VideoHeaderError) as caught:
        read_video_header(data, **limits)
    assert caught.value.reason == reason, str(caught.value)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(reason)
    return caught.value


def test_a_synthetic_header_reads_as_declared():
    header = read_video_header(synthetic_mp4(width=64, height=48, timescale=30000, stts=((300, 1001),)))
    assert (header.frame_count, header.width, header.height, header.codec) == (300, 64, 48, "avc1")
    assert header.fps == 30000 / 1001 and header.duration_s == 300 * 1001 / 30000


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(timescale=st.integers(1, 10**7), runs=st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 10**6)),
                                                       min_size=1, max_size=6))
def test_declared_timing_reads_as_pyav_reads_it(tmp_path, timescale, runs):
    """Frame rates whose terms pass 2^31 are approximated as FFmpeg does (av_reduce), to the last bit.
    (PyAV's duration of a file without media is not compared: with no codec data its probe moves the
    stream to a 1/90000 time base without rescaling the duration.)"""
    path = tmp_path / "timing.mp4"
    path.write_bytes(synthetic_mp4(timescale=timescale, stts=tuple(runs)))
    header = read_video_header(path.read_bytes())
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert header.frame_count == stream.frames
        assert header.fps == float(stream.average_rate)
    ticks = sum(count * ticks for count, ticks in runs)
    declared = ticks & 0xFFFFFFFF  # the media header's 32-bit duration field
    assert header.duration_s == (0 if declared == 0xFFFFFFFF else min(declared, ticks)) / timescale


def test_a_truncated_moov_is_refused(zoo):
    data = zoo["h264.mp4"].path.read_bytes()
    for cut in (len(data) - 1, len(data) - 200, data.index(b"moov") + 4):
        refused(data[:cut], "video_truncated")


def test_a_billion_declared_frames_are_refused_before_any_table_is_expanded():
    started = time.perf_counter()
    refused(synthetic_mp4(stts=((10**9, 1),)), "video_too_many_frames")
    refused(synthetic_mp4(stts=((4_000_000_000, 1),) * 3), "video_too_many_frames")
    refused(synthetic_mp4(stts=((1000, 1),)), "video_too_many_frames", max_frames=999)
    assert time.perf_counter() - started < 1


def test_composition_offsets_for_a_billion_samples_are_cut_to_the_samples_there_are(zoo):
    """ctts runs are untrusted counts: they never size an allocation."""
    data = zoo["h264.mp4"].path.read_bytes()
    at = data.index(b"ctts") + 4 + 8  # version/flags, entry count: the first run's count
    hostile = data[:at] + struct.pack(">I", 10**9) + data[at + 4:]
    started = time.perf_counter()
    header = read_video_header(hostile)
    assert header.frame_count == 10 and time.perf_counter() - started < 1


def test_a_moov_of_a_million_empty_boxes_is_refused_without_listing_them():
    moov = mp4_box(b"mvhd", bytes(100)) + mp4_box(b"free", b"") * 1_000_000
    started = time.perf_counter()
    refused(mp4_box(b"ftyp", b"isom\0\0\0\0") + mp4_box(b"moov", moov), "video_malformed")
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("fields", [{"timescale": 0}, {"stts": ((10, 0),)}, {"stts": ((10, 0xFFFFFFFF),)}])
def test_a_zero_or_nan_frame_rate_is_refused(fields):
    refused(synthetic_mp4(**fields), "video_bad_frame_rate")


def test_an_8k_by_8k_frame_is_refused():
    refused(synthetic_mp4(width=8192, height=8192), "video_too_large")
    refused(synthetic_mp4(width=64, height=48), "video_too_large", max_pixels=64 * 48 - 1)


def test_an_audio_only_file_is_refused():
    refused(synthetic_mp4(handler=b"soun", entry=b"mp4a"), "video_no_video_track")


@pytest.mark.parametrize("data", [b"", synthetic_mp4(stts=()), synthetic_mp4(width=0)])
def test_a_zero_length_clip_is_refused(data):
    refused(data, "video_empty")


def test_sample_tables_that_disagree_are_refused():
    refused(synthetic_mp4(stts=((10, 100),), sizes=11), "video_malformed")


def test_a_box_smaller_than_its_header_or_larger_than_its_parent_is_refused():
    refused(struct.pack(">I4s", 4, b"ftyp") + bytes(16), "video_malformed")
    refused(struct.pack(">I4s", 1 << 30, b"moov") + bytes(16), "video_truncated")
    refused(struct.pack(">I4sQ", 1, b"moov", 1 << 62) + bytes(16), "video_truncated")


def test_a_fragmented_mp4_is_unsupported():
    data = synthetic_mp4()
    moov = dict(mp4_boxes(data))[b"moov"]
    refused(mp4_box(b"ftyp", b"isom\0\0\0\0") + mp4_box(b"moov", moov + mp4_box(b"mvex", b"")), "video_unsupported")


def test_an_unknown_file_is_refused():
    refused(b"\x89PNG\r\n\x1a\n" + bytes(64), "video_unknown_format")


# -- Matroska -----------------------------------------------------------------------------------------

EBML_HEADER = ebml_element(0x1A45DFA3, ebml_element(0x4282, b"webm"))


def test_billion_laughs_ebml_nesting_is_skipped_not_descended():
    """A million masters nested inside each other under the Segment, each declaring the rest as its
    size: the reader skips the outer one by its size and finds no video track, in bounded time."""
    nested = b""
    for _ in range(10_000):
        nested = ebml_element(0x1F43B675 if len(nested) % 2 else 0xEC, nested)
    data = EBML_HEADER + ebml_element(0x18538067, nested)
    started = time.perf_counter()
    refused(data, "video_no_video_track")
    assert time.perf_counter() - started < 1


def test_a_wide_ebml_file_meets_the_element_budget():
    voids = ebml_element(0xEC, b"") * 200_000
    started = time.perf_counter()
    refused(EBML_HEADER + ebml_element(0x18538067, voids), "video_header_too_large", max_frames=1000)
    assert time.perf_counter() - started < 2


def test_huge_declared_ebml_sizes_are_refused():
    refused(EBML_HEADER + ebml_element(0x18538067, b"", size=1 << 50), "video_truncated")
    info = ebml_element(0x1549A966, b"", size=1 << 40)  # larger than the Segment, which the file holds whole
    refused(EBML_HEADER + ebml_element(0x18538067, info) + ebml_element(0xEC, bytes(8)), "video_malformed")
    info = ebml_element(0x1549A966, ebml_element(0x2AD7B1, bytes(1 << 17)))
    refused(EBML_HEADER + ebml_element(0x18538067, info), "video_malformed")


def test_a_matroska_clip_cut_short_is_refused(zoo):
    data = zoo["vp9.webm"].path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40):
        with pytest.raises(VideoHeaderError) as caught:
            read_video_header(data[:cut])
        assert caught.value.reason in {"video_truncated", "video_malformed"}


def test_an_unknown_size_segment_and_cluster_read_as_known_ones(zoo):
    """A live recording writes "unknown" sizes (all ones): the counts are the same."""
    data = zoo["vp9.webm"].path.read_bytes()
    unknown = data
    for element_id in (b"\x18\x53\x80\x67", b"\x1f\x43\xb6\x75"):
        at = unknown.index(element_id) + 4
        length = 9 - unknown[at].bit_length()
        unknown = unknown[:at] + b"\x01\xff\xff\xff\xff\xff\xff\xff" + unknown[at + length:]
    assert read_video_header(unknown) == read_video_header(data)


def test_a_synthetic_matroska_header_reads_as_declared():
    header = read_video_header(synthetic_mkv(width=640, height=360, default_duration=33_366_667, duration_ms=400.4,
                                             blocks=((1, 1),) * 12))
    assert (header.container, header.codec, header.width, header.height) == ("matroska", "V_VP9", 640, 360)
    assert (header.frame_count, header.presented_frames, header.duration_s) == (12, 12, 0.4004)
    assert header.fps == 30000 / 1001  # 10^9 / 33,366,667 ns, approximated as FFmpeg does (terms <= 30000)


def test_matroska_frames_are_counted_through_lacing_block_groups_and_other_tracks():
    blocks = ((1, 1), (2, 1), (1, 4), (2, 3), (1, 1))
    assert read_video_header(synthetic_mkv(blocks=blocks)).frame_count == 6
    assert read_video_header(synthetic_mkv(blocks=blocks, grouped=True)).frame_count == 6


MATROSKA = [name for name in ZOO if name.endswith((".webm", ".mkv"))]


@pytest.mark.parametrize("name", MATROSKA)
def test_matroska_frames_estimated_from_durations_equal_the_counted_ones(zoo, name):
    """``count_frames=False``: round(Duration / DefaultDuration), read before the first Cluster."""
    data = zoo[name].path.read_bytes()
    file = CountingFile(data)
    estimated = read_video_header_file(file, count_frames=False)
    assert estimated == read_video_header(data) and estimated.frame_count == zoo[name].decoded
    assert file.read_bytes < data.index(b"\x1f\x43\xb6\x75") + (1 << 15)  # the first Cluster, and no further


def test_an_estimate_needs_a_default_duration_and_refuses_a_billion_frames():
    counted = synthetic_mkv(default_duration=None, blocks=((1, 1),) * 7)
    assert read_video_header(counted, count_frames=False).frame_count == 7
    refused(synthetic_mkv(default_duration=1, duration_ms=1e6), "video_too_many_frames", count_frames=False)


def test_matroska_without_default_duration_takes_frames_over_duration(zoo, tmp_path):
    """FFmpeg estimates such a track's rate from the first decoded timestamps; the header cannot, so
    it divides: the two agree to within the rounding of millisecond timestamps."""
    assert read_video_header(synthetic_mkv(default_duration=None, duration_ms=500.0)).fps == 20.0
    data = zoo["ntsc.mkv"].path.read_bytes()
    at = data.index(b"\x23\xe3\x83")
    length = 4 + (data[at + 3] & 0x7F)
    path = tmp_path / "no_default_duration.mkv"
    path.write_bytes(data[:at] + bytes([0xEC, 0x80 | (length - 2)]) + bytes(length - 2) + data[at + length:])
    header, ref = read_video_header(path.read_bytes()), pyav_facts(path)
    assert header.frame_count == ref["decoded"] == 7
    assert header.fps == pytest.approx(ref["fps"], rel=0.02)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"track_type": 2, "codec": b"A_OPUS"}, "video_no_video_track"),
    ({"width": 8192, "height": 8192}, "video_too_large"),
    ({"width": 0}, "video_empty"),
    ({"blocks": ()}, "video_empty"),
    ({"duration_ms": float("nan")}, "video_bad_frame_rate"),
    ({"duration_ms": 0.0}, "video_bad_frame_rate"),
    ({"duration_ms": None}, "video_bad_frame_rate"),
    ({"duration_ms": 1e308}, "video_bad_frame_rate"),
    ({"blocks": ((1, 200),) * 10}, "video_too_many_frames"),
    ({"doctype": b"notmkv"}, "video_unknown_format"),
])
def test_hostile_matroska_headers_are_refused(fields, reason):
    refused(synthetic_mkv(**fields), reason, max_frames=1000)


def test_matroska_track_numbers_beyond_the_track_budget_are_refused():
    """Blocks of a million track numbers (each a two-byte number) never make a million counters."""
    blocks = b"".join(ebml_element(0xA3, (0x4000 | number).to_bytes(2, "big") + bytes(4)) for number in range(2000))
    error = refused(synthetic_mkv(cluster=blocks), "video_malformed")
    assert "track numbers" in str(error)


def test_the_header_budget_bounds_the_bytes_read(zoo):
    data = zoo["h264.mp4"].path.read_bytes()
    refused(data, "video_header_too_large", max_header_bytes=64)


# -- fuzz ---------------------------------------------------------------------------------------------

EDITS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(ZOO), edits=EDITS, cut=st.integers(0, 1 << 20))
def test_random_byte_edits_give_a_header_or_a_video_header_error(zoo, name, edits, cut):
    edited(zoo[name].path.read_bytes(), edits, cut)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(ZOO), edits=EDITS, cut=st.integers(0, 1 << 20))
def test_many_random_byte_edits_give_a_header_or_a_video_header_error(zoo, name, edits, cut):
    edited(zoo[name].path.read_bytes(), edits, cut)


HEADER_ONLY = {"mp4": synthetic_mp4(stts=((3, 100), (2, 50))), "mkv": synthetic_mkv(blocks=((1, 1), (1, 3), (2, 1))),
               "mkv grouped": synthetic_mkv(grouped=True, blocks=((1, 2),) * 3)}


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(HEADER_ONLY)), edits=EDITS, cut=st.integers(0, 1 << 20))
def test_random_edits_of_header_only_files_give_a_header_or_a_video_header_error(name, edits, cut):
    """The same on files that are all header: every edit lands on a size, an ID or a count."""
    edited(HEADER_ONLY[name], edits, cut)


def edited(original: bytes, edits, cut: int) -> None:
    data = bytearray(original)
    for at, value in edits:
        data[at % len(data)] = value
    data = bytes(data[:max(1, len(data) - cut % 64)])
    started = time.perf_counter()
    try:
        header = read_video_header(data)
    except VideoHeaderError as exc:
        assert exc.reason in VIDEO_HEADER_REASONS
    else:
        assert 0 < header.frame_count <= MAX_VIDEO_FRAMES and header.presented_frames <= MAX_VIDEO_FRAMES
        assert header.rotation in (0, 90, 180, 270) and header.width > 0 and header.height > 0
        assert math.isfinite(header.fps) and header.fps > 0
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("declared", [0, 4096, 0xFFFFFFFF])
def test_the_media_header_duration_caps_the_stream_duration_as_in_pyav(zoo, tmp_path, declared):
    data = zoo["mpeg4.mp4"].path.read_bytes()
    at = data.index(b"mdhd") + 4 + 16  # version/flags, creation, modification, timescale
    path = tmp_path / "declared.mp4"
    path.write_bytes(data[:at] + struct.pack(">I", declared) + data[at + 4:])
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        expected = float((stream.duration or 0) * stream.time_base)
    assert read_video_header(path.read_bytes()).duration_s == expected
