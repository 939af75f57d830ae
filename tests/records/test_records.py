"""Record streaming and validation: every bad-record kind becomes a RecordError with its reason."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.core import InputError
from neva_pack.records import RawRecord, RecordError, count_records, iter_raw_records, parse_record

GOOD = {
    "id": "a",
    "image": "cat.jpg",
    "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A cat."}],
}


def test_good_record_becomes_a_typed_conversation():
    conversation = parse_record(RawRecord(7, GOOD))
    assert conversation.index == 7 and conversation.record_id == "a"
    assert conversation.images == ("cat.jpg",)
    assert [t.role for t in conversation.turns] == ["user", "assistant"]


def test_image_list_text_only_and_leading_gpt_turn():
    record = {
        "image": ["a.jpg", "b.jpg"],
        "conversations": [
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "<image> and <image>?"},
            {"from": "gpt", "value": "Two."},
        ],
    }
    conversation = parse_record(RawRecord(0, record))
    assert conversation.images == ("a.jpg", "b.jpg")
    assert conversation.turns[0].role == "user" and len(conversation.turns) == 2
    text_only = parse_record(RawRecord(1, {"conversations": turns(("user", "Hi"), ("assistant", "Hello"))}))
    assert text_only.images == () and text_only.record_id is None


def with_(**changes):
    return {**GOOD, **changes}


def turns(*pairs):
    return [{"from": f, "value": v} for f, v in pairs]


@pytest.mark.parametrize(
    "record, reason, detail",
    [
        ([1, 2], "malformed_record", "expected an object, got list"),
        ({"id": "x"}, "malformed_record", "'conversations' is missing or not a list"),
        (with_(conversations="hi"), "malformed_record", "not a list"),
        (with_(conversations=["hi"]), "malformed_record", "turn 0 is not an object"),
        (with_(image=3), "malformed_record", "'image' must be a string or a list of strings"),
        (with_(conversations=[]), "empty_conversation", "no human turn"),
        (with_(conversations=turns(("gpt", "only me"))), "empty_conversation", "no human turn"),
        (with_(conversations=turns(("human", "<image>"), ("robot", "x"))), "unknown_role", "from='robot'"),
        (with_(conversations=turns(("human", "<image>"), ("gpt", None))), "non_string_value", "NoneType"),
        (with_(conversations=turns(("human", "<image>"), ("human", "x"))), "roles_not_alternating", "turn 1 is user"),
        (with_(conversations=turns(("human", "<image>"))), "no_assistant_turn", "no gpt turn"),
        (with_(conversations=turns(("human", "no placeholder"), ("gpt", "x"))), "placeholder_mismatch", "0 <image>"),
        (with_(image=["a", "b"]), "placeholder_mismatch", "1 <image> placeholder(s) for 2 image(s)"),
        (with_(conversations=turns(("human", "<image>"), ("gpt", "<image>"))), "placeholder_mismatch", "in gpt turns"),
    ],
)
def test_bad_records_are_rejected_with_their_reason(record, reason, detail):
    with pytest.raises(RecordError) as caught:
        parse_record(RawRecord(0, record))
    assert caught.value.reason == reason
    assert detail in caught.value.detail


def test_jsonl_streams_records_and_keeps_malformed_lines_as_errors(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n{broken\n" + json.dumps(GOOD) + "\n")
    raws = list(iter_raw_records(path))
    assert [r.index for r in raws] == [0, 1, 2]
    assert raws[1].error is not None
    with pytest.raises(RecordError) as caught:
        parse_record(raws[1])
    assert caught.value.reason == "malformed_json"


def test_json_list_is_streamed_and_counted(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD, GOOD, {"x": 1.5}], indent=2))
    assert count_records(path) == 3
    assert [r.value for r in iter_raw_records(path)][2] == {"x": 1.5}


@pytest.mark.parametrize("suffix", ["json", "jsonl"])
def test_only_the_records_in_the_ranges_are_decoded(tmp_path, monkeypatch, suffix):
    """A DataLoader worker decodes its own records only: the others are delimited, not parsed."""
    values = [{"n": n} for n in range(7)]
    path = tmp_path / f"data.{suffix}"
    path.write_text(json.dumps(values) if suffix == "json" else "".join(json.dumps(v) + "\n" for v in values))
    decoded = []
    original = json.loads
    monkeypatch.setattr(json, "loads", lambda text, **options: decoded.append(original(text)["n"]) or original(text, **options))
    raws = list(iter_raw_records(path, ranges=[(1, 2), (3, 4), (5, 6)]))
    monkeypatch.undo()
    assert [(r.index, r.value) for r in raws] == [(1, {"n": 1}), (3, {"n": 3}), (5, {"n": 5})]
    assert decoded == [1, 3, 5]


def test_a_broken_json_list_fails_before_any_work_with_one_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"id": 1}, {"id": ')
    with pytest.raises(InputError, match="invalid JSON list"):
        count_records(path)


# the fast count (one compiled pass) against the scanner it stands in for

SOUP = st.text(alphabet=st.sampled_from('[]{}",\\ a1:\n\t\r\f\ufeffü'), max_size=40)


def scanner_count(path) -> int | None:
    """The scanner's own count (count_records without the fast path), None where it refuses the file."""
    from neva_pack.records import ListScanner
    from neva_pack.records import MAX_RECORD_DEPTH_LIMIT, RecordLimits

    try:
        with open(path, "rb") as f:
            return sum(1 for _ in ListScanner(f, path, RecordLimits(max_bytes=0, max_depth=MAX_RECORD_DEPTH_LIMIT)).records())
    except InputError:
        return None


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(SOUP, SOUP.map(lambda t: f"[{t}]"), SOUP.map(lambda t: f'[{{"a": "{t}"}}, [{t}]]')),
       chunk=st.integers(1, 9))  # fmt: skip
