"""Images on a patch grid: sizes whose sides are multiples of a factor within pixel bounds, and uint8
pixels cut into patches merge block by merge block.

The arithmetic a native-resolution family resizes an image by, and the patch order its encoder reads,
written once for whichever family uses them (the family chooses the factor, the bounds, the variant)::

    (H, W) --round each side to the factor-->  (h, w)       area within [min_pixels, max_pixels]? done
                                                  |  no
           --scale both sides by one factor, floor (over the maximum) / ceil (under the minimum)--> (h, w)

``round`` is Python's (half to even: 70 / 28 = 2.5 -> 56). Two variants differ at the edges:
``smart_resize`` (transformers' Qwen2-VL image processor) holds a floored side at one factor;
``smart_resize_unheld`` (qwen-vl-utils 0.0.14's ``smart_resize``) takes each rounded side to at least
one factor and does not hold a floored side, refusing a side floored to 0. Both refuse an aspect
ratio over ``MAX_ASPECT_RATIO``, as the references do.

Patches (``still_patches``, ``clip_patches``): the grid of p x p patches is walked merge block by
merge block (m x m patches each, row-major within the block, blocks row-major), each patch laid out
(channel, time, row, column) with ``t`` frames per patch, as the Qwen2-VL processors flatten them::

    uint8 (T, 3, H, W) -> (T/t * H/p * W/p patches, 3, t * p, p)     a still image: T = t, repeated

Only bytes move: the normalisation to floats is the family's, applied to these rows.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MAX_ASPECT_RATIO", "clip_patches", "smart_resize", "smart_resize_unheld", "still_patches"]

MAX_ASPECT_RATIO = 200
"""The reference refuses an image whose long side is over 200 times its short side."""


def smart_resize_unheld(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) qwen-vl-utils' ``smart_resize`` gives: ``smart_resize``'s steps, but each rounded
    side at least ``factor`` and a floored side not held at it. ValueError for an aspect ratio over 200
    (its refusal) and for a side floored to 0 (PIL's refusal of the resize that follows)."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"{width} x {height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if min(h_bar, w_bar) < 1:
        raise ValueError(f"{width} x {height}: resizes to {w_bar} x {h_bar} under --max_pixels {max_pixels}")
    return h_bar, w_bar


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) of the resized image: both multiples of ``factor``, area within
    [min_pixels, max_pixels] (up to the rounding to the factor), aspect ratio kept as closely as that
    allows. ValueError for a side of 0 or an aspect ratio over 200 (the reference's own refusal)."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"{width} x {height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def still_patches(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """uint8 (3, H, W) -> (patches, 3, temporal, patch, patch): merge block by merge block, each patch
    (channel, time, row, column), the still image repeated ``temporal`` times."""
    p, m, t = patch, merge, temporal
    channels, height, width = pixels.shape
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.empty((*blocks.shape[:5], t, p, p), dtype=np.uint8)
    patches[...] = blocks[:, :, :, :, :, None]
    return patches.reshape(grid_h * grid_w, channels, t, p, p)


def clip_patches(frames: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 (T, 3, H, W), T a multiple of ``temporal`` -> ((patches, 3, temporal * patch, patch), the
    grid (T / temporal, H / patch, W / patch)): merge block by merge block within each temporal
    patch, each patch (channel, time, row, column)."""
    p, m, t = patch, merge, temporal
    grid_t, (grid_h, grid_w) = len(frames) // t, (frames.shape[2] // p, frames.shape[3] // p)
    patches = frames.reshape(grid_t, t, 3, grid_h // m, m, p, grid_w // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches).reshape(grid_t * grid_h * grid_w, 3, t * p, p), (grid_t, grid_h, grid_w)
