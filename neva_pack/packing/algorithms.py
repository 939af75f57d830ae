"""NeMo's three packing algorithms, with their semantics kept and their cost removed.

Each algorithm is a pure function ``(lengths, capacity, rng, max_per_bin, **options)
-> (order, bin_of_pos, num_bins)``: it decides a visit order (the only place where
randomness enters, through the explicit ``rng``) and hands it to a numba kernel.
"""

from __future__ import annotations

import numpy as np

from neva_pack.packing import kernels

DEFAULT_CHUNK_SIZE = 20_000
"""first_fit_shuffle packs the shuffled samples in independent chunks of this many (NeMo's value)."""


def first_fit_decreasing(lengths: np.ndarray, capacity: int, rng: np.random.Generator, max_per_bin: int):
    """Longest first, each into the first bin it fits. Deterministic (ties keep input order)."""
    order = np.argsort(-lengths, kind="stable").astype(np.int64)
    ranks, num_bins = kernels.first_fit_ranks(lengths, order, capacity, max_per_bin)
    return order, ranks, num_bins


def first_fit_shuffle(
    lengths: np.ndarray,
    capacity: int,
    rng: np.random.Generator,
    max_per_bin: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """NeMo's default: shuffle, then first fit inside consecutive chunks packed in parallel.

    Bins never span chunks; the bins of chunk k follow those of chunk k-1, so the plan
    does not depend on how many threads ran.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    order = rng.permutation(len(lengths)).astype(np.int64)
    ranks, num_bins = kernels.chunked_first_fit_ranks(lengths, order, capacity, max_per_bin, chunk_size)
    return order, ranks, num_bins


def shuffle_and_pack(lengths: np.ndarray, capacity: int, rng: np.random.Generator, max_per_bin: int):
    """Shuffle, then next fit: fast and mixed, but leaves the most room unused."""
    order = rng.permutation(len(lengths)).astype(np.int64)
    ranks, num_bins = kernels.next_fit_ranks(lengths, order, capacity, max_per_bin)
    return order, ranks, num_bins
