"""Hostile records: no record can kill or hang a run (each per-record failure is a counted skip),
the JSON list scanner and the counting pass agree with json.loads on any input, and a data file
that is no JSON text of records (a BOM, NaN, a broken list, UTF-16, compressed, empty, one
pretty-printed object) is one line or one record's skip. The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.bench_hostile import many_images_record  # the same hostile records the benchmark measures
from neva_pack.records import SKIP_REASONS, iter_raw_records
from tests.hostile_inputs import GOOD, HOSTILE_AT, conversation, image_record, images, run_on, run_with, skip_detail, write_data  # noqa: F401 (images: the fixture)


# ---------------------------------------------------------------------------------------------
# One record can neither kill nor hang the run: every per-record failure is a counted skip

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
# A data file that is no JSON text of records, or odd JSON, is one line or one record's skip


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


# ---------------------------------------------------------------------------------------------
# The other spelling of images, the image budget, and inputs that are no JSON text


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
