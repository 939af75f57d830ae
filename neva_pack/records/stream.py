"""Reading an input file's records: a JSON list or JSONL, streamed, each record's text measured
against its ``RecordLimits`` before it is decoded (``RawRecord``), and counted or indexed so that a
DataLoader worker seeks to its own records. What a record means is ``records.parse_record``'s job.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Literal

import numpy as np

from neva_pack.core import InputError
from neva_pack.records.list_scanner import UTF8_BOM, ListScanner
from neva_pack.records.conversation import MAX_RECORD_DEPTH_LIMIT, RawRecord, RecordLimits
from neva_pack.files import ANY_SIZE, compression_of, open_file

__all__ = ["SEEK_CHUNK", "RecordIndex", "count_records", "index_records", "input_format", "iter_raw_records", "open_input",
           "record_ids"]


_UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff")


def open_input(path: Path) -> BinaryIO:
    """The input file opened for reading (binary), once it is a regular file: a FIFO, device or
    directory given as ``--data_path`` is one line at once, not a hang (opening a FIFO waits for a
    writer) nor an endless read. Every reader of the input's records opens it here."""
    return open_file(path, what="--data_path", max_bytes=ANY_SIZE, error=InputError)


_NOT_JSON = {
    b"PAR1": "a Parquet file",
    b"PK\x03\x04": "a zip archive",
    b"ARROW1": "an Arrow file",
    b"SQLite format 3\x00": "an SQLite database",
    b"\x93NUMPY": "a NumPy array",
    b"\x89HDF": "an HDF5 file",
}
"""Magic numbers of files a dataset is often kept in that are not JSON, named in the refusal."""

_CONVERT_HINT = ("convert it to JSONL first (e.g. pandas: df.to_json(path, orient='records', lines=True)); "
                 "the tool reads a JSON list of records or JSONL, one record per line")  # fmt: skip


def input_format(path: Path) -> Literal["json", "jsonl"]:
    """JSON list or JSONL, by content: a JSON list starts with '[', a JSONL file's first record
    with '{'. What neither can be is refused with one line saying what it is, before any record is
    read: a compressed file, UTF-16/32 text (the tool reads UTF-8, as JSON requires: RFC 8259), a
    Parquet, Arrow, zip, CSV or any other file whose first byte cannot begin a list or a record
    (read as JSONL, every line would be a ``malformed_json`` skip), or one JSON object spread over
    lines (pretty-printed: as JSONL, every line of it would be a malformed record). An empty file
    is JSONL of no records."""
    with open_input(path) as f:
        head = f.read(4096)
    kind = compression_of(head)
    if kind is not None:
        raise InputError(f"--data_path {path}: a {kind}-compressed file; decompress it first (the tool reads JSON or JSONL text)")
    for magic, what in _NOT_JSON.items():
        if head.startswith(magic):
            raise InputError(f"--data_path {path}: {what}, not JSON or JSONL; {_CONVERT_HINT}")
    if head.startswith(_UTF16_32_BOMS) or b"\x00" in head[:4]:
        raise InputError(
            f"--data_path {path}: the file is UTF-16 or UTF-32 text, not UTF-8; convert it first "
            "(e.g. iconv -f UTF-16 -t UTF-8)"
        )
    head = head.lstrip()
    if head.startswith(UTF8_BOM):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        return "json"
    if head and not head.startswith(b"{"):
        first_line = head.partition(b"\n")[0][:60].decode("utf-8", "replace").rstrip()
        what = "a CSV file?" if b"," in head.partition(b"\n")[0] else "not JSON or JSONL"
        raise InputError(f"--data_path {path}: starts with {first_line!r} ({what}), not a JSON list '[' or a "
                         f"JSONL record '{{'; {_CONVERT_HINT}")  # fmt: skip
    first_line, newline, _ = head.partition(b"\n")
    if newline and first_line.startswith(b"{") and first_line.rstrip().endswith((b"{", b"[", b",", b":")):
        raise InputError(
            f"--data_path {path}: its first record goes on over several lines (a pretty-printed JSON object?); "
            "give a JSON list of records ([{...}, {...}]) or JSONL, one record per line"
        )
    return "jsonl"


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordIndex:
    """How many records the input holds and, for a plain JSON list, where some of them start: a
    reader seeks to the checkpoint before its records instead of delimiting every record before them."""

    count: int
    """Records in the file."""
    every: int
    """Records between two checkpoints (0 when there are none)."""
    offsets: np.ndarray | None
    """File offset (int64) of the first byte of records 0, every, 2 * every, ...; None for JSONL
    and for lists only the scanner can read (a byte-order mark, a number among the records)."""


