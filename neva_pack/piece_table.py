"""The compiled reader of a serialized ``SentencePieceText`` (see ``tokenizer.piece_table``).

The kernels live at module level so numba's on-disk cache finds them again in the next process
(functions defined inside a function get a new cache key per process and were recompiled at
every start: ~1.5 s). Imported only by a process that tokenizes.
"""

from __future__ import annotations

import numba
import numpy as np


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
