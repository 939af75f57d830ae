"""Hostile inputs: no record can kill, hang, corrupt or escape a run; concurrent runs and
--overwrite cannot lose data; every bad argument and every bad file the tool reads (data,
images, configuration) fails at once with one line or is one record's counted skip.

Each case is three good records with one hostile record among them (built here, in a tmp dir). A
run must exit as stated, skip the hostile record with its reason (or refuse the run with one line),
and leave an output that ``neva-pack verify OUT --data_path DATA`` accepts.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from benchmarks.bench_hostile import (  # the same hostile files the benchmark measures
    blp_unknown_encoding,
    dds_unknown_pixel_format,
    jpeg_claiming,
    many_images_record,
    progressive_jpeg_with_scans,
)
from neva_pack.cli import main
from neva_pack.core import ImageRun
from neva_pack.packing import PackSpec, accounting_problem, pack_problems
from neva_pack.pipeline import LOCK_FILE, OutputLock
from neva_pack.records import iter_raw_records
from neva_pack.records import SKIP_REASONS, RecordError
from neva_pack.samples import truncation
from neva_pack.commands import verify
from neva_pack.files import skipped_path, stats_path, store_dir
from tests.conftest import SAMPLE_DATA

TOKENIZER = SAMPLE_DATA / "tokenizer.model"


def conversation(question="What is shown?", answer="A cat."):
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


GOOD = [
    {"id": "good0", "conversations": conversation("Hi there", "Hello!")},
    {"id": "good1", "image": "chelsea.jpg", "conversations": conversation("<image>\nWhat is this?", "A cat.")},
    {"id": "good2", "conversations": conversation("Name a colour.", "Blue.")},
]
HOSTILE_AT = 1
"""The hostile record's index: records are read on after it."""


@dataclass
class Run:
    code: int
    out: Path
    data: Path
    err: str
    reasons: dict[int, str]
    """Skipped record index -> reason."""

    @property
    def verified(self) -> bool:
        result = verify(self.out, data_path=self.data, progress=False)
        assert result.ok, result.problems
        return True


@pytest.fixture()
def images(tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", folder)
    return folder


def text_of(record) -> str:
    return record if isinstance(record, str) else json.dumps(record)


def write_data(path: Path, records, fmt: str) -> Path:
    texts = [text_of(r) for r in records]
    path.write_text("\n".join(texts) + "\n" if fmt == "jsonl" else "[\n" + ",\n".join(texts) + "\n]\n", encoding="utf-8")
    return path


def run_with(tmp_path, capsys, images, hostile, *extra, fmt="jsonl") -> Run:
    records = GOOD[:HOSTILE_AT] + [hostile] + GOOD[HOSTILE_AT:]
    data = write_data(tmp_path / f"data.{fmt}", records, fmt)
    return run_on(tmp_path, capsys, data, images, *extra)


def run_on(tmp_path, capsys, data, images, *extra) -> Run:
    out = tmp_path / "out"
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(images),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(out), "--conv_template", "v1",
                 "--num_workers", "0", *extra])  # fmt: skip
    err = capsys.readouterr().err
    reasons = {}
    if skipped_path(out).is_file():
        reasons = {line["index"]: line["reason"] for line in map(json.loads, skipped_path(out).read_text().splitlines())}
    return Run(code, out, data, err, reasons)


def png_bytes(width: int, height: int, mode: str = "RGB", array=None) -> bytes:
    image = Image.fromarray(array) if array is not None else Image.new(mode, (width, height))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def image_record(name: str) -> dict:
    return {"id": "hostile", "image": name, "conversations": conversation("<image>\nWhat is this?", "Nothing.")}


# ---------------------------------------------------------------------------------------------
# 1. One record can neither kill nor hang the run: every per-record failure is a counted skip

DEEP = "[" * 100_000 + "]" * 100_000
SURROGATE_VALUE = '{"id": "s", "conversations": [{"from": "human", "value": "bad \\ud800"}, {"from": "gpt", "value": "x"}]}'
SURROGATE_IMAGE = '{"id": "s", "image": "\\udc80.jpg", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}'
SURROGATE_ID = '{"id": "\\ud800", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}]}'