def iter_raw_records(
    path: Path, limits: RecordLimits = RecordLimits(), ranges: Iterable[tuple[int, int]] | None = None,
    index: RecordIndex | None = None,
) -> Iterator[RawRecord]:  # fmt: skip
    """Yield the file's records in order, streaming (the file is never loaded whole).

    No record can cost more than ``limits``: one that is too long or too deep is measured while
    it is read and yielded as an error, unparsed; the rest of the file is read on. ``ranges``
    (increasing, disjoint [first, stop) of record indices) restricts it to those records (a
    DataLoader worker decodes its own, not all): with ``index`` offsets it seeks to the checkpoint
    at or before each range, or reads on when that is nearer, and delimits only the few records
    between; without, every record is delimited and only those in a range decoded.
    """
    if ranges is None:
        for number, (data, problem) in enumerate(_record_texts(path, limits)):
            yield _decode(number, data, problem, limits)
    elif index is not None and index.offsets is not None:
        yield from _ranged_records(path, limits, ranges, index)
    else:
        ranges = iter(ranges)
        first, stop = next(ranges, (None, None))
        for number, (data, problem) in enumerate(_record_texts(path, limits)):
            while first is not None and number >= stop:
                first, stop = next(ranges, (None, None))
            if first is None:
                return
            if number >= first:
                yield _decode(number, data, problem, limits)


SEEK_CHUNK = 64 << 10
"""Bytes read per fill by a reader that seeks to checkpoints (a tuning knob: a DataLoader worker
reads a few dozen records between seeks, tens of kilobytes; any size gives the same records)."""


def _ranged_records(path: Path, limits: RecordLimits, ranges: Iterable[tuple[int, int]], index: RecordIndex):
    """The records of ``ranges`` by the index's checkpoints. The list's structure outside them was
    checked by the counting pass that found the offsets, so it is not read again."""
    with open_input(path) as f:
        scanner = ListScanner(f, path, limits, chunk=SEEK_CHUNK)
        texts, number = None, None  # the scanner's records from ``number`` on
        for first, stop in ranges:
            if first >= index.count:
                return
            stop = min(stop, index.count)
            if first >= stop:
                continue
            checkpoint = first // index.every
            if texts is None or not checkpoint * index.every <= number <= first:
                number = checkpoint * index.every
                texts = scanner.elements_from(int(index.offsets[checkpoint]))
            while number < stop:
                text = next(texts, None)
                if text is None:
                    raise InputError(f"--data_path {path}: the list ends before record {number} of "
                                     f"{index.count} (the file changed since it was counted?)")  # fmt: skip
                if number >= first:
                    yield _decode(number, *text, limits)
                number += 1


def record_ids(
    path: Path, indices: np.ndarray, limits: RecordLimits = RecordLimits(), index: RecordIndex | None = None
) -> dict[int, str | None]:
    """The "id" of the records at ``indices`` (increasing, distinct), read again from the input: a
    record skipped after the encode (cut for a pack size) is named as the encode's skips are."""
    ranges = [(int(record), int(record) + 1) for record in indices]
    return {raw.index: raw.record_id for raw in iter_raw_records(path, limits, ranges=ranges, index=index)}


def index_records(path: Path, every: int, progress: bool = False) -> RecordIndex:
    """``count_records`` and, for a plain JSON list, the offset of every ``every``-th record, from
    the same compiled pass (a few bytes per ``every`` records)."""
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if input_format(path) == "json":
        from neva_pack.records.list_count import index_list_records

        fast = index_list_records(path, every)
        if fast is not None:
            count, offsets = fast
            return RecordIndex(count=count, every=every, offsets=offsets)
    return RecordIndex(count=_scanned_count(path, progress), every=0, offsets=None)


def count_records(path: Path, progress: bool = False) -> int:
    """Number of records, checking a JSON list's structure: a broken list fails here, before any work.
    Records are only delimited, not parsed: a plain list by one compiled pass (``list_count``),
    anything it is unsure of by the scanner, which says what is wrong and where."""
    if input_format(path) == "json":
        from neva_pack.records.list_count import count_list_records

        fast = count_list_records(path)
        if fast is not None:
            return fast
    return _scanned_count(path, progress)


