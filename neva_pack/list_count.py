"""Counting a JSON list's records with one compiled pass (``records.count_records``'s fast path).

The scan follows only what ``records._ListScanner`` follows (brackets and braces as one kind,
strings with their escapes), so it delimits the same records; it accepts only a plain list of
arrays, objects and strings and answers None for anything else (a byte-order mark, a top-level
number or literal, any structural error), which the scanner then counts or reports, with its
line. The file is read in chunks, never whole.
"""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np

_CHUNK = 16 << 20
_BEFORE, _FIRST, _VALUE, _AFTER_VALUE, _AFTER_COMMA, _AFTER_LIST, _UNSURE = range(7)
_PHASE, _DEPTH, _IN_STRING, _ESCAPED, _COUNT = range(5)


def count_list_records(path: Path) -> int | None:
    """Records of the JSON list at ``path``, or None when the fast scan cannot tell."""
    state = np.zeros(5, dtype=np.int64)
    buffer = bytearray(_CHUNK)
    view = np.frombuffer(buffer, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            _scan(view[:size], state)
            if state[_PHASE] == _UNSURE:
                return None
    return int(state[_COUNT]) if state[_PHASE] == _AFTER_LIST else None


@numba.njit(cache=True, nogil=True)
def _scan(buf, state):
    phase, depth, in_string, escaped, count = state[0], state[1], state[2], state[3], state[4]
    for c in buf:
        if phase == _VALUE:
            if in_string:
                if escaped:
                    escaped = 0
                elif c == 0x5C:  # backslash
                    escaped = 1
                elif c == 0x22:  # closing quote
                    in_string = 0
                    if depth == 0:
                        phase = _AFTER_VALUE
            elif c == 0x22:
                in_string = 1
            elif c == 0x5B or c == 0x7B:  # [ {
                depth += 1
            elif c == 0x5D or c == 0x7D:  # ] }
                depth -= 1
                if depth == 0:
                    phase = _AFTER_VALUE
        elif c == 0x20 or c == 0x0A or c == 0x0D or c == 0x09:  # whitespace between values
            continue
        elif phase == _BEFORE:
            phase = _FIRST if c == 0x5B else _UNSURE
        elif phase == _AFTER_VALUE:
            phase = _AFTER_COMMA if c == 0x2C else (_AFTER_LIST if c == 0x5D else _UNSURE)
        elif phase == _FIRST and c == 0x5D:
            phase = _AFTER_LIST
        elif phase == _FIRST or phase == _AFTER_COMMA:  # a record starts
            count += 1
            phase = _VALUE
            if c == 0x5B or c == 0x7B:
                depth = 1
            elif c == 0x22:
                in_string = 1
                depth = 0
            else:  # a number or literal, or a trailing comma: the scanner decides
                phase = _UNSURE
        else:  # anything after the list
            phase = _UNSURE
        if phase == _UNSURE:
            break
    state[0], state[1], state[2], state[3], state[4] = phase, depth, in_string, escaped, count
