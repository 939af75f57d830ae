"""``invariants.pack_problems`` as one compiled pass that answers only "sound or not".

The writer checks every pack before writing it and ``verify`` every pack it reads: the dozens of
NumPy calls a pack that ``pack_problems`` makes were a visible share of the write stage. A sound pack,
the only kind a correct run makes, is told apart here in one compiled pass; for anything else the
caller asks ``pack_problems``, which says what is wrong (``fast_pack_problems`` does both). ``pack_is_sound`` is True exactly when
``pack_problems`` returns no problem (a hypothesis test holds the two together).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from neva_pack.packing.invariants import PackSpec, pack_problems

_NONE = -1  # a start or end id that the image run does not have


def pack_is_sound(spec: PackSpec, cu_seqlens, tokens, labels, num_images: int, real_lengths=None, image_lengths=None,
                  whole_runs=None) -> bool:  # fmt: skip
    """True when ``invariants.pack_problems`` would find nothing wrong with the pack (same arguments)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    real = np.diff(cu) if real_lengths is None else np.asarray(real_lengths, dtype=np.int64)
    image_run = spec.image_run
    if image_run.positions is None:  # dynamic: the text checks (no run of fixed length), then each image's run
        if image_lengths is None and num_images == 0:
            image_lengths = np.zeros(0, dtype=np.int64)
        if image_lengths is None or len(image_lengths) != num_images:
            return False
        text = _sound(
            cu, np.asarray(tokens), np.asarray(labels), real, 0, spec.max_seq_length, spec.ignore_index, spec.pad_id,
            0, image_run.patch_id, _NONE, _NONE, np.zeros(0, dtype=np.int64),
        )  # fmt: skip
        whole = np.zeros(len(image_lengths), dtype=np.bool_) if whole_runs is None else np.asarray(whole_runs, dtype=np.bool_)
        if len(whole) != len(image_lengths):
            return False
        return text and _dynamic_runs_sound(
            np.asarray(tokens), np.asarray(image_lengths, dtype=np.int64), whole, image_run.patch_id,
            _NONE if image_run.start_id is None else image_run.start_id, _NONE if image_run.end_id is None else image_run.end_id,
        )  # fmt: skip
    run = _image_run(spec)
    return _sound(
        cu, np.asarray(tokens), np.asarray(labels), real, int(num_images), spec.max_seq_length, spec.ignore_index,
        spec.pad_id, image_run.positions, image_run.patch_id, _NONE if image_run.start_id is None else image_run.start_id,
        _NONE if image_run.end_id is None else image_run.end_id, run,
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _image_run(spec: PackSpec) -> np.ndarray:
    """The spec's image run, built once per spec, not once per pack; only read by ``_sound``."""
    return spec.image_run.ids() if spec.image_run.positions > 0 else np.zeros(0, dtype=np.int64)


def fast_pack_problems(spec: PackSpec, cu_seqlens, tokens, labels, num_images: int, real_lengths=None, image_lengths=None,
                       whole_runs=None) -> list[str]:  # fmt: skip
    """``invariants.pack_problems``' answer, a sound pack told apart by the compiled pass first
    (what the writer's check and ``verify`` call for every pack)."""
    given = {"real_lengths": real_lengths, "image_lengths": image_lengths, "whole_runs": whole_runs}
    if pack_is_sound(spec, cu_seqlens, tokens, labels, num_images, **given):
        return []
    return pack_problems(spec, cu_seqlens, tokens, labels, num_images, **given)


@numba.njit(cache=True, nogil=True)
def _dynamic_runs_sound(tokens, lengths, whole, patch_id, start_id, end_id):
    """Image k's run is [start] patch ... [end] of lengths[k] positions (a run kept whole, whole[k]:
    opened by the start id, closed by the end id, no patch id inside), in order, and no start, end
    or patch id lies outside the runs (``invariants.dynamic_run_problems`` finds nothing)."""
    delimiters = (start_id != _NONE) + (end_id != _NONE)
    n = len(tokens)
    k = 0
    p = 0
    while p < n:
        token = tokens[p]
        if token != patch_id and token != start_id and token != end_id:
            p += 1
            continue
        if k >= len(lengths):
            return False
        length = lengths[k]
        if length < max(delimiters, 1) or p + length > n:
            return False
        if whole[k]:
            if (start_id != _NONE and tokens[p] != start_id) or (end_id != _NONE and tokens[p + length - 1] != end_id):
                return False
            for j in range(length):
                if tokens[p + j] == patch_id:
                    return False
            p += length
            k += 1
            continue
        for j in range(length):
            expected = patch_id
            if j == 0 and start_id != _NONE:
                expected = start_id
            elif j == length - 1 and end_id != _NONE:
                expected = end_id
            if tokens[p + j] != expected:
                return False
        p += length
        k += 1
    return k == len(lengths)


@numba.njit(cache=True, nogil=True)
def _sound(cu, tokens, labels, real, num_images, capacity, ignore, pad_id, positions, patch_id, start_id, end_id, run):
    n = len(tokens)
    if len(labels) != n or n > capacity:
        return False
    samples = len(cu) - 1
    if samples < 1 or cu[0] != 0 or cu[samples] != n:
        return False
    for i in range(samples):
        if cu[i + 1] <= cu[i]:
            return False
    if len(real) != samples:
        return False
    for i in range(samples):
        if real[i] < 1 or real[i] > cu[i + 1] - cu[i]:
            return False
    # labels: the next token or ignored inside a sample (its last real position is free); padding: pad / ignore
    for i in range(samples):
        real_end = cu[i] + real[i]
        for k in range(cu[i], real_end - 1):
            label = labels[k]
            if label != ignore and label != (tokens[k + 1] if k + 1 < n else 0):
                return False
        for k in range(real_end, cu[i + 1]):
            if tokens[k] != pad_id or labels[k] != ignore:
                return False
    # image runs: whole, and as many as images
    if positions <= 0:
        return num_images == 0
    runs = 0
    length = len(run)
    if start_id != _NONE:
        for k in range(n):
            if tokens[k] == start_id:
                if k + length > n:
                    return False
                for j in range(length):
                    if tokens[k + j] != run[j]:
                        return False
                runs += 1
    elif end_id != _NONE:
        for k in range(n):
            if tokens[k] == end_id:
                if k + 1 < positions:
                    return False
                for j in range(length):
                    if tokens[k + 1 - positions + j] != run[j]:
                        return False
                runs += 1
    else:
        count = 0
        for k in range(n + 1):
            if k < n and tokens[k] == patch_id:
                count += 1
            else:
                runs += count // positions
                count = 0
    return runs == num_images
