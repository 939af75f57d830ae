"""The compiled loops of tokenization: the reader of a serialized ``SentencePieceText``
(``tokenizer.piece_table``), offsets from ids (``tokenizer.spelled_offsets``) and a chunk's labels
(``label_chunks.chunk_labels``); their docstrings say what each computes.

The kernels live at module level so numba's on-disk cache finds them again in the next process
(a function defined inside a function gets a new cache key per process and is compiled again
at every start). Imported only by a process that tokenizes.
"""

from __future__ import annotations

import numba
import numpy as np


NOT_TEXT = -3
"""Width of a piece that does not spell input text (unknown, control, unused): its offsets are
sentencepiece's to tell."""
BYTE = -1
"""Width of a byte piece (<0xNN>) that is not a UTF-8 continuation byte."""
CONTINUATION_BYTE = -2
"""Width of a byte piece <0x80>..<0xBF>: part of the character its predecessors began."""


@numba.njit(cache=True)
def _varint(buf, pos):
    value = 0
    shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (np.int64(byte) & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


@numba.njit(cache=True)
def _skip(buf, pos, wire_type):
    if wire_type == 0:
        return _varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = _varint(buf, pos)
        return pos + length
    return pos + 4  # wire type 5 (fixed32: the score)


# SentencePieceText: field 2 = repeated SentencePiece {1 piece, 2 id, 3 surface, 4 begin, 5 end}
@numba.njit(cache=True)
def piece_table_kernel(buf):
    out = np.zeros((len(buf) // 2 + 1, 3), dtype=np.int64)  # a piece takes at least 2 bytes
    count = 0
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        if key >> 3 != 2 or key & 7 != 2:
            pos = _skip(buf, pos, key & 7)
            continue
        length, pos = _varint(buf, pos)
        end = pos + length
        while pos < end:
            field_key, pos = _varint(buf, pos)
            field = field_key >> 3
            if field_key & 7 == 0 and (field == 2 or field == 4 or field == 5):
                value, pos = _varint(buf, pos)
                out[count, 0 if field == 2 else (1 if field == 4 else 2)] = value
            else:
                pos = _skip(buf, pos, field_key & 7)
        count += 1
    return out[:count]


@numba.njit(cache=True)
def spelled_offsets_kernel(ids, widths, skip, length):
    count = len(ids)
    starts = np.empty(count, dtype=np.int64)
    ends = np.empty(count, dtype=np.int64)
    position = -skip
    for k in range(count):
        width = widths[ids[k]]
        if width < 0:
            if width == NOT_TEXT:
                return starts, ends, False
            # a byte piece ends its character unless a continuation byte follows
            width = 0 if k + 1 < count and widths[ids[k + 1]] == CONTINUATION_BYTE else 1
        starts[k] = max(position, 0)
        position += width
        ends[k] = max(position, 0)
    return starts, ends, position == length


@numba.njit(cache=True)
def part_of(bounds, position):
    """Index of the last part starting at or before ``position`` (bounds[0] = 0)."""
    low, high = 0, len(bounds) - 1
    while high - low > 1:
        middle = (low + high) // 2
        if bounds[middle] <= position:
            low = middle
        else:
            high = middle
    return low

@numba.njit(cache=True)
def chunk_labels_kernel(ids, starts, ends, bounds, trained, is_control):
    parts = len(bounds) - 1
    total = bounds[parts]
    count = len(ids)
    mask = np.zeros(count, dtype=np.bool_)
    flagged = np.empty(count, dtype=np.int64)
    flags = 0
    ordered = True
    for k in range(count):
        start, end = starts[k], ends[k]
        if is_control[ids[k]]:
            flagged[flags] = k
            flags += 1
        if start > end or (k > 0 and start < ends[k - 1]):
            ordered = False
        if total == 0:
            continue
        if end > start:
            p = part_of(bounds, start)
            while p < parts and bounds[p] < end:
                if trained[p]:
                    mask[k] = True
                    break
                p += 1
        else:
            mask[k] = trained[part_of(bounds, min(start, total - 1))]
    return mask, flagged[:flags], ordered
