"""A record's depth and lone-surrogate checks, decided from its text for ordinary records and by
walking the decoded value otherwise, give the same decisions and details as a plain reference
(a recursive walk) on any JSON: ASCII-escaped or not, surrogate escapes paired and lone, raw
surrogate bytes, brackets inside strings, depth at and around the limit."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.records import RecordLimits, iter_raw_records

STRINGS = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    st.sampled_from(["[", "{{", "]", "\\u", "한", "\U0001F600", "\ud800", "\udfff", "\ud83d\ude00", "\x00"]),
)
VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), STRINGS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(STRINGS, inner, max_size=3)),
    max_leaves=12,
)
SURROGATE = re.compile("[\ud800-\udfff]")


def _reference(value, depth=1) -> tuple[int, bool]:
    """(nesting depth, whether any string or key holds a lone surrogate), recursively."""
    if isinstance(value, dict):
        found = [_reference(item, depth + 1) for item in value.values()]
        lone = any(SURROGATE.search(key) for key in value) or any(s for _, s in found)
        return max([depth] + [d for d, _ in found]), lone
    if isinstance(value, list):
        found = [_reference(item, depth + 1) for item in value]
        return max([depth] + [d for d, _ in found]), any(s for _, s in found)
    return 0, isinstance(value, str) and SURROGATE.search(value) is not None


@settings(max_examples=300)
@given(value=VALUES, ascii_only=st.booleans(), max_depth=st.integers(1, 6))
def test_depth_and_surrogate_decisions(tmp_path_factory, value, ascii_only, max_depth):
    text = json.dumps({"record": value}, ensure_ascii=ascii_only)  # an object: read as JSONL
    path = tmp_path_factory.mktemp("records") / "records.jsonl"
    path.write_bytes(text.encode("utf-8", "surrogatepass") + b"\n")
    (raw,) = iter_raw_records(path, RecordLimits(max_depth=max_depth))
    depth, lone = _reference(json.loads(text))
    if depth > max_depth:
        assert (raw.reason, raw.error) == ("record_too_deep", f"{depth} levels > --max_record_depth {max_depth}")
    elif lone:
        assert raw.reason == "invalid_unicode" and raw.error.startswith("lone surrogate in")
    else:
        assert raw.error is None and raw.value == json.loads(text)