RECORD_CASES = {
    "role is a list (unhashable)": ({"conversations": [{"from": ["human"], "value": "q"}, {"from": "gpt", "value": "a"}]},
                                    (), "unknown_role"),
    "NUL in an image name": (image_record("cat\x00.jpg"), (), "malformed_record"),
    "lone surrogate in a value": (SURROGATE_VALUE, (), "invalid_unicode"),
    "lone surrogate in an image name": (SURROGATE_IMAGE, (), "invalid_unicode"),
    "lone surrogate in the id": (SURROGATE_ID, (), "invalid_unicode"),
    "100,000 levels deep": (DEEP, (), "record_too_deep"),
    "over --max_record_bytes": ({"conversations": conversation("x" * 20_000)}, ("--max_record_bytes", "10000"),
                                "record_too_large"),
    "over --max_conversation_chars": ({"conversations": conversation("x" * 5_000)}, ("--max_conversation_chars", "1000"),
                                      "conversation_too_long"),
    "many empty turns (the template's text counts)": ({"conversations": conversation("", "") * 200},
                                                      ("--max_conversation_chars", "1000"), "conversation_too_long"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_a_pathological_record_is_skipped_and_the_rest_packed(tmp_path, capsys, images, case, fmt):
    record, extra, reason = RECORD_CASES[case]
    run = run_with(tmp_path, capsys, images, record, *extra, fmt=fmt)
    assert run.code == 0, run.err
    assert run.reasons == {HOSTILE_AT: reason}
    assert run.verified


def wide_png(folder: Path) -> str:
    (folder / "wide.png").write_bytes(png_bytes(20_000, 1))  # ~100 bytes; 400 Mpx padded, 336 x 6.7M resized
    return "wide.png"


def fifo(folder: Path) -> str:
    os.mkfifo(folder / "x.jpg")  # opening it for reading would block forever
    return "x.jpg"


IMAGE_CASES = {
    "/dev/zero (outside the folder)": (lambda folder: "/dev/zero", (), "outside_image_folder"),
    "/dev/zero allowed outside: not a regular file": (lambda folder: "/dev/zero", ("--allow_outside_image_folder",),
                                                      "unreadable_image"),
    "a FIFO named x.jpg": (fifo, (), "unreadable_image"),
    "20000x1 PNG, square": (wide_png, (), "image_too_large"),
    "20000x1 PNG, pad": (wide_png, ("--image_aspect_ratio", "pad"), "image_too_large"),
    "over --max_image_bytes": (lambda folder: "chelsea.jpg", ("--max_image_bytes", "1000"), "image_too_large"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_a_hostile_image_is_skipped_without_reading_it_whole(tmp_path, capsys, images, case):
    make, extra, reason = IMAGE_CASES[case]
    run = run_with(tmp_path, capsys, images, image_record(make(images)), *extra, "--max_skip_fraction", "1")
    assert run.code == 0, run.err
    skipped = set(run.reasons.values())
    assert run.reasons.get(HOSTILE_AT) == reason
    assert skipped == {reason}  # with --max_image_bytes 1000, the good image record is skipped too
    assert run.verified


def test_the_image_budget_names_the_limit_and_the_flag(tmp_path, capsys, images):
    run = run_with(tmp_path, capsys, images, image_record(wide_png(images)), "--image_aspect_ratio", "pad")
    detail = json.loads(skipped_path(run.out).read_text())["detail"]
    assert detail == "wide.png: padded to 20000 x 20000 = 400,000,000 pixels > --max_image_pixels 36,000,000"


def test_json_list_scanner_gives_json_loads_values_at_any_chunk_boundary(tmp_path, monkeypatch):
    import neva_pack.records.list_scanner as list_scanner

    values = [GOOD[1], [1, [2, "\\"]], 'a"b\\', 1.5, None, {"k": ']]]\\"[[', "ü": "日本"}, [], {}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(values, indent=1, ensure_ascii=False), encoding="utf-8")
    for chunk in (1, 2, 3, 7, 64):
        monkeypatch.setattr(list_scanner, "READ_CHUNK", chunk)
        assert [raw.value for raw in iter_raw_records(path)] == values


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(alphabet=st.sampled_from('ab"\\[]{},: \nü'), max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(JSON_VALUES, max_size=6), indent=st.sampled_from([None, 1]), chunk=st.integers(1, 40))
def test_property_the_list_scanner_agrees_with_json_loads(tmp_path_factory, values, indent, chunk):
    import neva_pack.records.list_scanner as list_scanner
    from neva_pack.records import count_records

    path = tmp_path_factory.mktemp("scan") / "data.json"
    path.write_text(json.dumps(values, indent=indent, ensure_ascii=False), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(list_scanner, "READ_CHUNK", chunk)
        assert [raw.value for raw in iter_raw_records(path)] == values
        assert count_records(path) == len(values)


def test_counting_and_reading_agree_on_blank_and_oversized_jsonl_lines(tmp_path):
    from neva_pack.records import count_records

    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n' + b" " * 2_000_000 + b'\n\n{"b": 2}\n' + b"x" * 9_000_000 + b'\n{"c": 3}')
    raws = list(iter_raw_records(path))
    assert [(raw.value, raw.reason if raw.error else None) for raw in raws] == [
        ({"a": 1}, None), ({"b": 2}, None), (None, "record_too_large"), ({"c": 3}, None)]  # fmt: skip
    assert count_records(path) == len(raws)


def test_new_skip_reasons_are_listed_with_their_meaning():
    for reason in ("record_too_large", "record_too_deep", "conversation_too_long", "invalid_unicode",
                   "outside_image_folder", "image_too_large", "no_supervised_tokens", "image_too_slow",
                   "too_many_images"):  # fmt: skip
        assert SKIP_REASONS[reason]


# ---------------------------------------------------------------------------------------------
# 2. Truncation never cuts inside an image run; ids are range-checked before any work

RUN = 8  # image positions in the property test: start, 6 patches, end
SPEC = PackSpec(max_seq_length=10**6, ignore_index=-1, image_run=ImageRun(positions=RUN, patch_id=0, start_id=7, end_id=8))


def sample_ids(segments: list[int]) -> tuple[np.ndarray, list[int]]:
    """Text segments (lengths; text ids 10+) with an image run after each but the last, which
    has one token more (a conversation ends with its answer)."""
    segments = [*segments[:-1], segments[-1] + 1]
    ids, starts = [], []
    for position, length in enumerate(segments):
        ids += [10 + (k % 50) for k in range(length)]
        if position < len(segments) - 1:
            starts.append(len(ids))
            ids += SPEC.image_run.ids().tolist()
    return np.asarray(ids), starts


@settings(max_examples=300, deadline=None)
@given(segments=st.lists(st.integers(0, 12), min_size=1, max_size=5), capacity=st.integers(2, 60))
def test_property_truncated_samples_keep_whole_image_runs_only(segments, capacity):
    ids, starts = sample_ids(segments)
    if len(ids) < 2:
        return
    cut, kept = truncation(starts, RUN, capacity) if len(ids) > capacity + 1 else (len(ids), len(starts))
    kept_ids = ids[:cut]
    tokens, labels = kept_ids[:-1], kept_ids[1:]
    assert len(tokens) <= capacity
    if len(tokens) == 0:
        return
    spec = dataclasses.replace(SPEC, max_seq_length=capacity)
    assert pack_problems(spec, [0, len(tokens)], tokens, labels, kept) == []


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=4), min_size=1, max_size=4),
       capacity=st.integers(12, 40))  # fmt: skip
def test_property_a_pack_of_truncated_samples_has_as_many_whole_runs_as_images(samples, capacity):
    tokens, labels, lengths, images = [], [], [], 0
    for segments in samples:
        ids, starts = sample_ids(segments)
        cut, kept = truncation(starts, RUN, capacity) if len(ids) > capacity + 1 else (len(ids), len(starts))
        if cut < 2:
            continue
        tokens.append(ids[: cut - 1])
        labels.append(np.where(ids[1:cut] >= 10, ids[1:cut], -1))
        lengths.append(cut - 1)
        images += kept
    if not tokens:
        return
    spec = dataclasses.replace(SPEC, max_seq_length=capacity * len(tokens))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    assert pack_problems(spec, cu, np.concatenate(tokens), np.concatenate(labels), images) == []


def test_a_cut_run_is_an_invariant_violation():
    ids, starts = sample_ids([3, 2])
    tokens = ids[: starts[0] + RUN - 1]  # 7 of the run's 8 positions
    problems = pack_problems(SPEC, [0, len(tokens)], tokens, np.full(len(tokens), -1), 1)
    assert problems == ["1 incomplete image run(s) (first at position 3)", "1 images for 0 image runs"]


def adjacent_images_record() -> dict:
    return {"id": "two", "image": ["chelsea.jpg", "chelsea.jpg"],
            "conversations": conversation("Hi", "Hello.") + conversation("<image><image>\nAnd these?", "Cats.")}  # fmt: skip


def test_a_cut_landing_just_after_adjacent_image_runs_keeps_them_whole(tmp_path, capsys, images):
    from neva_pack.config import PreprocessConfig
    from neva_pack.pipeline import build_sample_builder
    from neva_pack.records import RawRecord

    config = PreprocessConfig(data_path=TOKENIZER, tokenizer_path=TOKENIZER, output_dir=tmp_path / "unused",
                              image_folder=images, conv_template="v1")  # fmt: skip
    builder = build_sample_builder(config)
    first, second = builder.build(RawRecord(0, adjacent_images_record())).image_starts.tolist()
    run_length = builder.image_run.positions
    assert second == first + run_length  # adjacent runs
    for capacity in (first + run_length - 1, first + run_length, second + run_length - 1, second + run_length):
        (tmp_path / str(capacity)).mkdir()
        run = run_with(tmp_path / str(capacity), capsys, images, adjacent_images_record(),
                       "--max_seq_length", str(capacity), "--max_skip_fraction", "1")  # fmt: skip
        assert run.code == 0, run.err
        assert run.verified


@pytest.mark.parametrize("flag, value, says", [
    ("--image_patch_id", "16777217", "not an id of the tokenizer's vocabulary"),
    ("--pad_id", "16777217", "not an id of the tokenizer's vocabulary"),
    ("--pad_id", "999999", "not an id of the tokenizer's vocabulary"),
    ("--ignore_index", "5", "its labels would read as ignored"),
])  # fmt: skip
def test_an_id_the_output_cannot_hold_is_refused_before_any_work(tmp_path, capsys, images, flag, value, says):
    run = run_with(tmp_path, capsys, images, GOOD[0], flag, value, "--pad_to_multiple_of", "64")
    assert run.code == 2 and run.err.count("\n") == 1
    assert f"{flag} {value}: " in run.err and says in run.err
    assert not run.out.exists()


# ---------------------------------------------------------------------------------------------
# 3. Images are confined to --image_folder


def test_images_outside_the_folder_are_skipped_unless_allowed(tmp_path, capsys, images):
    (tmp_path / "x.png").write_bytes(png_bytes(8, 8))
    (images / "link.png").symlink_to(tmp_path / "x.png")
    names = ["../x.png", str(tmp_path / "x.png"), "link.png", "sub/../../x.png"]
    records = GOOD + [image_record(name) for name in names]
    data = write_data(tmp_path / "data.jsonl", records, "jsonl")
    run = run_on(tmp_path, capsys, data, images, "--max_skip_fraction", "1")
    assert run.code == 0 and run.reasons == {3: "outside_image_folder", 4: "outside_image_folder",
                                             5: "outside_image_folder", 6: "outside_image_folder"}  # fmt: skip
    assert run.verified
    shutil.rmtree(run.out)
    allowed = run_on(tmp_path, capsys, data, images, "--allow_outside_image_folder")
    assert allowed.code == 0 and allowed.reasons == {}
    assert allowed.verified


def test_a_relative_name_inside_the_folder_with_dots_is_fine(tmp_path, capsys, images):
    (images / "sub").mkdir()
    run = run_with(tmp_path, capsys, images, image_record("sub/../chelsea.jpg"))
    assert run.code == 0 and run.reasons == {}


def test_a_symlink_loop_is_an_unreadable_image_not_a_crash(tmp_path, capsys, images):
    (images / "loop.jpg").symlink_to("loop.jpg")
    run = run_with(tmp_path, capsys, images, image_record("loop.jpg"))
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "unreadable_image"}
    assert "cannot be resolved" in json.loads(skipped_path(run.out).read_text())["detail"]
    assert run.verified


def image_tar(path: Path, images: Path, extra) -> Path:
    """chelsea.jpg as a regular member, then whatever ``extra(tar)`` adds."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(images / "chelsea.jpg", arcname="chelsea.jpg")
        extra(tar)
    return path


def test_a_tar_reads_hard_and_symbolic_links_as_the_folder_it_unpacks_to(tmp_path, capsys, images):
    import tarfile

    def links(tar):
        for name, kind, target in (("copy.jpg", tarfile.LNKTYPE, "chelsea.jpg"), ("sub/alias.jpg", tarfile.SYMTYPE, "../chelsea.jpg"),
                                   ("chain.jpg", tarfile.SYMTYPE, "sub/alias.jpg"), ("loop.jpg", tarfile.SYMTYPE, "loop.jpg"),
                                   ("out.jpg", tarfile.SYMTYPE, "../chelsea.jpg")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)

    archive = image_tar(tmp_path / "links.tar", images, links)
    names = ["copy.jpg", "sub/alias.jpg", "chain.jpg", "loop.jpg", "out.jpg"]
    data = write_data(tmp_path / "data.jsonl", GOOD[:1] + [image_record(name) for name in names], "jsonl")
    run = run_on(tmp_path, capsys, data, archive, "--max_skip_fraction", "1")
    # the three links to chelsea.jpg read its bytes; a looping or escaping link is no member
    assert run.code == 0 and run.reasons == {4: "missing_image", 5: "missing_image"}
    assert run.verified


def test_a_tar_names_outside_and_sparse_members_as_a_folder_would(tmp_path, capsys, images):
    import tarfile

    data_bytes = (images / "chelsea.jpg").read_bytes()

    def odd_members(tar):
        for name in ("../up.jpg", "/abs.jpg"):
            info = tarfile.TarInfo(name)
            info.size = len(data_bytes)
            tar.addfile(info, io.BytesIO(data_bytes))

    archive = image_tar(tmp_path / "odd.tar", images, odd_members)
    names = ["../up.jpg", "/abs.jpg", "x/../../up.jpg"]
    data = write_data(tmp_path / "data.jsonl", GOOD[:1] + [image_record(name) for name in names], "jsonl")
    run = run_on(tmp_path, capsys, data, archive, "--max_skip_fraction", "1")
    assert run.code == 0 and run.reasons == dict.fromkeys((1, 2, 3), "outside_image_folder")
    shutil.rmtree(run.out)
    allowed = run_on(tmp_path, capsys, data, archive, "--allow_outside_image_folder")
    assert allowed.code == 0 and allowed.reasons == {}
    shutil.rmtree(allowed.out)

    if shutil.which("tar") is None:
        return
    folder = tmp_path / "sparse"
    folder.mkdir()
    shutil.copyfile(images / "chelsea.jpg", folder / "chelsea.jpg")
    with open(folder / "holes.jpg", "wb") as f:
        f.write(data_bytes)
        f.truncate(8 << 20)  # a long hole: GNU tar --sparse stores only the data
    sparse = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(sparse), "-C", str(folder), "chelsea.jpg", "holes.jpg"], check=True)
    run = run_on(tmp_path, capsys, write_data(tmp_path / "s.jsonl", GOOD[:1] + [image_record("holes.jpg"), GOOD[1]], "jsonl"),
                 sparse, "--max_skip_fraction", "1")  # fmt: skip
    assert run.code == 0 and run.reasons == {1: "unreadable_image"}  # skipped, the archive itself is sound
    assert "sparse" in json.loads(skipped_path(run.out).read_text())["detail"]


# ---------------------------------------------------------------------------------------------
# 4. One run per output directory; --overwrite deletes only our own files; checks before publishing


def test_a_second_run_on_a_locked_output_dir_exits_2_naming_the_holder(tmp_path, capsys, images):
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out):
        run = run_with(tmp_path, capsys, images, GOOD[0], "--resume")
    assert run.code == 2 and run.err.count("\n") == 1
    assert f"in use by another neva-pack run (pid {os.getpid()} on " in run.err
    assert not store_dir(out).exists()
    again = run_with(tmp_path, capsys, images, GOOD[0], "--resume")  # the lock is gone with its holder
    assert again.code == 0 and not (out / LOCK_FILE).exists()
    assert again.verified


def test_overwrite_refuses_to_delete_an_input_or_a_stranger(tmp_path, capsys):
    out = tmp_path / "out"
    user_images = store_dir(out)  # the reported case: an image folder with our store's name
    user_images.mkdir(parents=True)
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", user_images)
    run = run_with(tmp_path, capsys, user_images, GOOD[0], "--overwrite")
    assert run.code == 2 and run.err.count("\n") == 1 and "nothing was deleted" in run.err
    assert (user_images / "chelsea.jpg").is_file()


def test_overwrite_refuses_an_input_inside_what_it_would_delete(tmp_path, capsys, images):
    first = run_with(tmp_path, capsys, images, GOOD[0])
    assert first.code == 0
    data = store_dir(first.out) / "mine.jsonl"  # a user's file inside our own store
    shutil.copy(first.data, data)
    run = run_on(tmp_path, capsys, data, images, "--overwrite")
    assert run.code == 2 and "--data_path" in run.err and "which --overwrite would delete" in run.err
    assert data.is_file()


def test_overwrite_keeps_a_foreign_file_with_one_of_our_names(tmp_path, capsys, images):
    out = tmp_path / "out"
    out.mkdir()
    stats_path(out).write_text('{"my": "notes"}')
    run = run_with(tmp_path, capsys, images, GOOD[0], "--overwrite")
    assert run.code == 2 and "stats.json is not a neva_pack report" in run.err
    assert stats_path(out).read_text() == '{"my": "notes"}'


def test_overwrite_keeps_a_users_file_inside_our_store_directory(tmp_path, capsys, images):
    first = run_with(tmp_path, capsys, images, GOOD[0])
    assert first.code == 0
    mine = store_dir(first.out) / "shard_0001.tar"  # named like a shard, but not a store file
    mine.write_bytes(b"user data")
    run = run_with(tmp_path, capsys, images, GOOD[0], "--overwrite")
    assert run.code == 2 and "shard_0001.tar" in run.err and "nothing was deleted" in run.err
    assert mine.read_bytes() == b"user data"


def test_overwrite_replaces_a_converted_compact_output(tmp_path, capsys, images):
    first = run_with(tmp_path, capsys, images, GOOD[0])
    assert first.code == 0
    converted = tmp_path / "converted"
    assert main(["convert", str(first.out), str(converted), "--to", "compact"]) == 0
    assert any(p.name.startswith("pool_") for p in store_dir(converted).iterdir())
    capsys.readouterr()
    code = main(["preprocess", "--quiet", "--data_path", str(first.data), "--image_folder", str(images),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(converted), "--conv_template", "v1",
                 "--num_workers", "0", "--overwrite", "--output_format", "compact"])  # fmt: skip
    assert code == 0, capsys.readouterr().err


def test_a_pack_violating_an_invariant_is_never_published(tmp_path, capsys, images, monkeypatch):
    import neva_pack.samples as samples  # assemble asks the samples package for its cut

    def buggy_truncation(image_starts, run_length, max_seq_length):  # the old off-by-one
        cut, kept = max_seq_length + 1, 0
        while kept < len(image_starts) and image_starts[kept] + run_length <= cut:
            kept += 1
        return (min(cut, int(image_starts[kept])) if kept < len(image_starts) else cut), kept

    monkeypatch.setattr(samples, "truncation", buggy_truncation)  # the cut assemble.rows_at makes per size
    record = adjacent_images_record()
    out = tmp_path / "multi"
    data = write_data(tmp_path / "data.jsonl", [record, GOOD[0]], "jsonl")
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(images), "--tokenizer_path",
                 str(TOKENIZER), "--output_dir", str(out), "--conv_template", "v1", "--num_workers", "0",
                 "--pack_sizes", "700", "4096"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "incomplete image run" in err and "nothing was published" in err
    assert not list(out.glob("*.meta.json"))


def test_accounting_must_add_up():
    assert accounting_problem(records=4, packed=3, skipped=1) is None
    assert accounting_problem(records=2112, packed=480, skipped=0) == "480 packed + 0 skipped != 2112 records"


# ---------------------------------------------------------------------------------------------
# 5. Bad arguments fail before any work with one line; Ctrl-C / SIGTERM exit cleanly, no orphans


def hparams(tmp_path, body: str) -> str:
    path = tmp_path / "hparams.yaml"
    path.write_text(body)
    return str(path)


BAD_ARGUMENTS = {
    "scalar crop_size": (lambda t: ("--hparams_file", hparams(t, "model:\n  mm_cfg:\n    vision_encoder:\n      crop_size: 336\n")),
                         "hparams model.mm_cfg.vision_encoder.crop_size 336: expected a list of 2 integers (height, width), got int"),
    "list image_folder": (lambda t: ("--hparams_file", hparams(t, "model:\n  data:\n    image_folder: [a, b]\n")),
                          "--image_folder (or hparams model.data.image_folder) ['a', 'b']: expected a path, got list"),
    "string sequence length": (lambda t: ("--hparams_file", hparams(t, "model:\n  encoder_seq_length: '4096'\n")),
                               "--max_seq_length (or hparams model.encoder_seq_length) '4096': expected an integer, got str"),
    "negative seed": (lambda t: ("--seed=-1",), "--seed -1: must be between 0 and 2**63 - 1"),
    "huge seed": (lambda t: ("--seed", str(2**64)), "--seed 18446744073709551616: must be between 0 and 2**63 - 1"),
    "huge capacity": (lambda t: ("--max_seq_length=2147483648",), "--max_seq_length 2147483648: must be between 2 and 16,777,216"),
    "a thousand workers": (lambda t: ("--num_workers", "1000"), "--num_workers 1000: must be between 0 and"),
    "depth beyond the parser": (lambda t: ("--max_record_depth", "100000"), "--max_record_depth 100000: at most 500"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_fails_before_any_work_with_one_line(tmp_path, capsys, images, case):
    make, message = BAD_ARGUMENTS[case]
    data = write_data(tmp_path / "data.jsonl", GOOD, "jsonl")
    out = tmp_path / "out"
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path", str(TOKENIZER),
                 "--output_dir", str(out), *make(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_a_list_data_path_in_hparams_fails_with_one_line(tmp_path, capsys):
    path = hparams(tmp_path, "model:\n  data:\n    data_path: [a.json, b.json]\n")
    code = main(["preprocess", "--hparams_file", path, "--tokenizer_path", str(TOKENIZER), "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err == "neva-pack: error: --data_path (or hparams model.data.data_path) ['a.json', 'b.json']: expected a path, got list\n"


def children_of(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _as_in_a_terminal() -> None:
    """The run starts as a terminal's foreground job does, Ctrl-C not ignored: a job started in the
    background by a non-interactive shell (``cmd &``, as some CI runners do) inherits SIGINT ignored,
    and Python then never raises KeyboardInterrupt (the run ends normally, exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "signum, code, word",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated"), (signal.SIGKILL, -signal.SIGKILL, None)],
)
def test_a_signal_exits_with_one_line_resume_advice_and_no_orphans(tmp_path, signum, code, word):
    slow = {"id": "slow", "image": ["chelsea.jpg"] * 4,
            "conversations": conversation("<image>" * 4 + "\nWhat?", "Cats.")}  # fmt: skip
    data = write_data(tmp_path / "data.jsonl", [slow] * 400, "jsonl")
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "neva_pack.cli", "preprocess", "--quiet", "--data_path", str(data), "--image_folder",
         str(SAMPLE_DATA / "images"), "--tokenizer_path", str(TOKENIZER), "--output_dir", str(out), "--num_workers", "2"],
        stderr=subprocess.PIPE, text=True, preexec_fn=_as_in_a_terminal,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    workers: set[int] = set()
    while len(workers) < 2 or not store_dir(out).exists():
        assert process.poll() is None and time.monotonic() < deadline
        workers |= children_of(process.pid)
        time.sleep(0.05)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code
    if word is not None:  # SIGKILL leaves no word; the workers die with the main process all the same
        assert err.count("\n") == 1 and f"neva-pack: {word};" in err and "--resume" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if alive(w)]


