"""Per-sample alignment for Megatron-Core's THD attention: pad every sample to a multiple of M.

Context parallelism splits each sample into 2·CP chunks (load-balanced causal attention), and
sequence parallelism splits the sequence over CP·TP ranks, so every sample's length must be a
multiple of ``M = lcm(2·CP if CP > 1, CP·TP if sequence parallel)``. Padding is decided before
packing, so the packer packs the padded lengths and every padded pack still fits::

    M = 8, lengths 5 and 11 -> padded 8 and 16

    pack    [a a a a a . . . | b b b b b b b b b b b . . . . .]     . = pad id, label ignored
    cu_seqlens           [0, 8, 24]   buffer boundaries (what NeMo's reader slices by)
    cu_seqlens_unpadded  [0, 5, 16]   real lengths, cumulated (Megatron's cu_seqlens_q)
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "aligned_capacity", "alignment_multiple", "fixed_row_length", "padded_lengths", "padded_view", "real_positions", "with_padding",
]  # fmt: skip


def alignment_multiple(
    pad_to_multiple_of: int | None = None,
    context_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """The M every sample is padded to: lcm of the explicit multiple and what CP/TP/SP need (1: none)."""
    terms = [pad_to_multiple_of or 1]
    if context_parallel_size > 1:
        terms.append(2 * context_parallel_size)
    if sequence_parallel:
        terms.append(context_parallel_size * tensor_parallel_size)
    return math.lcm(*terms)


def padded_lengths(lengths, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple`` (int64; unchanged when multiple is 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-lengths // multiple) * multiple


def aligned_capacity(capacity: int, multiple: int) -> int:
    """The longest real length whose padded length still fits ``capacity``: what samples are cut to."""
    return capacity // multiple * multiple


def fixed_row_length(capacity: int, multiple: int) -> int:
    """The row length of fixed-length batches: ``capacity`` rounded down to a multiple of ``multiple``.

    Every pack fits (its segments are multiples of ``multiple`` and sum to at most ``capacity``), and
    the last segment, grown to the row's end, stays aligned: with CP = 2 (M = 4) and packs of 510, rows
    of 508, where rows of 510 would give a last segment that context parallelism cannot split.
    """
    row = aligned_capacity(capacity, multiple)
    if row < 1:
        raise ValueError(f"max_seq_length {capacity} is shorter than the alignment multiple {multiple}")
    return row


def padded_view(pack, pad_id: int, ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    """A pack's tokens and labels with padding (``assemble.AssembledPack``): as assembled, or built
    here for a pack assembled without them."""
    if pack.padded_tokens is not None and pack.padded_labels is not None:
        return pack.padded_tokens, pack.padded_labels
    return (with_padding(pack.tokens, pack.lengths, pack.padded_lengths, pad_id),
            with_padding(pack.labels, pack.lengths, pack.padded_lengths, ignore_index))  # fmt: skip


def with_padding(values: np.ndarray, lengths: np.ndarray, padded_lengths: np.ndarray, fill: int) -> np.ndarray:
    """Concatenated per-sample values with (padded - length) ``fill`` values after each sample
    (``values`` itself when nothing is padded)."""
    if np.array_equal(lengths, padded_lengths):
        return values
    out = np.full(int(np.sum(padded_lengths)), fill, dtype=values.dtype)
    out[real_positions(lengths, padded_lengths)] = values
    return out


def real_positions(lengths: np.ndarray, padded_lengths: np.ndarray) -> np.ndarray:
    """Where each real position of the samples lands once each sample is padded::

        lengths [2, 3], padded [4, 4]  ->  [0 1 | 4 5 6]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    before = np.cumsum(padded_lengths, dtype=np.int64) - np.cumsum(lengths)  # padding up to each sample's end
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(np.concatenate([[0], before[:-1]]), lengths)