def test_property_the_fast_count_is_the_scanners_or_none(tmp_path_factory, text, chunk):
    import neva_pack.records.list_count as list_count

    path = tmp_path_factory.mktemp("count") / "data.json"
    path.write_text(text, encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(list_count, "READ_CHUNK", chunk)
        fast = list_count.count_list_records(path)
    assert fast is None or fast == scanner_count(path)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.recursive(st.text(alphabet=st.sampled_from('ab"\\[]{} ü'), max_size=6),
                                    lambda children: st.lists(children, max_size=3)
                                    | st.dictionaries(st.text(max_size=3), children, max_size=3), max_leaves=8)
                       .filter(lambda v: isinstance(v, (str, list, dict))), max_size=6),
       indent=st.sampled_from([None, 1]), chunk=st.integers(1, 9))  # fmt: skip
def test_property_the_fast_count_counts_every_plain_list(tmp_path_factory, values, indent, chunk):
    """Lists of arrays, objects and strings (any nesting, escapes) never need the scanner."""
    import neva_pack.records.list_count as list_count

    path = tmp_path_factory.mktemp("count") / "data.json"
    path.write_text(json.dumps(values, indent=indent, ensure_ascii=False), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(list_count, "READ_CHUNK", chunk)
        assert list_count.count_list_records(path) == len(values) == scanner_count(path)


def test_the_fast_count_leaves_numbers_and_broken_lists_to_the_scanner(tmp_path):
    from neva_pack.records import count_list_records

    for text, records in [('[1, {"a": 2}]', 2), ("\ufeff[{}]", 1), ('[{"a": "]"}, "x\\"y"]', 2)]:
        path = tmp_path / "data.json"
        path.write_text(text, encoding="utf-8")
        assert count_records(path) == records
    assert count_list_records(tmp_path / "data.json") == 2
    path.write_text('[{"id": 1}, {"id": 2},]')
    assert count_list_records(path) is None
    with pytest.raises(InputError, match="trailing ','"):
        count_records(path)


# reading record ranges by the offsets of the counting pass (what each DataLoader worker does)

VALUES = st.lists(st.recursive(st.text(alphabet=st.sampled_from('ab"\\[]{},: \n\u00fc\U0001f600'), max_size=8),
                               lambda children: st.lists(children, max_size=3)
                               | st.dictionaries(st.text(alphabet="ab\"\\", max_size=3), children, max_size=3),
                               max_leaves=8)
                  .filter(lambda v: isinstance(v, (str, list, dict))), max_size=12)  # fmt: skip


def sorted_ranges(count: int, cuts: list[int]) -> list[tuple[int, int]]:
    """Increasing, disjoint [first, stop) ranges from arbitrary cut points (every other gap kept)."""
    points = sorted({min(c, count + 2) for c in cuts})
    return [(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]


def scanner_starts(path) -> list[int]:
    """File offsets where the sequential scanner starts each record."""
    from neva_pack.records import ListScanner
    from neva_pack.records import RecordLimits

    with open(path, "rb") as f:
        scanner = ListScanner(f, path, RecordLimits())
        return [scanner.start for _ in scanner.records()]


@settings(max_examples=200, deadline=None)
@given(values=VALUES, indent=st.sampled_from([None, 0, 2]), separator=st.sampled_from([",", ", ", " ,\n\t", "\r\n,"]),
       ascii_only=st.booleans(), every=st.integers(1, 5), cuts=st.lists(st.integers(0, 14), max_size=8),
       max_bytes=st.integers(2, 40), max_depth=st.integers(1, 4), chunk=st.integers(1, 9),
       jump_chunk=st.integers(1, 64))  # fmt: skip
def test_property_ranged_reading_is_the_sequential_scan(tmp_path_factory, values, indent, separator,
                                                        ascii_only, every, cuts, max_bytes, max_depth, chunk,
                                                        jump_chunk):  # fmt: skip
    """Seeking to checkpoints gives the very records (indices, values, skips and their reasons) that
    the sequential scan gives for the same ranges, and the checkpoints are where the scanner starts
    those records; whatever the chunk sizes of the counting pass and of the reader."""
    import neva_pack.records.list_count as list_count
    import neva_pack.records.stream as record_stream
    from neva_pack.records import index_records
    from neva_pack.records import RecordLimits

    path = tmp_path_factory.mktemp("ranges") / "data.json"
    text = json.dumps(values, indent=indent, separators=(separator, ": "), ensure_ascii=ascii_only)
    path.write_text(" \n" + text + "\n ", encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(list_count, "READ_CHUNK", chunk)
        index = index_records(path, every=every)
    assert index.count == len(values) and index.every == every
    assert index.offsets.tolist() == scanner_starts(path)[::every]
    limits = RecordLimits(max_bytes=max_bytes, max_depth=max_depth)
    ranges = sorted_ranges(len(values), cuts)
    sequential = list(iter_raw_records(path, limits))
    expected = [raw for raw in sequential if any(first <= raw.index < stop for first, stop in ranges)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(record_stream, "SEEK_CHUNK", jump_chunk)
        assert list(iter_raw_records(path, limits, ranges=ranges, index=index)) == expected
    assert list(iter_raw_records(path, limits, ranges=ranges)) == expected  # no index: delimit all


def test_a_reader_with_offsets_delimits_only_the_records_after_a_checkpoint(tmp_path, monkeypatch):
    """What the offsets are for: a worker that wants records 90..91 of 100 does not scan 0..89."""
    from neva_pack.records import ListScanner
    from neva_pack.records import index_records

    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"n": n, "text": "x" * n} for n in range(100)], indent=1))
    index = index_records(path, every=8)
    delimited = []
    original = ListScanner.next_record
    monkeypatch.setattr(ListScanner, "next_record", lambda self: delimited.append(1) or original(self))
    raws = list(iter_raw_records(path, ranges=[(3, 4), (5, 6), (90, 92)], index=index))
    assert [(raw.index, raw.value["n"]) for raw in raws] == [(3, 3), (5, 5), (90, 90), (91, 91)]
    assert len(delimited) == 4 + 2 + 4  # 0..3, reading on 4..5 (nearer than a seek), from checkpoint 88 to 91


