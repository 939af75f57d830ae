"""Stream LLaVA-format records and turn each into a typed ``Conversation`` at the edge.

Accepted input: a JSON list of records, or JSONL (one record per line). A record::

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",   # or a list, or absent
     "conversations": [{"from": "human", "value": "<image>\\nWhat is ..."},
                       {"from": "gpt", "value": "The bus ..."}]}

(``"images": [...]``, as several LLaVA-derived datasets write it, is read as ``image``.)

A record that cannot be used raises ``RecordError`` with a reason from ``SKIP_REASONS``;
the pipeline turns it into a counted, reported skip. The source index of every record
travels end to end.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Literal

import numpy as np

from neva_pack.errors import InputError
from neva_pack.untrusted import compression_of

IMAGE_PLACEHOLDER = "<image>"

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant"})
_ROLE_OF = {**dict.fromkeys(USER_ROLES, "user"), **dict.fromkeys(ASSISTANT_ROLES, "assistant")}

SKIP_REASONS = {
    "malformed_json": "the JSONL line is not valid JSON",
    "malformed_record": "the record is not an object, or its conversations/image fields have the wrong type",
    "empty_conversation": "no turns left after dropping a leading non-human turn",
    "unknown_role": "a turn's 'from' is not human/user or gpt/assistant",
    "roles_not_alternating": "turns do not alternate human, gpt, human, ...",
    "non_string_value": "a turn's 'value' is not a string",
    "no_assistant_turn": "the conversation has nothing to train on",
    "placeholder_mismatch": "the number of <image> placeholders in human turns differs from the number of images",
    "missing_image": "an image file is not in the image folder / archive",
    "unreadable_image": "an image file cannot be decoded (the detail names the decoder's error)",
    "too_long": "longer than max_seq_length while truncation is off",
    "plain_record_shape": "the plain template takes one human turn and one answer (llava: with <image>)",
    # reliability budgets and checks: each bounds what one record may cost
    "record_too_large": "the record's JSON text is longer than --max_record_bytes (it is not parsed)",
    "record_too_deep": "the record nests arrays/objects deeper than --max_record_depth (it is not parsed)",
    "conversation_too_long": "the conversation's text has more characters than --max_conversation_chars",
    "invalid_unicode": "a string holds a lone UTF-16 surrogate (an escape like \\ud800), which is not text",
    "outside_image_folder": "an image name is absolute, climbs out with '..', or resolves (symlinks too) "
    "outside --image_folder (see --allow_outside_image_folder)",
    "image_too_large": "an image file is larger than --max_image_bytes, or its pixels (as decoded, padded "
    "or resized) exceed --max_image_pixels (checked before decoding)",
    "no_supervised_tokens": "no label is trained after templating and truncation (nothing to learn from)",
    "image_too_slow": "decoding one image took more CPU time than --max_image_decode_seconds (it was stopped)",
    "too_many_images": "the record names more images than --max_images_per_record (checked before any is read)",
    "images_not_held": "the record has images and --output_format holds text only",
}
"""Every reason a record can be skipped for, with what it means (shown in the summary)."""


IMAGES_NOT_HELD = "images_not_held"
"""The skip reason of a record with images when the output format holds text only."""


class RecordError(Exception):
    """A record that is skipped, with one of ``SKIP_REASONS`` and a human-readable detail."""

    def __init__(self, reason: str, detail: str):
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Turn:
    role: Literal["user", "assistant"]
    """Normalised speaker."""
    text: str
    """The turn's text, <image> placeholders included."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversation:
    index: int
    """Position of the record in the input file (0-based); the key of every report line."""
    record_id: str | None
    """The record's own "id", if any."""
    turns: tuple[Turn, ...]
    """Starts with a user turn and alternates."""
    images: tuple[str, ...]
    """Image file names relative to the image folder, in placeholder order."""
    system: str | None = None
    """The record's own "system" prompt, if any (used by templates that read it: NeMo's nvgpt)."""


