"""NeMo's three packing algorithms, with their semantics kept and their cost removed.

Each algorithm is a pure function ``(lengths, capacity, rng, max_per_bin, budgets, **options)
-> (order, bin_of_pos, num_bins)``: it decides a visit order (the only place where
randomness enters, through the explicit ``rng``) and hands it to a numba kernel, which keeps
every bin within the capacity, ``max_per_bin`` and the visual ``budgets`` (budgets.py).
"""

from __future__ import annotations

import numpy as np

from neva_pack.packing import kernels
from neva_pack.packing.budgets import NO_BUDGETS, VisualBudgets
from neva_pack.packing.sum_of_squares import CTZ_TABLE, sum_of_squares_bins

DEFAULT_CHUNK_SIZE = 20_000
"""first_fit_shuffle packs the shuffled samples in independent chunks of this many (NeMo's value)."""


def first_fit_decreasing(
    lengths: np.ndarray, capacity: int, rng: np.random.Generator, max_per_bin: int, budgets: VisualBudgets = NO_BUDGETS
):
    """Longest first, each into the first bin it fits. Deterministic (ties keep input order)."""
    order = np.argsort(-lengths, kind="stable").astype(np.int64)
    ranks, num_bins = kernels.first_fit_ranks(lengths, order, capacity, max_per_bin, *budgets.kernel_args())
    return order, ranks, num_bins


