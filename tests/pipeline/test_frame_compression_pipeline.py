"""``--frame_compression zstd`` end to end: a video run (clips, images and text; Qwen2.5-VL and Qwen3-VL)
whose sample store pool -- and so the compact output's -- holds each clip and image as one zstd frame.
Read back, every item is bit-identical to the raw run's; 1 and 2 workers write the same bytes; the
meta, the store's progress file and the run report record the codec; stats give the bytes per clip
raw and stored; a sharded run joins its parts' frames undecoded; verify decodes every frame; a damaged frame is refused in one line; a --resume with
another setting, a format that copies the frames out of the pool and a fixed-crop encoder are refused
in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.core import InputError
from neva_pack.files import paths
from neva_pack.formats import open_packed
from neva_pack.reading import PackedSeqDataset
from neva_pack.sample_store import PoolWriter, pool_segment
from tests.families.test_video_native import QWEN2_5, QWEN3
from tests.pipeline.test_video_pipeline import (  # noqa: F401  (workload: the fixture)
    assert_same_items,
    output_files,
    run,
    workload,
)

ZSTD = ("--frame_compression", "zstd")


def clip_entries(output_dir) -> tuple[int, int]:
    """(clips, bytes of their zstd frames) in the output's pool, from its rows and sizes files."""
    store = output_dir / paths.STORE_DIR
    rows = np.concatenate([np.fromfile(path, dtype=_row()) for path in sorted(store.glob("shard_*.image_shapes"))])
    sizes = np.concatenate([np.fromfile(path, dtype="<i8") for path in sorted(store.glob("shard_*.entry_sizes"))])
    clips = rows["frames"] > 0
    return int(clips.sum()), int(sizes[clips].sum())


def _row():
    from neva_pack.sample_store import POOL_IMAGE_ROW

    return POOL_IMAGE_ROW


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN2_5, QWEN3])
def test_a_compressed_run_reads_back_bit_identical_to_the_raw_run(name, workload, tmp_path, capsys):  # noqa: F811
    assert run(workload, name, tmp_path / "raw", 1) == 0
    assert run(workload, name, tmp_path / "zstd", 1, *ZSTD) == 0
    assert run(workload, name, tmp_path / "zstd2", 2, *ZSTD) == 0
    assert output_files(tmp_path / "zstd") == output_files(tmp_path / "zstd2")  # whatever the number of workers

    raw, packed = PackedSeqDataset(tmp_path / "raw"), PackedSeqDataset(tmp_path / "zstd")
    assert len(raw) > 0
    assert_same_items(packed, raw)
    assert sum(len(packed[p]["video_grid_thw"]) for p in range(len(packed))) == 4

    reader = open_packed(tmp_path / "zstd")
    assert all(part["codec"] == "zstd" and part["sizes"].endswith(".entry_sizes") for part in reader.meta.layout["pool"])
    assert "codec" not in json.dumps(open_packed(tmp_path / "raw").meta.layout)  # a raw output's meta as before the flag
    progress = json.loads((tmp_path / "zstd" / paths.STORE_DIR / "progress.json").read_text())
    assert progress["frame_compression"] == "zstd" and progress["fingerprint"]["frame_compression"] == "zstd"
    assert "frame_compression" not in (tmp_path / "raw" / paths.STORE_DIR / "progress.json").read_text()

    raw_clips = json.loads((tmp_path / "raw" / "stats.json").read_text())["clips"]
    clips = json.loads((tmp_path / "zstd" / "stats.json").read_text())["clips"]
    count, stored = clip_entries(tmp_path / "zstd")
    assert raw_clips["compression"] is None and raw_clips["stored_bytes"] == raw_clips["bytes"]
    assert clips == {**raw_clips, "stored_bytes": stored, "compression": "zstd"} and count == clips["clips"] == 3
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "zstd")]) == 0
    assert f"zstd         {stored / 1e6:,.1f} MB stored ({stored / 3e6:,.2f} MB per clip" in capsys.readouterr().out

    # the workers' frames (compressed where the samples were built) are those the store's writer makes of the same clips
    pool = reader.pool
    again = PoolWriter(pool_segment(tmp_path, "shard_00000", 0, dynamic=True, codec="zstd"), {}, 0)
    for image in pool.read_stored(range(len(pool))):
        again.add(image)
    again.close()
    written = b"".join(segment.images_file.read_bytes() for segment in pool.segments)
    assert (tmp_path / "shard_00000.images").read_bytes() == written

    prefix = paths.packed_prefix(tmp_path / "zstd")
    assert verify(prefix, progress=False).ok
    assert main(["verify", str(tmp_path / "zstd")]) == 0

    # a sharded run: each shard's part compresses its own pool, the final step copies the frames undecoded
    for index in ("0", "1"):
        assert run(workload, name, tmp_path / "sharded", 0, *ZSTD, "--num_shards", "2", "--shard_index", index) == 0
    assert run(workload, name, tmp_path / "sharded", 0, *ZSTD, "--num_shards", "2") == 0
    assert verify(paths.packed_prefix(tmp_path / "sharded"), progress=False).ok
    assert_same_items(PackedSeqDataset(tmp_path / "sharded"), raw)
    assert json.loads((tmp_path / "sharded" / "stats.json").read_text())["clips"] == clips