DEFAULT_MAX_RECORD_BYTES = 8 << 20
"""8 MiB of JSON text per record (a LLaVA record is about 1.5 KB)."""
DEFAULT_MAX_RECORD_DEPTH = 64
"""Nesting levels per record (a LLaVA record has 3: record, conversations, turn)."""
MAX_RECORD_DEPTH_LIMIT = 500
"""The most --max_record_depth may be: Python's json parser recurses once per level."""
DEFAULT_MAX_CONVERSATION_CHARS = 1_000_000
"""Characters of text per conversation (about 250,000 tokens: far beyond any max_seq_length)."""
DEFAULT_MAX_IMAGES_PER_RECORD = 1_000
"""Images per record (interleaved web documents hold tens; 1,000 image runs of 576 positions are
5 MB of ids, where 142,000 placeholders took a gigabyte before they could be refused)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordLimits:
    """What one record may cost before it is parsed: a record over a limit is skipped unparsed."""

    max_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Bytes of the record's JSON text (record_too_large)."""
    max_depth: int = DEFAULT_MAX_RECORD_DEPTH
    """Nesting depth of arrays/objects inside the record, the record itself being 1 (record_too_deep)."""


@dataclass(frozen=True, slots=True)
class RawRecord:
    index: int
    """Position in the input file."""
    value: object
    """The decoded JSON value, or None when the record could not be decoded."""
    error: str | None = None
    """Why the record could not be decoded."""
    reason: str = "malformed_json"
    """The skip reason of ``error``: malformed_json, record_too_large, record_too_deep, invalid_unicode."""

    @property
    def record_id(self) -> str | None:
        """The record's "id" as text (what skipped.jsonl names a record by), or None without one."""
        value = self.value.get("id") if isinstance(self.value, dict) else None
        return None if value is None else str(value)


_UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff")
_UTF8_BOM = b"\xef\xbb\xbf"


