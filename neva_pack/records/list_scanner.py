"""Splitting a top-level JSON list into its records' texts without parsing them (``ListScanner``):
what reads a JSON list record by record, whatever its size, and says where its structure breaks.

A record costs its own bytes at most, and nothing once it is over its ``RecordLimits``. The
compiled counting pass (``list_count``) delimits the same records as this scanner and stands in
for it where it can vouch for the file.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import BinaryIO, Iterator

from neva_pack.core import InputError
from neva_pack.records.conversation import RecordLimits

__all__ = ["READ_CHUNK", "UTF8_BOM", "ListScanner"]

READ_CHUNK = 1 << 20
"""Bytes a scanner reads per fill unless told otherwise (a tuning knob: any size from 1 byte gives
the same records; read at construction)."""
UTF8_BOM = b"\xef\xbb\xbf"
_STRUCTURAL = re.compile(rb'[\[\]{}"]')
_SCALAR_END = re.compile(rb"[,\]\s]")
_NOT_WHITESPACE = re.compile(rb"[^ \t\r\n]")
_NEWLINE = b"\n"


@functools.lru_cache(maxsize=None)
def _fast_record_pattern(levels: int) -> re.Pattern:
    """A whole array, object or string nested at most ``levels`` deep, matched in one C call
    (possessive, so it never backtracks): the fast path for ordinary records.

    Brackets and braces open and close levels alike, as ``ListScanner``'s depth counter counts
    them (a mismatched pair is json.loads's to refuse), so the pattern grows by one level's text
    per level, not twice over: it compiles quickly, on every worker's start-up path."""
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




class ListScanner:
    """Splits a top-level JSON list into its elements' byte ranges without parsing them.

    Only brackets, braces and strings are followed (a depth counter and the string ends), so a
    record costs its own bytes at most, and nothing once it is over ``limits``: it is then
    scanned to its end and dropped. Each record's text is parsed later on its own, so a syntax
    error inside one record skips that record; an error between records (the list's own
    structure) is fatal, with its line.

        [ {"id": 1, ...} , {"id": 2, ...} , 3 ]
          ^-- record 0 --^   ^-- record 1 --^  ^ record 2 (json.loads says what is wrong)
    """

    def __init__(self, f: BinaryIO, path: Path, limits: RecordLimits, chunk: int | None = None, fast: bool = True):
        self.f = f
        self.fast = fast
        """Try the one-call pattern on a record wholly in the buffer first; False scans every record
        byte by byte (the specification the pattern is held to)."""
        self.chunk = READ_CHUNK if chunk is None else chunk
        """Bytes read per fill."""
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
        self.start: int | None = None
        """File offset of the first byte of the record ``next_record`` delimited last."""
        self.seeks = 0
        """Seeks made by ``elements_from`` (a checkpoint outside the buffer)."""

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
        if char == UTF8_BOM[:1] and self.buf.startswith(UTF8_BOM, self.pos):
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
            self.seeks += 1
            self.buf, self.pos, self.mark, self.offset, self.eof = b"", 0, 0, offset, False
            self.line = None
        if self._next_char() not in (b"[", b"{", b'"') or self.offset + self.pos != offset:
            self._fail("no record starts at this checkpoint (the file changed since it was counted?)")
        return self._elements()

    def _elements(self) -> Iterator[tuple[bytes | None, tuple[str, str] | None]]:
        """The list's records from the current one (at ``pos``) to its closing ']' (consumed)."""
        while True:
            yield self.next_record()
            char = self._next_char()
            if char != b"," and char != b"]":
                self._fail("expected ',' or ']' after a record" if char else "unexpected end of file")
            self.pos += 1
            if char == b"]":
                return
            if self._next_char() == b"]":
                self._fail("trailing ',' before ']'")

    def next_record(self) -> tuple[bytes | None, tuple[str, str] | None]:
        """Delimit the record at the reading position: its JSON text, or None with (reason, detail)
        when it is over ``limits``; the position is left just after it."""
        first = self._next_char()
        if first is None:
            self._fail("unexpected end of file")
        self.mark = start = self.pos
        start_offset = self.start = self.offset + start
        too_large, too_deep = self.too_large, self.too_deep
        fast = _fast_record_pattern(_FAST_LEVELS).match(self.buf, start) if self.fast else None
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