def first_fit_shuffle(
    lengths: np.ndarray,
    capacity: int,
    rng: np.random.Generator,
    max_per_bin: int,
    budgets: VisualBudgets = NO_BUDGETS,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """NeMo's default: shuffle, then first fit inside consecutive chunks packed in parallel.

    Bins never span chunks; the bins of chunk k follow those of chunk k-1, so the plan
    does not depend on how many threads ran.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    order = rng.permutation(len(lengths)).astype(np.int64)
    ranks, num_bins = kernels.chunked_first_fit_ranks(
        lengths, order, capacity, max_per_bin, *budgets.kernel_args(), chunk_size
    )
    return order, ranks, num_bins


def shuffle_and_pack(lengths: np.ndarray, capacity: int, rng: np.random.Generator, max_per_bin: int, budgets: VisualBudgets = NO_BUDGETS):
    """Shuffle, then next fit: fast and mixed, but leaves the most room unused."""
    order = rng.permutation(len(lengths)).astype(np.int64)
    ranks, num_bins = kernels.next_fit_ranks(lengths, order, capacity, max_per_bin, *budgets.kernel_args())
    return order, ranks, num_bins


DEFAULT_REPACK_ROUNDS = 32
"""near_optimal: how many times at most the samples of the not-full bins are packed again."""


def near_optimal(
    lengths: np.ndarray,
    capacity: int,
    rng: np.random.Generator,
    max_per_bin: int,
    budgets: VisualBudgets = NO_BUDGETS,
    repack_rounds: int = DEFAULT_REPACK_ROUNDS,
):
    """Sum-of-Squares in random order, then repack the not-full bins; never worse than FFD.

    1. SS over a seeded random order: almost every bin comes out exactly full, and long and
       short samples are mixed in every bin.
    2. The samples of the bins left with a gap are packed again by SS in a fresh order, as long
       as that lowers the count (each round works on a few thousand samples only).
    3. First fit decreasing (ties in random order) runs beside it in another thread; on small or
       sparse inputs (many samples at the capacity) it can win, and then its bins are used.
    Bins come out in random order either way, so the packs are not sorted by length.

    When visual budgets bind (their images or image tokens need more bins than the positions do),
    SS, which scores the length gaps only, packs poorly and slowly: the bins are then first fit
    decreasing by each sample's largest share of a limit, or first fit over the seeded random
    order, whichever needs fewer.
    """
    from concurrent.futures import ThreadPoolExecutor

    # equal lengths are interchangeable to FFD: breaking their ties at random keeps its bin
    # count and lets the seed change which samples share a pack
    shuffled = rng.permutation(len(lengths)).astype(np.int64)
    if budgets.bins_needed() > -(-int(lengths.sum()) // capacity):
        order, bin_of_pos, num_bins = _first_fit_decreasing_of(lengths, shuffled, capacity, max_per_bin, budgets)
        in_random_order, random_bins = kernels.first_fit_ranks(lengths, shuffled, capacity, max_per_bin, *budgets.kernel_args())
        if random_bins < num_bins:
            order, bin_of_pos, num_bins = shuffled, in_random_order, random_bins
        return order, rng.permutation(num_bins).astype(np.int64)[bin_of_pos], num_bins
    with ThreadPoolExecutor(max_workers=1) as pool:
        ffd = pool.submit(_first_fit_decreasing_of, lengths, shuffled, capacity, max_per_bin, budgets)
        order, bin_of_pos, num_bins = _sum_of_squares_with_repack(lengths, capacity, rng, max_per_bin, budgets, repack_rounds)
        ffd_order, ffd_ranks, ffd_bins = ffd.result()
    if ffd_bins < num_bins:
        order, bin_of_pos, num_bins = ffd_order, ffd_ranks, ffd_bins
    ranks = rng.permutation(num_bins).astype(np.int64)[bin_of_pos]
    return order, ranks, num_bins


def _first_fit_decreasing_of(lengths, shuffled, capacity, max_per_bin, budgets):
    """FFD over ``shuffled`` sorted by decreasing size (numpy's sort and numba release the GIL): the
    length, or under visual budgets the largest share of a limit the sample takes (of the capacity,
    or of one visual budget), which packs best when a budget binds."""
    order = shuffled[np.argsort(-_dominant_share(lengths, capacity, budgets)[shuffled], kind="stable")]
    ranks, num_bins = kernels.first_fit_ranks(lengths, order, capacity, max_per_bin, *budgets.kernel_args())
    return order, ranks, num_bins


def _dominant_share(lengths, capacity, budgets):
    """Each sample's size for FFD: its length without budgets, else its largest share of a limit."""
    if not budgets.active:
        return lengths
    share = lengths / capacity
    for values, limit in budgets.pairs():
        share = np.maximum(share, values / limit)
    return share


def _sum_of_squares_with_repack(lengths, capacity, rng, max_per_bin, budgets, rounds):
    """SS over a random order, then repacks of the few samples left in bins with a gap."""
    order = rng.permutation(len(lengths)).astype(np.int64)
    bin_of_pos, num_bins, gaps = sum_of_squares_bins(lengths, order, capacity, max_per_bin, *budgets.kernel_args(), CTZ_TABLE)
    open_bins = gaps > 0
    positions = np.flatnonzero(open_bins[bin_of_pos])
    if len(positions) == 0:
        return order, bin_of_pos, num_bins
    renumber = np.full(num_bins, -1, dtype=np.int64)
    renumber[open_bins] = np.arange(int(open_bins.sum()))
    items, item_bins, item_gaps = _repack_rounds(
        lengths, order[positions], renumber[bin_of_pos[positions]], gaps[open_bins], capacity, rng, max_per_bin, budgets, rounds
    )
    kept = np.flatnonzero(~open_bins)
    renumber[kept] = np.arange(len(kept))
    bin_of_pos = renumber[bin_of_pos]
    order[positions] = items
    bin_of_pos[positions] = len(kept) + item_bins
    return order, bin_of_pos, len(kept) + len(item_gaps)


def _repack_rounds(lengths, items, item_bins, gaps, capacity, rng, max_per_bin, budgets, rounds):
    """Pack the samples of the bins that still have a gap again, as long as it pays.

    Each round tries SS in a fresh random order and first fit decreasing on those samples and
    keeps the better, if it needs no more bins than it replaces (an equal count still gives
    the next round a new arrangement); three rounds without a gain end it.
    """
    rounds_without_gain = 0
    for _ in range(rounds):
        open_bins = gaps > 0
        num_open = int(open_bins.sum())
        positions = np.flatnonzero(open_bins[item_bins])
        needed = max(-(-int(lengths[items[positions]].sum()) // capacity), budgets.bins_needed(items[positions]))
        if num_open <= needed:
            break  # the open bins are already as few as their samples allow
        shuffled = items[positions][rng.permutation(len(positions))]
        new_bins, new_count, new_gaps = sum_of_squares_bins(
            lengths, shuffled, capacity, max_per_bin, *budgets.kernel_args(), CTZ_TABLE
        )
        decreasing = shuffled[np.argsort(-_dominant_share(lengths, capacity, budgets)[shuffled], kind="stable")]
        ffd_bins, ffd_count = kernels.first_fit_ranks(lengths, decreasing, capacity, max_per_bin, *budgets.kernel_args())
        if ffd_count < new_count:
            shuffled, new_bins, new_count = decreasing, ffd_bins, ffd_count
            new_gaps = capacity - np.bincount(new_bins, weights=lengths[shuffled], minlength=new_count).astype(np.int64)
            if max_per_bin > 0:
                new_gaps[np.bincount(new_bins, minlength=new_count) >= max_per_bin] = 0  # closed by the cap
        rounds_without_gain = 0 if new_count < num_open else rounds_without_gain + 1
        if new_count <= num_open:
            kept = np.flatnonzero(~open_bins)
            renumber = np.full(len(gaps), -1, dtype=np.int64)
            renumber[kept] = np.arange(len(kept))
            item_bins = renumber[item_bins]
            items = items.copy()
            items[positions] = shuffled
            item_bins[positions] = len(kept) + new_bins
            gaps = np.concatenate([gaps[kept], new_gaps])
        if rounds_without_gain >= 3:
            break
    return items, item_bins, gaps