def test_a_checkpoint_inside_the_read_buffer_is_reached_without_a_seek(tmp_path, monkeypatch):
    import neva_pack.records.stream as record_stream
    from neva_pack.records import ListScanner
    from neva_pack.records import index_records

    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"n": n} for n in range(40)], separators=(",", ":")))  # 8 bytes a record
    index = index_records(path, every=4)
    monkeypatch.setattr(record_stream, "SEEK_CHUNK", 64)  # record 1 read: the buffer holds records 0..7
    seeks = []
    original = ListScanner.elements_from

    def elements_from(self, offset):
        before = self.seeks
        elements = original(self, offset)
        seeks.append(self.seeks > before)
        return elements

    monkeypatch.setattr(ListScanner, "elements_from", elements_from)
    raws = list(iter_raw_records(path, ranges=[(1, 2), (5, 6), (30, 31)], index=index))
    assert [(raw.index, raw.value) for raw in raws] == [(1, {"n": 1}), (5, {"n": 5}), (30, {"n": 30})]
    assert seeks == [True, False, True]  # to record 0, then within the buffer to 4, then a seek to 28


def test_jsonl_and_lists_the_fast_pass_refuses_are_read_sequentially(tmp_path):
    """No offsets where the compiled pass cannot vouch for the record starts: the reader delimits all."""
    from neva_pack.records import index_records

    values = [{"n": n} for n in range(9)]
    cases = {
        "data.jsonl": "".join(json.dumps(v) + "\n" for v in values),
        "bom.json": "\ufeff" + json.dumps(values),
        "number.json": json.dumps(values[:4] + [5] + values[5:]),
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        index = index_records(path, every=2)
        assert index.count == 9 and index.offsets is None, name
        raws = list(iter_raw_records(path, ranges=[(1, 3), (6, 20)], index=index))
        assert [raw.index for raw in raws] == [1, 2, 6, 7, 8], name
        assert raws == [raw for raw in iter_raw_records(path) if raw.index in (1, 2, 6, 7, 8)], name


def test_after_a_seek_a_broken_list_is_reported_by_its_byte_offset(tmp_path):
    """Lines before a checkpoint are never counted: the error names the byte, not a wrong line."""
    from neva_pack.records import RecordIndex

    path = tmp_path / "data.json"
    text = '[\n{"a": 1},\n{"b": 2},\n{"c": 3} {"d": 4}]'
    path.write_text(text)
    index = RecordIndex(count=4, every=2, offsets=np.array([2, text.index('{"c"')]))
    after = text.index('{"d')
    with pytest.raises(InputError, match=rf"expected ',' or '\]' after a record at byte {after}$"):
        list(iter_raw_records(path, ranges=[(2, 4)], index=index))
    stale = RecordIndex(count=4, every=2, offsets=np.array([2, text.index('{"c"') - 1]))  # the newline before
    with pytest.raises(InputError, match="no record starts at this checkpoint"):
        list(iter_raw_records(path, ranges=[(2, 4)], index=stale))
    path.write_text('[{"a": 1}, {"b": 2}]')  # shorter than when it was counted
    with pytest.raises(InputError, match=r"the list ends before record 2 of 6 \(the file changed"):
        list(iter_raw_records(path, ranges=[(1, 6)], index=RecordIndex(count=6, every=4, offsets=np.array([1]))))
    path.write_text(text)
    with pytest.raises(InputError, match="at line 4 "):  # the sequential scan still knows its lines
        list(iter_raw_records(path))


_SCALARS = st.sampled_from(['1', '"s"', '"]}"', '"\\"{["', '"\\\\"', ",", ":", " ", "\n", "null", "\\"])
_RECORD_TEXTS = st.recursive(
    _SCALARS,
    lambda inner: st.tuples(st.sampled_from("[{"), st.lists(inner, max_size=4), st.sampled_from("]}")).map(
        lambda parts: parts[0] + "".join(parts[1]) + parts[2]
    ),
    max_leaves=12,
).filter(lambda text: text[:1] in "[{")


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(_RECORD_TEXTS, min_size=1, max_size=5), max_depth=st.integers(1, 10))
def test_property_fast_record_pattern_delimits_as_the_scanner(tmp_path_factory, texts, max_depth):
    """The one-call pattern finds the records the byte-by-byte scanner finds, with the same
    values and reasons: brackets and braces open and close levels alike in both (a mismatched
    pair is then refused by json.loads, in both), and depth is counted the same way."""
    from neva_pack.records import ListScanner
    from neva_pack.records import RecordLimits

    path = tmp_path_factory.mktemp("fast") / "data.json"
    path.write_text("[" + ",".join(texts) + "]", encoding="utf-8")
    limits = RecordLimits(max_bytes=1000, max_depth=max_depth)

    def delimited(fast: bool):
        with open(path, "rb") as f:
            return list(ListScanner(f, path, limits, fast=fast).records())

    fast = delimited(True)
    assert delimited(False) == fast
    assert len(fast) == len(texts)