def _scanned_count(path: Path, progress: bool) -> int:
    from tqdm import tqdm

    count = 0
    texts = _record_texts(path, RecordLimits(max_bytes=0, max_depth=MAX_RECORD_DEPTH_LIMIT))
    for _ in tqdm(texts, desc="read records", unit="rec", disable=not progress, mininterval=1):
        count += 1
    return count


def _record_texts(path: Path, limits: RecordLimits) -> Iterator[tuple[bytes | None, tuple[str, str] | None]]:
    """Each record's JSON text, or None with (reason, detail) when it is over a limit."""
    with open_input(path) as f:
        if input_format(path) == "json":
            yield from ListScanner(f, path, limits).records()
        else:
            yield from _jsonl_lines(f, limits)


_LINE_CHUNK = 1 << 20


def _jsonl_lines(f: BinaryIO, limits: RecordLimits) -> Iterator[tuple[bytes | None, tuple[str, str] | None]]:
    """Each non-blank line, read at most max_bytes + 1 at a time: a longer line is drained, not kept.
    (Counting passes max_bytes 0: every line is drained, and blank lines are still told apart.)"""
    first = True
    while True:
        line = f.readline(limits.max_bytes + 1) if limits.max_bytes else f.readline(_LINE_CHUNK)
        if not line:
            return
        if first and line.startswith(UTF8_BOM):
            line = line[3:]
        first = False
        size = len(line)
        blank = not line.strip()
        if not line.endswith(b"\n") and size > limits.max_bytes:  # over budget: drain the line, keep nothing
            while rest := f.readline(_LINE_CHUNK):
                size += len(rest)
                blank = blank and not rest.strip()
                if rest.endswith(b"\n"):
                    break
        if blank:
            continue
        if size > limits.max_bytes:
            yield None, ("record_too_large", f"{size:,} bytes > --max_record_bytes {limits.max_bytes:,}")
        else:
            yield line, None


def _decode(index: int, data: bytes | None, problem: tuple[str, str] | None, limits: RecordLimits) -> RawRecord:
    if problem is not None:
        reason, detail = problem
        return RawRecord(index, None, error=detail, reason=reason)
    try:
        value = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        return RawRecord(index, None, error=f"nested deeper than --max_record_depth {limits.max_depth}",
                         reason="record_too_deep")  # fmt: skip
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        return RawRecord(index, None, error=str(exc))
    if _plainly_within(data, limits.max_depth):
        return RawRecord(index, value)
    depth, surrogate = _depth_and_surrogates(value)
    if depth > limits.max_depth:
        return RawRecord(index, None, error=f"{depth} levels > --max_record_depth {limits.max_depth}",
                         reason="record_too_deep")  # fmt: skip
    if surrogate is not None:
        return RawRecord(index, None, error=f'lone surrogate in "{surrogate:.80}"', reason="invalid_unicode")
    return RawRecord(index, value)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a decoded string can get a surrogate from: a \\uD800..\\uDFFF escape (paired ones too),
or its UTF-8-like bytes ED A0..ED BF, which json.loads decodes with surrogatepass."""


def _plainly_within(data: bytes, max_depth: int) -> bool:
    """What _depth_and_surrogates finds, known from the text alone for ordinary records: UTF-8
    (as json.loads detects it: no NUL in the first bytes, no UTF-16/32 byte-order mark), no
    source of a surrogate, and at most max_depth brackets/braces in all (each level opens with
    one; those inside strings only loosen the bound). False: walk the value."""
    return (
        b"\x00" not in data[:4]
        and data[:1] not in (b"\xff", b"\xfe")
        and data.count(b"[") + data.count(b"{") <= max_depth
        and _SURROGATE_SOURCE.search(data) is None
    )


def _depth_and_surrogates(value) -> tuple[int, str | None]:
    """Nesting depth of a decoded value (a scalar is 0), and the first string holding a lone
    surrogate (keys included), walking iteratively."""
    deepest, surrogate = 0, None
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            for key, item in node.items():
                if surrogate is None and _SURROGATE.search(key):
                    surrogate = key.encode("utf-8", "backslashreplace").decode("ascii")
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str) and surrogate is None and _SURROGATE.search(node):
            surrogate = node.encode("utf-8", "backslashreplace").decode("ascii")
    return deepest, surrogate
