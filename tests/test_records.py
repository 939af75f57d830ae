"""Record streaming and validation: every bad-record kind becomes a RecordError with its reason."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.errors import InputError
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
def test_only_the_wanted_records_before_end_are_decoded(tmp_path, monkeypatch, suffix):
    """A DataLoader worker decodes its own records only: the others are delimited, not parsed."""
    from neva_pack import records

    values = [{"n": n} for n in range(7)]
    path = tmp_path / f"data.{suffix}"
    path.write_text(json.dumps(values) if suffix == "json" else "".join(json.dumps(v) + "\n" for v in values))
    decoded = []
    original = records._decode
    monkeypatch.setattr(records, "_decode", lambda index, *rest: decoded.append(index) or original(index, *rest))
    raws = list(iter_raw_records(path, wanted=lambda index: index % 2 == 1, end=6))
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
    from neva_pack.records import MAX_RECORD_DEPTH_LIMIT, RecordLimits, _record_texts

    try:
        return sum(1 for _ in _record_texts(path, RecordLimits(max_bytes=0, max_depth=MAX_RECORD_DEPTH_LIMIT)))
    except InputError:
        return None


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(SOUP, SOUP.map(lambda t: f"[{t}]"), SOUP.map(lambda t: f'[{{"a": "{t}"}}, [{t}]]')),
       chunk=st.integers(1, 9))  # fmt: skip
def test_property_the_fast_count_is_the_scanners_or_none(tmp_path_factory, text, chunk):
    import neva_pack.list_count as list_count

    path = tmp_path_factory.mktemp("count") / "data.json"
    path.write_text(text, encoding="utf-8")
    saved, list_count._CHUNK = list_count._CHUNK, chunk
    try:
        fast = list_count.count_list_records(path)
    finally:
        list_count._CHUNK = saved
    assert fast is None or fast == scanner_count(path)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.recursive(st.text(alphabet=st.sampled_from('ab"\\[]{} ü'), max_size=6),
                                    lambda children: st.lists(children, max_size=3)
                                    | st.dictionaries(st.text(max_size=3), children, max_size=3), max_leaves=8)
                       .filter(lambda v: isinstance(v, (str, list, dict))), max_size=6),
       indent=st.sampled_from([None, 1]), chunk=st.integers(1, 9))  # fmt: skip
def test_property_the_fast_count_counts_every_plain_list(tmp_path_factory, values, indent, chunk):
    """Lists of arrays, objects and strings (any nesting, escapes) never need the scanner."""
    import neva_pack.list_count as list_count

    path = tmp_path_factory.mktemp("count") / "data.json"
    path.write_text(json.dumps(values, indent=indent, ensure_ascii=False), encoding="utf-8")
    saved, list_count._CHUNK = list_count._CHUNK, chunk
    try:
        assert list_count.count_list_records(path) == len(values) == scanner_count(path)
    finally:
        list_count._CHUNK = saved


def test_the_fast_count_leaves_numbers_and_broken_lists_to_the_scanner(tmp_path):
    from neva_pack.list_count import count_list_records

    for text, records in [('[1, {"a": 2}]', 2), ("\ufeff[{}]", 1), ('[{"a": "]"}, "x\\"y"]', 2)]:
        path = tmp_path / "data.json"
        path.write_text(text, encoding="utf-8")
        assert count_records(path) == records
    assert count_list_records(tmp_path / "data.json") == 2
    path.write_text('[{"id": 1}, {"id": 2},]')
    assert count_list_records(path) is None
    with pytest.raises(InputError, match="trailing ','"):
        count_records(path)