# ---------------------------------------------------------------------------------------------
# 7. The minor list


def test_a_json_list_with_a_utf8_bom_is_read(tmp_path, capsys, images):
    data = write_data(tmp_path / "data.json", GOOD, "json")
    data.write_bytes(b"\xef\xbb\xbf" + data.read_bytes())
    run = run_on(tmp_path, capsys, data, images)
    assert run.code == 0 and run.reasons == {}
    assert run.verified


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_nan_is_malformed_json_in_both_formats(tmp_path, capsys, images, fmt):
    run = run_with(tmp_path, capsys, images, '{"id": NaN, "conversations": []}', fmt=fmt)
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "malformed_json"}
    assert run.verified


def test_a_broken_json_list_is_one_line_with_its_line_number(tmp_path, capsys, images):
    data = tmp_path / "data.json"
    data.write_text("[\n" + json.dumps(GOOD[0]) + "\n" + json.dumps(GOOD[2]) + "\n]")  # a missing comma
    run = run_on(tmp_path, capsys, data, images)
    assert run.code == 2 and run.err.count("\n") == 1
    assert "invalid JSON list: expected ',' or ']' after a record at line 3" in run.err


def test_a_utf16_file_is_refused_with_one_line(tmp_path, capsys, images):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in GOOD), encoding="utf-16")
    run = run_on(tmp_path, capsys, data, images)
    assert run.code == 2 and run.err.count("\n") == 1 and "UTF-16 or UTF-32 text, not UTF-8" in run.err