def _parquet_head() -> bytes:
    return b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00"


@pytest.mark.parametrize("name, head, says", [
    ("data.parquet", _parquet_head(), "a Parquet file, not JSON or JSONL; convert it to JSONL first"),
    ("data.csv", b"id,image,conversations\n1,a.jpg,\"[]\"\n", "starts with 'id,image,conversations' (a CSV file?)"),
    ("data.json.gz", b"\x1f\x8b\x08\x00\x00\x00\x00\x00", "a gzip-compressed file; decompress it first"),
    ("data.jsonl.zst", b"\x28\xb5\x2f\xfd\x04\x00", "a zstd-compressed file"),
    ("data.json.bz2", b"BZh91AY&SY", "a bzip2-compressed file"),
    ("data.json.xz", b"\xfd7zXZ\x00\x00\x04", "a xz-compressed file"),
    ("data.zip", b"PK\x03\x04\x14\x00", "a zip archive, not JSON or JSONL"),
    ("data.txt", b"\n  hello world\n{\"id\": 1}\n", "starts with 'hello world' (not JSON or JSONL)"),
])  # fmt: skip
def test_an_input_that_is_not_json_is_refused_in_one_line_before_any_record(tmp_path, name, head, says):
    """A Parquet or CSV --data_path was read as JSON lines: every record skipped as malformed_json."""
    path = tmp_path / name
    path.write_bytes(head + b"x" * 100)
    for read in (count_records, lambda p: list(iter_raw_records(p))):
        with pytest.raises(InputError) as error:
            read(path)
        message = str(error.value)
        assert message.startswith(f"--data_path {path}: ") and says in message and "\n" not in message


@pytest.mark.parametrize("text", ["", "  \n", '{"id": 1}\n', '\ufeff[{"id": 1}]', ' \n\t{"id": 1}\n'])
def test_json_and_jsonl_and_empty_inputs_are_still_read(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text, encoding="utf-8")
    assert count_records(path) == len(list(iter_raw_records(path)))


def test_a_fifo_as_data_path_is_refused_at_once_not_waited_on(tmp_path):
    """Opening a FIFO for reading waits for a writer: the input is looked at before it is opened."""
    import os
    import signal

    path = tmp_path / "data.jsonl"
    os.mkfifo(path)

    def hung(signum, frame):
        raise TimeoutError("reading a FIFO --data_path hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        for read in (count_records, lambda p: list(iter_raw_records(p))):
            with pytest.raises(InputError, match=rf"^--data_path {path}: not a regular file \(a FIFO\)$"):
                read(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
