"""Multimodal rotary position ids (mRoPE) of one Qwen2-VL / Qwen2.5-VL sample.

Three rows (temporal, height, width). Text positions advance by one on all three rows. An image
whose language-model grid is h' x w' (``image_grid_thw`` h and w over the merge size), starting
at text position ``st``, takes (st, st + i, st + j) for its token at row i, column j, in row-major
order; the text after it starts at ``st + max(h', w')``. Every sample starts at 0, so the ids of a
sample inside a pack are those of the sample alone: what transformers' ``get_rope_index`` gives
for it (Qwen2-VL and Qwen2.5-VL agree for still images; tested against both).

Pure numpy, no model: the training-side reader computes the ids of each sample of a pack from
its tokens and its images' grids.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mrope_position_ids"]


def mrope_position_ids(image_mask: np.ndarray, image_grid_thw: np.ndarray, merge_size: int = 2) -> np.ndarray:
    """int64 (3, L) position ids of one sample.

    ``image_mask``: bool (L,), True where the token is an image placeholder (``<|image_pad|>``);
    each maximal run of them is one image, in order. ``image_grid_thw``: int (n, 3), one row per
    run, as the processor returns it. ValueError when the runs and the grids disagree (count or
    length): the positions would silently be those of other images.
    """
    mask = np.asarray(image_mask, dtype=bool).reshape(-1)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(grids):
        raise ValueError(f"{len(starts)} image token runs but {len(grids)} image_grid_thw rows")
    out = np.empty((3, mask.size), dtype=np.int64)
    position = 0  # the next text position
    cursor = 0  # the next token index
    for (t, h, w), start, end in zip(grids.tolist(), starts.tolist(), ends.tolist()):
        rows, columns = h // merge_size, w // merge_size
        if end - start != t * rows * columns:
            raise ValueError(f"an image token run of {end - start} tokens at {start}, but its grid {t} x {h} x {w} makes {t * rows * columns}")
        out[:, cursor:start] = np.arange(position, position + start - cursor)
        position += start - cursor
        temporal, row, column = np.meshgrid(np.arange(t), np.arange(rows), np.arange(columns), indexing="ij")
        out[0, start:end] = temporal.reshape(-1) + position
        out[1, start:end] = row.reshape(-1) + position
        out[2, start:end] = column.reshape(-1) + position
        position += max(rows, columns)
        cursor = end
    out[:, cursor:] = np.arange(position, position + mask.size - cursor)
    return out