def test_a_truncated_tar_is_reported_as_truncated(tmp_path, capsys):
    import tarfile

    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(SAMPLE_DATA / "images" / "chelsea.jpg", arcname="chelsea.jpg")
        tar.add(SAMPLE_DATA / "images" / "coffee.jpg", arcname="coffee.jpg")
    archive.write_bytes(archive.read_bytes()[:40_000])  # cut inside coffee.jpg
    run = run_with(tmp_path, capsys, archive, GOOD[0])
    assert run.code == 2 and "truncated" in run.err and "compressed" not in run.err


def test_a_16_bit_grayscale_png_is_scaled_not_whitened():
    from neva_pack.families import decode_image

    ramp = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16).astype(np.uint16)
    image = decode_image(png_bytes(64, 64, array=ramp), "ramp.png")
    pixels = np.asarray(image)
    assert image.mode == "RGB" and np.array_equal(pixels[..., 0], (ramp >> 8).astype(np.uint8))


def test_a_108_megapixel_jpeg_is_image_too_large_naming_the_limit_and_flag(tmp_path, capsys, images):
    (images / "huge.jpg").write_bytes(jpeg_claiming(12_000, 9_000))
    run = run_with(tmp_path, capsys, images, image_record("huge.jpg"))
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "image_too_large"}
    detail = json.loads(skipped_path(run.out).read_text())["detail"]
    assert detail == "huge.jpg: 12000 x 9000 = 108,000,000 pixels > --max_image_pixels 36,000,000"
    assert run.verified