def test_a_damaged_frame_fails_verify_and_the_reader_refuses_it_in_one_line(workload, tmp_path, capsys):  # noqa: F811
    assert run(workload, QWEN2_5, tmp_path, 0, *ZSTD) == 0
    (images,) = sorted((tmp_path / paths.STORE_DIR).glob("shard_*.images"))
    data = bytearray(images.read_bytes())
    data[len(data) // 3] ^= 0xFF
    images.write_bytes(bytes(data))
    result = verify(paths.packed_prefix(tmp_path), progress=False)
    assert not result.ok and any("zstd frame" in problem for problem in result.problems), result.problems
    dataset = PackedSeqDataset(tmp_path)
    refused = []
    for p in range(len(dataset)):
        try:
            dataset[p]
        except InputError as exc:
            refused.append(str(exc))
    assert refused and all(len(message.splitlines()) == 1 and "zstd frame" in message for message in refused)

    (sizes,) = sorted((tmp_path / paths.STORE_DIR).glob("shard_*.entry_sizes"))  # where each frame lies: a trusted file
    values = np.fromfile(sizes, dtype="<i8")
    values[0], values[1] = values[0] + values[1] - 1, 1
    values.tofile(sizes)
    with pytest.raises(InputError) as caught:
        PackedSeqDataset(tmp_path)
    assert len(str(caught.value).splitlines()) == 1 and sizes.name in str(caught.value)


def test_a_resume_with_another_frame_compression_is_refused_in_one_line(workload, tmp_path, capsys):  # noqa: F811
    assert run(workload, QWEN2_5, tmp_path, 0, *ZSTD) == 0
    capsys.readouterr()
    assert run(workload, QWEN2_5, tmp_path, 0, "--resume") == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "frame_compression" in error
    assert run(workload, QWEN2_5, tmp_path, 0, "--resume", "--frame_compression", "none") == 2  # none is the default, spelled out
    assert run(workload, QWEN2_5, tmp_path, 0, "--resume", *ZSTD) == 0


@pytest.mark.parametrize("fmt", ["energon", "llamafactory"])
def test_a_format_copying_frames_out_of_the_pool_refuses_the_flag_in_one_line(fmt, workload, tmp_path, capsys):  # noqa: F811
    assert run(workload, QWEN2_5, tmp_path, 0, *ZSTD, fmt=fmt) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--frame_compression" in error and fmt in error


def test_a_fixed_crop_encoder_refuses_the_flag_in_one_line(workload, tmp_path, capsys):  # noqa: F811
    data = tmp_path / "text.json"
    data.write_text(json.dumps([{"id": "t", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    assert main(["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path", str(workload), "--output_format", "compact",
                 "--output_dir", str(tmp_path / "out"), *ZSTD]) == 2  # fmt: skip
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "crops every image to one size" in error