def input_format(path: Path) -> Literal["json", "jsonl"]:
    """JSON list or JSONL, by content: a JSON list starts with '['. What neither can be is refused
    with one line saying what it is: a compressed file, UTF-16/32 text (the tool reads UTF-8, as
    JSON requires: RFC 8259), or one JSON object spread over lines (pretty-printed: as JSONL, every
    line of it would be a malformed record)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    kind = compression_of(head)
    if kind is not None:
        raise InputError(f"--data_path {path}: a {kind}-compressed file; decompress it first (the tool reads JSON or JSONL text)")
    if head.startswith(_UTF16_32_BOMS) or b"\x00" in head[:4]:
        raise InputError(
            f"--data_path {path}: the file is UTF-16 or UTF-32 text, not UTF-8; convert it first "
            "(e.g. iconv -f UTF-16 -t UTF-8)"
        )
    head = head.lstrip()
    if head.startswith(_UTF8_BOM):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        return "json"
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


_JUMP_CHUNK = 64 << 10
"""Bytes read per fill by a reader that seeks: a 32-record image message is about 40 KB."""


def _ranged_records(path: Path, limits: RecordLimits, ranges: Iterable[tuple[int, int]], index: RecordIndex):
    """The records of ``ranges`` by the index's checkpoints. The list's structure outside them was
    checked by the counting pass that found the offsets, so it is not read again."""
    with open(path, "rb", buffering=0) as f:
        scanner = _ListScanner(f, path, limits, chunk=_JUMP_CHUNK)
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
        from neva_pack.list_count import index_list_records

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
        from neva_pack.list_count import count_list_records

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
    with open(path, "rb") as f:
        if input_format(path) == "json":
            yield from _ListScanner(f, path, limits).records()
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
        if first and line.startswith(_UTF8_BOM):
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


@functools.lru_cache(maxsize=None)
def _fast_record_pattern(levels: int) -> re.Pattern:
    """A whole array, object or string nested at most ``levels`` deep, matched in one C call
    (possessive, so it never backtracks): the fast path for ordinary records.

    Brackets and braces open and close levels alike, as ``_ListScanner``'s depth counter counts
    them (a mismatched pair is json.loads's to refuse), so the pattern grows by one level's text
    per level, not twice over: it compiles in a millisecond, on every worker's start-up path."""
    string = rb'"(?:[^"\\]++|\\.)*+"'
    inside = rb'(?:[^\[\]{}"]++|' + string + rb")*+"
    for _ in range(levels - 1):
        inside = rb'(?:[^\[\]{}"]++|' + string + rb"|[\[{]" + inside + rb"[\]}])*+"
    return re.compile(rb"[\[{]" + inside + rb"[\]}]|" + string)


_FAST_LEVELS = 8
"""Nesting the fast pattern follows."""


def _within_depth(text: bytes, max_depth: int) -> bool:
    """Whether a record that the fast pattern matched nests at most ``max_depth`` levels, as the
    byte-by-byte scan would count them (only a --max_record_depth under 8 needs a look)."""
    if max_depth >= _FAST_LEVELS or text.count(b"[") + text.count(b"{") <= max_depth:
        return True
    return _fast_record_pattern(max_depth).fullmatch(text) is not None


_CHUNK = 1 << 20
_STRUCTURAL = re.compile(rb'[\[\]{}"]')
_SCALAR_END = re.compile(rb"[,\]\s]")
_NOT_WHITESPACE = re.compile(rb"[^ \t\r\n]")
_NEWLINE = b"\n"


class _ListScanner:
    """Splits a top-level JSON list into its elements' byte ranges without parsing them.

    Only brackets, braces and strings are followed (a depth counter and the string ends), so a
    record costs its own bytes at most, and nothing once it is over ``limits``: it is then
    scanned to its end and dropped. Each record's text is parsed later on its own, so a syntax
    error inside one record skips that record; an error between records (the list's own
    structure) is fatal, with its line.

        [ {"id": 1, ...} , {"id": 2, ...} , 3 ]
          ^-- record 0 --^   ^-- record 1 --^  ^ record 2 (json.loads says what is wrong)
    """

    def __init__(self, f: BinaryIO, path: Path, limits: RecordLimits, chunk: int = _CHUNK):
        self.f = f
        self.chunk = chunk
        self.path = path
        self.limits = limits
        self.too_large = ("record_too_large", f"more than --max_record_bytes {limits.max_bytes:,} bytes")
        self.too_deep = ("record_too_deep", f"more than --max_record_depth {limits.max_depth} levels")
        self.buf = b""
        self.pos = 0
        self.mark = 0
        """Start of the bytes that must be kept (the current record's, while within its budget)."""
        self.offset = 0
        """File offset of buf[0]."""
        self.line: int | None = 1
        """Line number of buf[0]; None after a seek (lines before it were never counted)."""
        self.eof = False

    def _fill(self) -> bool:
        """Read one more chunk, dropping what lies before ``mark``; False at the end of the file.
        A chunk is at least as long as what is kept, so a long record within its budget costs
        its length in copies, not its length times the number of chunks it spans."""
        if self.eof:
            return False
        chunk = self.f.read(max(self.chunk, len(self.buf) - self.mark))
        if not chunk:
            self.eof = True
            return False
        if self.line is not None:
            self.line += self.buf.count(b"\n", 0, self.mark)
        self.offset += self.mark
        self.buf = self.buf[self.mark :] + chunk
        self.pos -= self.mark
        self.mark = 0
        return True

    def _fail(self, what: str):
        where = f"byte {self.offset + self.pos}"
        if self.line is not None:
            where = f"line {self.line + self.buf.count(_NEWLINE, 0, self.pos)} ({where})"
        raise InputError(f"--data_path {self.path}: invalid JSON list: {what} at {where}")

    def _next_char(self) -> bytes | None:
        """Skip whitespace; the next byte (not consumed), or None at the end of the file."""
        while True:
            match = _NOT_WHITESPACE.search(self.buf, self.pos)
            if match is not None:
                self.pos = match.start()
                return self.buf[self.pos : self.pos + 1]
            self.pos = self.mark = len(self.buf)
            if not self._fill():
                return None

    def records(self) -> Iterator[tuple[bytes | None, tuple[str, str] | None]]:
        char = self._next_char()
        if char == _UTF8_BOM[:1] and self.buf.startswith(_UTF8_BOM, self.pos):
            self.pos += 3
            char = self._next_char()
        if char != b"[":
            self._fail("expected '['")
        self.pos += 1
        if self._next_char() == b"]":
            self.pos += 1
        else:
            yield from self._elements()
        if self._next_char() is not None:
            self._fail("data after the closing ']'")

    def elements_from(self, offset: int) -> Iterator[tuple[bytes | None, tuple[str, str] | None]]:
        """The records from the one whose first byte is at file ``offset`` (a checkpoint of
        ``index_records``) to the end of the list. Keeps the buffer when ``offset`` is in it."""
        if self.offset <= offset < self.offset + len(self.buf):
            self.pos = self.mark = offset - self.offset
        else:
            self.f.seek(offset)
            self.buf, self.pos, self.mark, self.offset, self.eof = b"", 0, 0, offset, False
            self.line = None
        if self._next_char() not in (b"[", b"{", b'"') or self.offset + self.pos != offset:
            self._fail("no record starts at this checkpoint (the file changed since it was counted?)")
        return self._elements()

    def _elements(self) -> Iterator[tuple[bytes | None, tuple[str, str] | None]]:
        """The list's records from the current one (at ``pos``) to its closing ']' (consumed)."""
        while True:
            yield self._record()
            char = self._next_char()
            if char != b"," and char != b"]":
                self._fail("expected ',' or ']' after a record" if char else "unexpected end of file")
            self.pos += 1
            if char == b"]":
                return
            if self._next_char() == b"]":
                self._fail("trailing ',' before ']'")

    def _record(self) -> tuple[bytes | None, tuple[str, str] | None]:
        first = self._next_char()
        if first is None:
            self._fail("unexpected end of file")
        self.mark = start = self.pos
        start_offset = self.offset + start
        too_large, too_deep = self.too_large, self.too_deep
        fast = _fast_record_pattern(_FAST_LEVELS).match(self.buf, start)
        if fast is not None:  # the whole record is in the buffer and not deep: no byte-by-byte scan
            self.pos = self.mark = fast.end()
            if fast.end() - start > self.limits.max_bytes:
                return None, too_large
            if not _within_depth(fast.group(), self.limits.max_depth):
                return None, too_deep
            return fast.group(), None
        large = deep = False

        def over_budget() -> bool:
            nonlocal large
            large = large or self.offset + self.pos - start_offset > self.limits.max_bytes
            if large or deep:
                self.mark = self.pos  # keep nothing more of this record
            return large or deep

        if first not in (b"[", b"{", b'"'):  # number, true, false, null: up to the next , ] or space
            while (match := _SCALAR_END.search(self.buf, self.pos)) is None:
                self.pos = len(self.buf)
                over_budget()
                if not self._fill():
                    self._fail("unexpected end of file")
            self.pos = match.start()
        else:
            depth = deepest = 0
            while True:
                match = _STRUCTURAL.search(self.buf, self.pos)
                if match is None:
                    self.pos = len(self.buf)
                    over_budget()
                    if not self._fill():
                        self._fail("unexpected end of file inside a record")
                    continue
                self.pos = match.end()
                char = match.group()
                if char == b'"':
                    self._skip_string(over_budget)
                    if depth == 0:
                        break
                elif char in b"[{":
                    depth += 1
                    if depth > deepest:
                        deepest = depth
                        deep = depth > self.limits.max_depth
                else:
                    depth -= 1
                    if depth <= 0:
                        break
        if over_budget():  # the whole record measured: the same answer wherever the buffer was refilled
            return None, too_large if large else too_deep
        return self.buf[self.mark : self.pos], None

    def _skip_string(self, over_budget) -> None:
        """From just after an opening quote to just after its closing quote."""
        while True:
            end = self.buf.find(b'"', self.pos)
            if end < 0:
                backslashes = len(self.buf) - len(self.buf.rstrip(b"\\"))
                self.pos = len(self.buf) - backslashes  # an escape cut by the chunk is looked at again
                over_budget()
                if not self._fill():
                    self._fail("unexpected end of file inside a string")
                continue
            escapes = 0
            while end - escapes - 1 >= 0 and self.buf[end - escapes - 1] == 0x5C:
                escapes += 1
            self.pos = end + 1
            if escapes % 2 == 0:
                return


def parse_record(
    raw: RawRecord, max_conversation_chars: int = DEFAULT_MAX_CONVERSATION_CHARS,
    max_images: int = DEFAULT_MAX_IMAGES_PER_RECORD,
) -> Conversation:  # fmt: skip
    """Validate one record's shape; raise RecordError for anything the pipeline cannot use.

    The images are named by ``image`` (LLaVA: a name or a list) or ``images`` (a list, as several
    LLaVA-derived datasets write it): the same thing spelled two ways; a record with both is
    malformed (which one it means is not ours to guess). A record naming more than ``max_images``
    images, or holding more <image> placeholders than that, is skipped before anything is built
    for them (each costs an image run of ids, hundreds of positions)."""
    if raw.error is not None:
        raise RecordError(raw.reason, raw.error)
    record = raw.value
    if not isinstance(record, dict):
        raise RecordError("malformed_record", f"expected an object, got {type(record).__name__}")
    record_id = raw.record_id
    if "image" in record and "images" in record:
        raise RecordError("malformed_record", "both 'image' and 'images' are given (use one of them)")
    field = "images" if "images" in record else "image"
    images = _image_list(record.get(field), field, max_images)
    conversations = record.get("conversations")
    if not isinstance(conversations, list):
        raise RecordError("malformed_record", "'conversations' is missing or not a list")
    turns = []
    characters = 0
    for position, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            raise RecordError("malformed_record", f"turn {position} is not an object")
        speaker = turn.get("from")
        if not isinstance(speaker, str):
            raise RecordError("unknown_role", f"turn {position} has from={speaker!r:.80} (not a string)")
        role = _ROLE_OF.get(speaker)
        if role is None:
            raise RecordError("unknown_role", f"turn {position} has from={speaker!r}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise RecordError("non_string_value", f"turn {position} has value of type {type(value).__name__}")
        characters += len(value)
        if characters > max_conversation_chars:
            raise RecordError(
                "conversation_too_long", f"more than --max_conversation_chars {max_conversation_chars:,} characters"
            )
        turns.append(Turn(role, value))
    if turns and turns[0].role != "user":
        turns = turns[1:]  # a leading non-human turn is dropped, as LLaVA and NeMo do
    if not turns:
        raise RecordError("empty_conversation", "no human turn to start the conversation")
    placeholders = in_answers = 0
    for position, turn in enumerate(turns):
        if placeholders > max_images:
            break
        expected = "assistant" if position & 1 else "user"
        if turn.role != expected:
            raise RecordError("roles_not_alternating", f"turn {position} is {turn.role}, expected {expected}")
        if IMAGE_PLACEHOLDER in turn.text:
            if position & 1:
                in_answers += turn.text.count(IMAGE_PLACEHOLDER)
            else:
                placeholders += turn.text.count(IMAGE_PLACEHOLDER)
    if placeholders > max_images:
        raise RecordError("too_many_images", f"more than --max_images_per_record {max_images:,} <image> placeholders")
    if len(turns) < 2:
        raise RecordError("no_assistant_turn", "the conversation has no gpt turn")
    if in_answers:
        raise RecordError("placeholder_mismatch", f"{in_answers} <image> placeholder(s) in gpt turns")
    if placeholders != len(images):
        raise RecordError("placeholder_mismatch", f"{placeholders} <image> placeholder(s) for {len(images)} image(s)")
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise RecordError("malformed_record", f"'system' is a {type(system).__name__}, not a string")
    return Conversation(index=raw.index, record_id=record_id, turns=tuple(turns), images=images, system=system)


def _image_list(value, field: str, max_images: int) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, list) and all(isinstance(name, str) for name in value):
        names = tuple(value)
    else:
        raise RecordError("malformed_record", f"'{field}' must be a string or a list of strings, got {value!r:.80}")
    if len(names) > max_images:
        raise RecordError("too_many_images", f"{len(names):,} images > --max_images_per_record {max_images:,}")
    for name in names:
        if "\x00" in name or not name.strip():  # a NUL cannot be in a file name (open() would raise)
            raise RecordError("malformed_record", f"image name {name!r:.80} is empty or holds a NUL character")
    return names
