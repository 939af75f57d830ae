"""Counting a JSON list's records with one compiled pass (``record_stream.index_records``'s fast path).

The scan follows only what ``list_scanner.ListScanner`` follows (brackets and braces as one kind,
strings with their escapes), so it delimits the same records; it accepts only a plain list of
arrays, objects and strings and answers None for anything else (a byte-order mark, a top-level
number or literal, any structural error), which the scanner then counts or reports, with its
line. The file is read in chunks, never whole.

The same pass notes where every ``every``-th record starts (its first byte, where the scanner
starts it), so that a DataLoader worker can seek to its own records instead of delimiting all::

    [ {"id": 0} , {"id": 1} , {"id": 2} , {"id": 3} ]     every = 2: offsets = [2, 26]
      ^ 2                     ^ 26
"""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np

from neva_pack.core import InputError
from neva_pack.files import ANY_SIZE, open_file

__all__ = ["READ_CHUNK", "count_list_records", "index_list_records"]

READ_CHUNK = 16 << 20
"""Bytes read per pass over the file (a tuning knob: any size from 1 byte gives the same answer;
read at each call)."""
_BEFORE, _FIRST, _VALUE, _AFTER_VALUE, _AFTER_COMMA, _AFTER_LIST, _UNSURE = range(7)
_PHASE, _DEPTH, _IN_STRING, _ESCAPED, _COUNT = range(5)


def count_list_records(path: Path) -> int | None:
    """Records of the JSON list at ``path``, or None when the fast scan cannot tell."""
    scanned = index_list_records(path, every=0)
    return None if scanned is None else scanned[0]


def index_list_records(path: Path, every: int) -> tuple[int, np.ndarray] | None:
    """Records of the JSON list at ``path`` and the file offset of the first byte of records 0,
    every, 2 * every, ... (int64; empty when ``every`` is 0), or None when the fast scan cannot tell."""
    state = np.zeros(5, dtype=np.int64)
    buffer = bytearray(READ_CHUNK)
    view = np.frombuffer(buffer, dtype=np.uint8)
    # records start at least 3 bytes apart ("",): a chunk holds at most size // every + 1 checkpoints
    found = np.zeros(READ_CHUNK // every + 2 if every else 0, dtype=np.int64)
    parts = []
    base = 0
    # records.stream.open_input's check (a regular file only: a FIFO would block), which stream,
    # importing this module, cannot lend
    with open_file(path, what="--data_path", max_bytes=ANY_SIZE, error=InputError) as f:
        while size := f.readinto(buffer):
            noted = _scan(view[:size], state, base, every, found)
            if state[_PHASE] == _UNSURE:
                return None
            if noted:
                parts.append(found[:noted].copy())
            base += size
    if state[_PHASE] != _AFTER_LIST:
        return None
    return int(state[_COUNT]), np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def _scan(buf, state, base, every, found):
    """Advance ``state`` over one chunk that starts at file offset ``base``; the offsets of the
    checkpoint records that start in it go to ``found``; returns how many."""
    phase, depth, in_string, escaped, count = state[0], state[1], state[2], state[3], state[4]
    noted = 0
    mark = -(-count // every) * every if every else -1  # the next checkpoint record
    for i in range(len(buf)):
        c = buf[i]
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
            if count == mark:
                found[noted] = base + i
                noted += 1
                mark += every
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
    return noted