def test_an_image_over_pils_own_limit_is_image_too_large_and_a_larger_budget_lifts_it(tmp_path, capsys, images, monkeypatch):
    from neva_pack.families import decode_image

    (images / "vast.jpg").write_bytes(jpeg_claiming(15_000, 15_000))  # PIL refuses over 178,956,970 in open
    run = run_with(tmp_path, capsys, images, image_record("vast.jpg"))
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "image_too_large"}
    detail = json.loads(skipped_path(run.out).read_text())["detail"]
    assert detail == "vast.jpg: size = 225,000,000 pixels > --max_image_pixels 36,000,000"
    # a budget the user raised above PIL's limit is the one checked, from the header, as below it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    with pytest.raises(RecordError) as caught:
        decode_image(jpeg_claiming(15_000, 15_000), "vast.jpg", max_pixels=200_000_000)
    assert (caught.value.reason, caught.value.detail) == (
        "image_too_large", "vast.jpg: 15000 x 15000 = 225,000,000 pixels > --max_image_pixels 200,000,000")


def test_a_sample_cut_before_its_answer_is_no_supervised_tokens(tmp_path, capsys, images):
    long_question = {"id": "long", "conversations": conversation("Tell me everything. " * 40, "No.")}
    run = run_with(tmp_path, capsys, images, long_question, "--max_seq_length", "100")
    # the image record cannot keep its 576 image positions either: cut before its image, nothing trained
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "no_supervised_tokens", 2: "no_supervised_tokens"}
    assert run.verified


# ---------------------------------------------------------------------------------------------
# 8. An image can fail to decode in any way, or decode slowly: one record's skip, named


def skip_detail(run: Run, index: int = HOSTILE_AT) -> str:
    return next(line["detail"] for line in map(json.loads, skipped_path(run.out).read_text().splitlines())
                if line["index"] == index)  # fmt: skip


