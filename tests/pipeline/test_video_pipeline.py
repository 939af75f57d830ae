"""Video clips end to end: ``neva-pack preprocess --video_profile hf`` on records mixing clips (the video
zoo's MP4 H.264, MPEG-4 and WebM VP9), images and text, with the stand-in tokenizer, for Qwen2.5-VL and
Qwen3-VL -> the sample store (a clip's run kept whole: its <|video_pad|> ids, Qwen3-VL's timestamp text)
-> a compact output whose pool holds each distinct clip once as uint8 frames (and an energon output,
which carries the same). Read back, every pack's
item is what the family computes directly from the records (tokens, labels, ``pixel_values_videos``,
``video_grid_thw``, ``second_per_grid_ts``, mRoPE positions), and the Hugging Face and THD batches
carry them; ``neva-pack verify`` passes; 1 and 2
workers write the same bytes; a hostile clip is a counted skip with its own reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.files import paths
from neva_pack.formats import open_packed
from neva_pack.reading import PackedSeqDataset, dynamic_pack_item
from neva_pack.records import RawRecord
from neva_pack.samples import Skipped
from neva_pack.text import load_tokenizer
from neva_pack.training import hf_collate, thd_collate
from tests.dynamic_references import stand_in_tokenizer
from tests.families.test_video_native import QWEN2_5, QWEN3
from tests.samples.test_video_samples import TEMPLATES, as_pack, builder
from tests.video_zoo import make_clip

CLIPS = ("h264.mp4", "mpeg4.mp4", "vp9.webm")


def turns(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


RECORDS = [
    {"id": "clip", "video": "h264.mp4", "conversations": turns("<video>\nWhat happens?", "Things move about.")},
    {"id": "mixed", "videos": ["vp9.webm", "mpeg4.mp4"], "image": "a.png",
     "conversations": turns("<video> then <image> then <video>: compare", "They differ in many ways.")},
    {"id": "text", "conversations": turns("Hello there", "Hi, how are you?")},
    {"id": "image", "image": "b.png", "conversations": turns("<image> what?", "A picture.")},
    {"id": "again", "video": "h264.mp4", "conversations": turns("<video> once more", "The same clip.")},
    {"id": "short", "video": "noise.mp4", "conversations": turns("<video> broken", "x")},
]  # fmt: skip
"""The same clip twice (stored once), a record of two clips and an image in placeholder order, and a
clip that is not a video at all (skipped, counted, with its reason)."""


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("video_run")
    media = folder / "media"
    media.mkdir()
    for name in CLIPS:
        make_clip(media, name)
    rng = np.random.default_rng(0)
    for name, (height, width) in (("a.png", (40, 60)), ("b.png", (70, 50))):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(media / name)
    (media / "noise.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(4000))
    (folder / "data.json").write_text(json.dumps(RECORDS))
    stand_in_tokenizer(folder, "qwen")
    return folder


def run(workload: Path, name: str, output_dir: Path, workers: int, *extra: str, fmt: str = "compact", profile: str = "hf") -> int:
    return main(["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "media"),
                 "--tokenizer_path", str(workload), "--hf_vision_encoder", name, "--conv_template", TEMPLATES[name],
                 "--output_format", fmt, "--max_seq_length", "2048", "--video_profile", profile,
                 "--output_dir", str(output_dir), "--num_workers", str(workers), *extra])  # fmt: skip


@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_the_llamafactory_profile_samples_by_the_stream_duration_and_is_recorded(name, workload, tmp_path):
    """LLaMA-Factory's sampling from the header (tests/families/test_video_llamafactory.py holds it to the
    reference): h264.mp4, 10 frames over 1 s, keeps floor(1 s x 2 fps) = 2 frames; a WebM stream has no
    duration of its own (FFmpeg's), so that record is a counted skip with the reason."""
    assert run(workload, name, tmp_path / "lf", 1, profile="llamafactory") == 0
    prefix = paths.packed_prefix(tmp_path / "lf")
    skipped = [json.loads(line) for line in paths.skipped_path_of(prefix).read_text().splitlines()]
    assert [(s["index"], s["reason"]) for s in skipped] == [(1, "unreadable_video"), (5, "video_truncated")]
    assert "vp9.webm" in skipped[0]["detail"] and "duration" in skipped[0]["detail"]
    reader = open_packed(tmp_path / "lf")
    video = reader.meta.image_processor["video"]
    assert (video["profile"], video["fps"], video["max_frames"]) == ("llamafactory", 2.0, 128)
    clips = [image for p in range(len(reader)) for image in reader.pack(p).stored_images if image.frames]
    assert [clip.frames for clip in clips] == [2, 2]


def output_files(output_dir: Path) -> dict[str, bytes]:
    """The output's files and its store's, by name (the meta and progress files, which record times, left out)."""
    return {str(path.relative_to(output_dir)): path.read_bytes() for path in sorted(output_dir.rglob("*"))
            if path.is_file() and path.suffix not in (".json", ".jsonl")}  # fmt: skip


def assert_same_items(dataset, expected) -> None:
    """Every item of ``dataset`` is ``expected``'s (a dataset or a list of items): the same keys, each tensor equal."""
    assert len(dataset) == len(expected)
    for p in range(len(expected)):
        item, want = dataset[p], expected[p]
        assert sorted(item) == sorted(want) and all(torch.equal(item[key], want[key]) for key in want), p


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_a_video_run_reads_back_as_the_family_computes_it_directly(name, workload, tmp_path, capsys):
    assert run(workload, name, tmp_path / "one", 1) == 0
    assert run(workload, name, tmp_path / "two", 2) == 0
    assert output_files(tmp_path / "one") == output_files(tmp_path / "two")  # whatever the number of workers
    prefix = paths.packed_prefix(tmp_path / "one")
    assert verify(prefix, progress=False).ok
    assert main(["verify", str(tmp_path / "one")]) == 0

    skipped = [json.loads(line) for line in paths.skipped_path_of(prefix).read_text().splitlines()]
    assert [(s["index"], s["reason"]) for s in skipped] == [(5, "video_truncated")]  # an MP4 with no moov: a counted skip
    assert "video_truncated\": 1" in (tmp_path / "one" / "stats.json").read_text()  # counted in the run's report
    stats_clips = json.loads((tmp_path / "one" / "stats.json").read_text())["clips"]  # bytes per clip: each distinct clip once

    reader = open_packed(tmp_path / "one")
    assert reader.meta.image_processor["video"]["profile"] == "hf"
    stored = [image for p in range(len(reader)) for image in reader.pack(p).stored_images]
    clips = [image for image in stored if image.frames]
    assert len(clips) == 4 and len(reader.pool) == 5  # h264 twice, stored once; two images
    assert all(clip.parts[0].dtype == np.uint8 for clip in clips)
    distinct = {clip.parts[0].tobytes(): clip for clip in clips}.values()
    raw_bytes = sum(c.parts[0].nbytes for c in distinct)
    assert stats_clips == {"clips": 3, "frames": sum(c.frames for c in distinct), "bytes": raw_bytes, "stored_bytes": raw_bytes,
                           "compression": None}  # fmt: skip
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "one")]) == 0
    assert "video clips    3 stored once each" in capsys.readouterr().out

    # the family's model inputs, computed directly from the records
    tokenizer = load_tokenizer(workload)
    build = builder(name, workload / "media", tokenizer)
    samples = {k: build.build(RawRecord(index=k, value=record)) for k, record in enumerate(RECORDS)}
    assert isinstance(samples[5], Skipped) and samples[5].reason == skipped[0]["reason"]
    image_pad = tokenizer.token_to_id("<|image_pad|>")
    dataset = PackedSeqDataset(tmp_path / "one")
    plan = reader.plan_table()
    video_keys = 0
    for p in range(len(dataset)):
        records = plan.record_index[plan.offsets[p] : plan.offsets[p + 1]].tolist()
        pack, counts = as_pack([samples[k] for k in records])
        expected = dynamic_pack_item(pack, counts, build.preprocessor, image_pad)
        item = dataset[p]
        assert sorted(item) == sorted(expected)
        for key in expected:
            assert torch.equal(item[key], expected[key]), (p, key)
        video_keys += len(item["video_grid_thw"])
        assert ("second_per_grid_ts" in item) == (name == QWEN2_5)
    assert video_keys == 4
    items = [dataset[p] for p in range(len(dataset))]
    for collate in (hf_collate(dataset), thd_collate(dataset, with_packed_seq_params=False)):
        batch = collate(items)  # both batches carry the clips' keys, joined image by image
        for key in ("pixel_values_videos", "video_grid_thw", *(("second_per_grid_ts",) if name == QWEN2_5 else ())):
            assert torch.equal(batch[key], torch.cat([item[key] for item in items])), key

    # neva-pack plan --data_path plans the clips from their headers alone: what the run packed
    def plan(*target):
        capsys.readouterr()
        assert main(["plan", *target, "--pack_sizes", "2048", "--algorithms", "first_fit_shuffle", "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        return {key: value for key, value in row.items() if key != "seconds"}  # the plan's own time

    from_input = plan("--data_path", str(workload / "data.json"), "--image_folder", str(workload / "media"), "--tokenizer_path",
                      str(workload), "--hf_vision_encoder", name, "--conv_template", TEMPLATES[name], "--video_profile", "hf",
                      "--output_format", "compact")  # fmt: skip
    assert from_input == plan(str(tmp_path / "one"))

    # energon carries the same clips (uint8, each distinct one once per shard): the same items
    assert run(workload, name, tmp_path / "energon", 1, fmt="energon") == 0
    assert verify(paths.packed_prefix(tmp_path / "energon"), progress=False).ok
    assert_same_items(PackedSeqDataset(tmp_path / "energon"), items)


def test_a_clip_without_video_profile_is_a_counted_skip(workload, tmp_path, capsys):
    assert main(["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "media"),
                 "--tokenizer_path", str(workload), "--hf_vision_encoder", QWEN2_5, "--conv_template", "qwen2_vl",
                 "--output_format", "compact", "--max_seq_length", "2048", "--output_dir", str(tmp_path),
                 "--max_skip_fraction", "1"]) == 0  # fmt: skip
    skipped = [json.loads(line) for line in paths.skipped_path_of(paths.packed_prefix(tmp_path)).read_text().splitlines()]
    assert {s["index"]: s["reason"] for s in skipped} == {0: "videos_not_read", 1: "videos_not_read", 4: "videos_not_read",
                                                          5: "videos_not_read"}  # fmt: skip
    assert main(["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "media"),
                 "--tokenizer_path", str(workload), "--hf_vision_encoder", QWEN2_5, "--conv_template", "qwen2_vl",
                 "--output_dir", str(tmp_path / "f"), "--video_fps", "4"]) == 2  # fmt: skip
    assert "need --video_profile" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["nemo", "bridge"])
def test_formats_that_hold_no_clip_refuse_a_video_run_in_one_line(fmt, workload, tmp_path, capsys):
    assert run(workload, QWEN2_5, tmp_path, 0, fmt=fmt) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and fmt in error


def test_a_store_written_before_clips_is_refused_on_resume_in_one_line(workload, tmp_path, capsys):
    """Store version 7 keeps a clip's run whole and its frames in the pool's rows: an older store cannot
    be continued, and says so instead of misreading its runs."""
    data = tmp_path / "text.json"
    data.write_text(json.dumps([RECORDS[2]] * 3))
    command = ["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path", str(workload), "--hf_vision_encoder",
               QWEN2_5, "--conv_template", "qwen2_vl", "--output_format", "compact", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    assert main(command) == 0
    progress = tmp_path / "out" / paths.STORE_DIR / "progress.json"
    progress.write_text(progress.read_text().replace('"version": 8', '"version": 7'))
    capsys.readouterr()
    assert main([*command, "--resume"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "a sample store of version 7; this neva_pack needs 8" in error