DECODER_CASES = {
    "BLP with an unknown encoding (BLPFormatError)": (
        "odd.blp", blp_unknown_encoding, (), "unreadable_image", "odd.blp: BLPFormatError: Unknown BLP encoding 9"),
    "DDS with unknown pixel flags (NotImplementedError)": (
        "odd.dds", dds_unknown_pixel_format, (), "unreadable_image",
        "odd.dds: NotImplementedError: Unknown pixel format flags 1073741824"),
    "bytes no decoder knows (no object address in the detail)": (
        "x.jpg", lambda: b"not an image at all", (), "unreadable_image",
        "x.jpg: UnidentifiedImageError: cannot identify image file x.jpg"),
    "progressive JPEG of 400 repeated scans": (
        "slow.jpg", lambda: progressive_jpeg_with_scans(2_000, 2_000, 400), ("--max_image_decode_seconds", "0.2"),
        "image_too_slow", "slow.jpg: decoding took more than --max_image_decode_seconds 0.2 (CPU time)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DECODER_CASES))
def test_any_decoder_failure_or_slow_decode_is_that_records_skip_named(tmp_path, capsys, images, case):
    name, make, extra, reason, detail = DECODER_CASES[case]
    (images / name).write_bytes(make())
    run = run_with(tmp_path, capsys, images, image_record(name), *extra)
    assert run.code == 0, run.err
    assert run.reasons == {HOSTILE_AT: reason}
    assert skip_detail(run) == detail
    assert run.verified


def test_a_slow_image_in_a_worker_is_stopped_and_the_workers_later_records_are_packed(tmp_path, capsys, images):
    (images / "slow.jpg").write_bytes(progressive_jpeg_with_scans(2_000, 2_000, 400))
    records = [image_record("slow.jpg"), *GOOD, GOOD[1]]
    data = write_data(tmp_path / "data.jsonl", records, "jsonl")
    run = run_on(tmp_path, capsys, data, images, "--num_workers", "1", "--max_image_decode_seconds", "0.2")
    assert run.code == 0, run.err
    assert run.reasons == {0: "image_too_slow"}  # the worker went on: records 1..4 are packed
    assert run.verified


def test_the_skip_report_is_the_same_bytes_in_two_runs_of_the_same_input(tmp_path, capsys, images):
    (images / "x.jpg").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    data = write_data(tmp_path / "data.jsonl", [GOOD[0], image_record("x.jpg"), GOOD[1]], "jsonl")
    reports = []
    for attempt in ("first", "second"):
        (tmp_path / attempt).mkdir()
        run = run_on(tmp_path / attempt, capsys, data, images)
        assert run.code == 0 and run.reasons == {1: "unreadable_image"}
        reports.append(skipped_path(run.out).read_bytes())
    assert reports[0] == reports[1] and b" at 0x" not in reports[0]


@functools.cache
def valid_image(fmt: str) -> bytes:
    """A small picture saved in ``fmt``, in the first mode PIL's writer for it accepts."""
    gradient = np.add.outer(np.arange(24), np.arange(32)).astype(np.uint8) * 4
    picture = Image.fromarray(np.stack([gradient, gradient[::-1], 255 - gradient], axis=-1))
    for mode in ("RGB", "P", "L", "1", "F"):
        buffer = io.BytesIO()
        try:
            picture.convert(mode).save(buffer, fmt)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return buffer.getvalue()
    raise AssertionError(f"PIL cannot write {fmt}")


def _writable_formats() -> list[str]:
    Image.init()
    formats = []
    for fmt in ("BLP", "BMP", "DDS", "GIF", "ICO", "JPEG", "JPEG2000", "MSP", "PCX", "PNG", "PPM", "QOI",
                "SGI", "SPIDER", "TGA", "TIFF", "WEBP", "XBM"):  # fmt: skip
        try:
            valid_image(fmt)
        except (AssertionError, KeyError):  # a format this PIL build cannot write (no codec)
            continue
        formats.append(fmt)
    return formats


FORMATS = _writable_formats()
IMAGE_SKIPS = {"unreadable_image", "image_too_large", "image_too_slow"}


@st.composite
def damaged_images(draw) -> bytes:
    """Random bytes, or a valid file of a random PIL format with random bytes overwritten and/or
    its end cut off (the header often survives: the decoder itself meets the damage)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(valid_image(draw(st.sampled_from(FORMATS))))
    for _ in range(draw(st.integers(0, 4))):
        position = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        data[position : position + len(junk)] = junk
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=300, deadline=None)
@given(data=damaged_images())
def test_property_any_damaged_image_decodes_to_rgb_or_is_one_named_skip(data):
    from neva_pack.families import decode_image

    try:
        image = decode_image(data, "x.img", max_seconds=5)
    except RecordError as error:
        assert error.reason in IMAGE_SKIPS
        assert error.detail.startswith("x.img: ") and "\n" not in error.detail and " at 0x" not in error.detail
    else:
        assert image.mode == "RGB" and image.width * image.height > 0


@settings(max_examples=8, deadline=None)
@given(data=damaged_images())
def test_property_a_run_over_a_damaged_image_packs_the_rest_and_verifies(tmp_path_factory, data):
    tmp_path = tmp_path_factory.mktemp("damaged")
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", folder)
    (folder / "x.img").write_bytes(data)
    run = run_with(tmp_path, _NoCapture(), folder, image_record("x.img"))
    assert run.code == 0, run.err
    assert set(run.reasons) <= {HOSTILE_AT} and set(run.reasons.values()) <= IMAGE_SKIPS
    assert run.verified


class _NoCapture:
    """capsys for a hypothesis example (a function-scoped fixture cannot be used across examples)."""

    @staticmethod
    def readouterr():
        return _Captured("")


@dataclass
class _Captured:
    err: str


# ---------------------------------------------------------------------------------------------
# 9. Records: the other spelling of images, the image budget, and inputs that are no JSON text


def test_images_is_read_as_image_and_packs_the_same(tmp_path, capsys, images):
    from neva_pack.reading import PackedSeqDataset
    from neva_pack.files import packed_prefix

    packs = {}
    for key, value in (("image", "chelsea.jpg"), ("images", ["chelsea.jpg"])):
        record = {"id": "x", key: value, "conversations": conversation("<image>\nWhat is this?", "A cat.")}
        (tmp_path / f"with {key}").mkdir()
        run = run_with(tmp_path / f"with {key}", capsys, images, record)
        assert run.code == 0 and run.reasons == {}
        assert run.verified
        packs[key] = list(PackedSeqDataset(packed_prefix(run.out)))
    assert len(packs["image"]) == len(packs["images"])
    for ours, theirs in zip(packs["image"], packs["images"]):
        assert all(torch_equal(ours[key], theirs[key]) for key in ours)


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_a_record_with_both_image_and_images_is_malformed(tmp_path, capsys, images):
    record = {"image": "chelsea.jpg", "images": ["chelsea.jpg"], "conversations": conversation("<image>\nHi", "A cat.")}
    run = run_with(tmp_path, capsys, images, record)
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "malformed_record"}
    assert skip_detail(run) == "both 'image' and 'images' are given (use one of them)"


@pytest.mark.parametrize("count, extra, detail", [
    (142_000, (), "142,000 images > --max_images_per_record 1,000"),
    (5, ("--max_images_per_record", "4"), "5 images > --max_images_per_record 4"),
])  # fmt: skip
def test_a_record_over_the_image_budget_is_skipped_before_any_image_is_read(tmp_path, capsys, images, count, extra, detail):
    run = run_with(tmp_path, capsys, images, many_images_record(count), *extra)
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "too_many_images"}
    assert skip_detail(run) == detail
    assert run.verified


def test_placeholders_over_the_image_budget_are_too_many_images_not_a_mismatch(tmp_path, capsys, images):
    record = {"image": "chelsea.jpg", "conversations": conversation("<image>" * 5, "A cat.")}
    run = run_with(tmp_path, capsys, images, record, "--max_images_per_record", "4")
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "too_many_images"}


@pytest.mark.parametrize("kind", ["gzip", "bz2", "lzma"])
def test_a_compressed_data_path_is_one_line_saying_so(tmp_path, capsys, images, kind):
    import importlib

    data = tmp_path / "data.json"  # named as if it were text
    text = "\n".join(json.dumps(r) for r in GOOD).encode()
    data.write_bytes(importlib.import_module(kind).compress(text))
    run = run_on(tmp_path, capsys, data, images)
    name = {"gzip": "gzip", "bz2": "bzip2", "lzma": "xz"}[kind]
    assert run.code == 2 and run.err.count("\n") == 1
    assert f"a {name}-compressed file; decompress it first" in run.err and "UTF-16" not in run.err


@pytest.mark.parametrize("text, says", [
    ("", "holds no records"),
    ("\n  \n", "holds no records"),
    ("[]", "holds no records"),
    (json.dumps(GOOD[0], indent=2), "its first record goes on over several lines (a pretty-printed JSON object?)"),
    ('{"data": [\n' + json.dumps(GOOD[0]) + "\n]}", "its first record goes on over several lines"),
])  # fmt: skip
def test_an_input_without_records_or_with_one_pretty_printed_object_is_one_line(tmp_path, capsys, images, text, says):
    data = tmp_path / "data.json"
    data.write_text(text)
    run = run_on(tmp_path, capsys, data, images)
    assert run.code == 2 and run.err.count("\n") == 1 and says in run.err
    assert "skipped" not in run.err


# ---------------------------------------------------------------------------------------------
# 10. Every configuration file is untrusted: a bad one is one line naming the file (and the key)

TEMPLATE_YAML = """\
name: vicuna
system: "A chat."
system_suffix: " "
system_when_empty: true
user:
  prefix: "USER: "
  suffix: " "
assistant:
  prefix: "ASSISTANT:"
  lead: " "
  suffix: "{eos}"
nemo:
  round_separator: " "
"""
HPARAMS_YAML = """\
model:
  encoder_seq_length: 4096
  mm_cfg:
    use_im_start_end: false
    vision_encoder:
      patch_dim: 14
      crop_size: [336, 336]
  data:
    image_aspect_ratio: square
"""


def settings_files(folder: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """One of each configuration file the tool reads, valid, and the flags that make a run read it."""
    from neva_pack.families import resolve_encoder

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "template.yaml").write_text(TEMPLATE_YAML)
    (folder / "hparams.yaml").write_text(HPARAMS_YAML)
    encoder = folder / "encoder"
    encoder.mkdir(exist_ok=True)
    settings_ = resolve_encoder("openai/clip-vit-large-patch14-336").preprocessor_config
    (encoder / "preprocessor_config.json").write_text(json.dumps(settings_, indent=1))
    (encoder / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14}}))
    shutil.copy(TOKENIZER, folder / "tokenizer.model")
    return {
        "template": (folder / "template.yaml", ("--conv_template", str(folder / "template.yaml"))),
        "hparams": (folder / "hparams.yaml", ("--hparams_file", str(folder / "hparams.yaml"))),
        "encoder settings": (encoder / "preprocessor_config.json", ("--hf_vision_encoder", str(encoder))),
        "encoder model config": (encoder / "config.json", ("--hf_vision_encoder", str(encoder))),
        "tokenizer": (folder / "tokenizer.model", ("--tokenizer_path", str(folder / "tokenizer.model"))),
    }


def run_configured(tmp_path, capsys, images, flags) -> Run:
    data = write_data(tmp_path / "data.jsonl", GOOD, "jsonl")
    return run_on(tmp_path, capsys, data, images, *flags)


def one_line(run: Run) -> bool:
    return run.err.count("\n") == 1 and run.err.startswith("neva-pack: error: ") and "Traceback" not in run.err


BAD_SETTINGS = {
    "template YAML that does not parse": ("template", lambda p: p.write_text("user: [\n"),
                                          "template.yaml: invalid YAML (expected the node content, but found '<stream end>' at line 2, column 1)"),
    "template not UTF-8": ("template", lambda p: p.write_bytes(b"name: caf\xe9\n"),
                           "template.yaml: not UTF-8 text (byte 0xe9 at offset 9)"),
    "template flag spelled as text": ("template", lambda p: p.write_text(TEMPLATE_YAML + "bos: 'yes'\n"),
                                      "template.yaml: bos 'yes': expected true or false, got str"),
    "template text with a lone surrogate": ("template", lambda p: p.write_text(TEMPLATE_YAML + 'system_prefix: "\\ud800"\n'),
                                            "template.yaml: system_prefix '\\ud800': holds a lone UTF-16 surrogate"),
    "template is a directory": ("template", lambda p: (p.unlink(), p.mkdir()), "template.yaml: not a regular file (a directory)"),
    "hparams not UTF-8": ("hparams", lambda p: p.write_bytes(b"model:\n  seed: \xff\n"),
                          "hparams.yaml: not UTF-8 text (byte 0xff at offset 15)"),
    "hparams gzip-compressed": ("hparams", lambda p: p.write_bytes(__import__("gzip").compress(HPARAMS_YAML.encode())),
                                "hparams.yaml: gzip-compressed, not text"),
    "crop_size a string": ("encoder settings",
                           lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "crop_size": "336"})),
                           "preprocessor_config.json: crop_size '336': expected a positive integer or an object"),
    "image_std zero": ("encoder settings",
                       lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "image_std": [0.5, 0, 0.5]})),
                       "preprocessor_config.json: image_std [0.5, 0, 0.5]: expected numbers above 0"),
    "image_mean a number": ("encoder settings",
                            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "image_mean": 0.5})),
                            "preprocessor_config.json: image_mean 0.5: expected a list of 3 numbers (one per RGB channel), got float"),
    "settings a JSON list": ("encoder settings", lambda p: p.write_text("[1, 2]"),
                             "preprocessor_config.json: expected a JSON object, got list"),
    "settings not JSON": ("encoder settings", lambda p: p.write_text("{'crop_size': 336}"),
                          "preprocessor_config.json: invalid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    "patch size a string": ("encoder model config", lambda p: p.write_text('{"vision_config": {"patch_size": "14"}}'),
                            "config.json: vision_config.patch_size '14': expected a positive integer"),
    "no crop and no resize to a box": ("encoder settings",
                                       lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "do_center_crop": False})),
                                       "preprocessor_config.json: do_center_crop/do_resize/size give images of varying shape"),
    "tokenizer piece not UTF-8": ("tokenizer", lambda p: p.write_bytes(p.read_bytes().replace(b"<unk>", b"\x80unk>", 1)),
                                  "tokenizer.model: not a SentencePiece model"),
    "tokenizer a FIFO": ("tokenizer", lambda p: (p.unlink(), os.mkfifo(p)), "tokenizer.model: not a regular file (a FIFO)"),
    "tokenizer truncated": ("tokenizer", lambda p: p.write_bytes(p.read_bytes()[:1000]), "tokenizer.model: not a SentencePiece model"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_a_bad_configuration_file_is_one_line_naming_it(tmp_path, capsys, images, case):
    kind, damage, says = BAD_SETTINGS[case]
    path, flags = settings_files(tmp_path / "settings")[kind]
    damage(path)
    run = run_configured(tmp_path, capsys, images, flags)
    assert run.code == 2 and one_line(run), run.err
    assert says in run.err
    assert not skipped_path(run.out).exists()


@pytest.mark.parametrize("flag", ["--hparams_file", "--tokenizer_path", "--conv_template"])
def test_dev_zero_as_a_configuration_file_is_refused_before_reading(tmp_path, capsys, images, flag):
    value = "/dev/zero" if flag != "--conv_template" else str(tmp_path / "zero.yaml")
    if flag == "--conv_template":
        os.symlink("/dev/zero", value)  # a template is known by its suffix
    run = run_configured(tmp_path, capsys, images, (flag, value))
    assert run.code == 2 and one_line(run) and "not a regular file (a character device)" in run.err


LEAVES = st.none() | st.booleans() | st.integers(-3, 5000) | st.floats(allow_nan=False, width=32) | st.text(max_size=6)
VALUES = LEAVES | st.lists(LEAVES, max_size=3) | st.dictionaries(
    st.sampled_from(["height", "width", "shortest_edge", "prefix"]), st.integers(-2, 500), max_size=2)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))


@st.composite
def edited(draw, text: bytes, structured: bool) -> bytes:
    """The file with a random value replaced (JSON/YAML: a key's value, kept parseable, so the
    checks of keys and types are met), or random bytes overwritten, inserted or cut off."""
    import yaml

    if structured and draw(st.booleans()):
        tree = yaml.safe_load(text)
        path = draw(st.sampled_from([p for p in _paths(tree) if p]))
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = draw(VALUES)
        return json.dumps(tree).encode()  # YAML reads JSON
    data = bytearray(text)
    position = draw(st.integers(0, len(data)))
    junk = draw(st.binary(min_size=1, max_size=6))
    how = draw(st.sampled_from(["overwrite", "insert", "cut"]))
    if how == "overwrite":
        data[position : position + len(junk)] = junk
    elif how == "insert":
        data[position:position] = junk
    else:
        del data[position:]
    return bytes(data)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["template", "hparams", "encoder settings", "encoder model config", "tokenizer"]), data=st.data())
def test_property_a_randomly_edited_configuration_file_runs_or_is_one_line(tmp_path_factory, kind, data):
    tmp_path = tmp_path_factory.mktemp("edited")
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", folder)
    path, flags = settings_files(tmp_path / "settings")[kind]
    path.write_bytes(data.draw(edited(path.read_bytes(), structured=kind != "tokenizer")))
    capture = _StderrCapture()
    with capture:
        run = run_configured(tmp_path, capture, folder, flags)
    assert run.code in (0, 2), run.err
    if run.code == 2:
        assert one_line(run), run.err
    else:
        assert run.verified


class _StderrCapture:
    """capsys for a hypothesis example: what main wrote to stderr."""

    def __enter__(self):
        import contextlib

        self._buffer = io.StringIO()
        self._redirect = contextlib.redirect_stderr(self._buffer)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)

    def readouterr(self):
        return _Captured(self._buffer.getvalue())


# ---------------------------------------------------------------------------------------------
# 9. The files of an output and of its store are untrusted too: read back by verify and --resume


def _hostile_file(path: Path, kind: str) -> None:
    """Put something hostile where a file of the output was (same name)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "not_utf8":
        path.write_bytes(b"\xff\xfe{\x00\x80" * 64)
    elif kind == "not_an_object":
        path.write_text("[1, 2, 3]\n")


OUTPUT_HOSTILES = ("device", "fifo", "directory", "not_utf8", "not_an_object")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A complete output with its store kept: each test damages a copy."""
    root = tmp_path_factory.mktemp("published")
    data = write_data(root / "data.jsonl", GOOD, "jsonl")
    assert main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(SAMPLE_DATA / "images"),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(root / "out"), "--conv_template", "v1",
                 "--num_workers", "0"]) == 0  # fmt: skip
    return root


@pytest.mark.parametrize("kind", OUTPUT_HOSTILES)
@pytest.mark.parametrize("which", ["meta", "stats", "plan table"])
def test_verify_names_a_hostile_file_of_an_output_without_reading_it(published, tmp_path, capsys, which, kind):
    from neva_pack.files import paths

    out = tmp_path / "out"
    shutil.copytree(published / "out", out)
    prefix = paths.packed_prefix(out)
    target = {"meta": paths.meta_path(prefix), "stats": paths.stats_path_of(prefix), "plan table": paths.plan_path(prefix)}[which]
    _hostile_file(target, kind)
    capsys.readouterr()
    code = main(["verify", "--quiet", str(out), "--data_path", str(published / "data.jsonl")])
    said = capsys.readouterr()
    assert code in (1, 2) and "Traceback" not in said.err
    assert target.name in said.out + said.err, said


@pytest.mark.parametrize("kind", OUTPUT_HOSTILES)
def test_resume_refuses_a_hostile_store_progress_file_with_one_line(published, tmp_path, capsys, kind):
    from neva_pack.files import paths
    from neva_pack.sample_store import PROGRESS_FILE

    out = tmp_path / "out"
    shutil.copytree(published / "out", out, symlinks=True)
    paths.meta_path(paths.packed_prefix(out)).unlink()  # as if killed before publishing
    _hostile_file(paths.store_dir(out) / PROGRESS_FILE, kind)
    capsys.readouterr()
    run = run_on_output(published / "data.jsonl", out, "--resume")
    err = capsys.readouterr().err
    assert run == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert PROGRESS_FILE in err or "sample store" in err, err


def run_on_output(data: Path, out: Path, *extra) -> int:
    return main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(SAMPLE_DATA / "images"),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(out), "--conv_template", "v1",
                 "--num_workers", "0", *extra])  # fmt: skip
