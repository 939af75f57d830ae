"""numba kernels of the packing algorithms.

Every kernel works on a *visit order* (a permutation of sample indices) and returns,
for each position of that order, the rank of the bin the sample lands in. Ranks are
the final output order of the bins, so turning the result into a plan is one
counting sort (``group_by_bin``).

First fit uses a max segment tree over the remaining capacity of every bin that may
ever exist (at most one bin per item). Unopened bins have the full capacity left, so
"the leftmost bin whose remaining capacity is >= the item" is exactly the bin naive
first fit picks, whether it is already open or the next one to open: O(log n) per item
instead of O(bins).
"""

from __future__ import annotations

import numba
import numpy as np

_CLOSED = -1  # remaining capacity of a bin that holds max_per_bin samples: fits nothing


@numba.njit(cache=True)
def _tree_size(n):
    size = 1
    while size < n:
        size *= 2
    return size


@numba.njit(cache=True)
def _tree_update(tree, size, leaf, value):
    pos = size + leaf
    tree[pos] = value
    pos //= 2
    while pos >= 1:
        left = tree[2 * pos]
        right = tree[2 * pos + 1]
        tree[pos] = left if left >= right else right
        pos //= 2


@numba.njit(cache=True)
def _tree_first_at_least(tree, size, need):
    """Leftmost leaf whose value >= need (the root must already be >= need)."""
    pos = 1
    while pos < size:
        if tree[2 * pos] >= need:
            pos = 2 * pos
        else:
            pos = 2 * pos + 1
    return pos - size


@numba.njit(cache=True)
def _tree_first_fitting(tree, budget_trees, size, need, needs, stack):
    """Leftmost leaf whose length and every budget's value are >= their needs, or -1: a depth-first
    search, left child first, that skips every subtree whose maximum of one value is short."""
    pos = 1
    depth = 0
    nb = needs.shape[0]
    while True:
        fits = tree[pos] >= need
        for j in range(nb):
            fits = fits and budget_trees[j, pos] >= needs[j]
        if fits:
            if pos >= size:
                return pos - size
            stack[depth] = 2 * pos + 1
            depth += 1
            pos = 2 * pos
        elif depth == 0:
            return -1
        else:
            depth -= 1
            pos = stack[depth]


@numba.njit(cache=True)
def _smallest(values, order):
    smallest = values[order[0]]
    for p in range(order.shape[0]):
        if values[order[p]] < smallest:
            smallest = values[order[p]]
    return smallest


@numba.njit(cache=True, nogil=True)
def first_fit_ranks(lengths, order, capacity, max_per_bin, budget_values, budget_limits):
    """First fit over ``lengths[order]`` with completed-bin pruning order.

    Returns (rank of the bin of each position, number of bins). A bin is *completed*
    once it can take nothing more of this input (its remaining capacity, or what is left of one
    budget, below the smallest item's); completed bins come first in the order they completed,
    then the bins still open, in opening order. The bins themselves are those of naive first
    fit, a bin taking an item only when its length and its value of every budget fit
    (``budget_values[j]``: per-sample values of budget j, ``budget_limits[j]``: its limit per bin;
    no rows: no budgets).
    """
    n = order.shape[0]
    bin_of_pos = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_of_pos, 0
    nb = budget_limits.shape[0]
    visual = nb > 0
    shortest = _smallest(lengths, order)
    fewest = np.empty(nb, dtype=np.int64)
    for j in range(nb):
        fewest[j] = _smallest(budget_values[j], order)
    # first fit leaves at most one bin at most half full, so without a per-bin cap it opens
    # at most 2 * sum / capacity + 1 bins: a smaller tree is a faster tree
    total = 0
    for p in range(n):
        total += lengths[order[p]]
    most_bins = n if max_per_bin > 0 or visual else min(n, 2 * (total // capacity) + 2)
    size = _tree_size(most_bins)
    tree = np.full(2 * size, capacity, dtype=np.int64)
    remaining = np.full(n, capacity, dtype=np.int64)
    # budgets: what is left of each per bin, one tree each
    budget_left = np.empty((nb, size), dtype=np.int64)
    budget_trees = np.empty((nb, 2 * size), dtype=np.int64)
    for j in range(nb):
        budget_left[j, :] = budget_limits[j]
        budget_trees[j, :] = budget_limits[j]
    needs = np.zeros(nb, dtype=np.int64)
    stack = np.empty(64, dtype=np.int64)
    count = np.zeros(n, dtype=np.int64)
    completed_at = np.full(n, -1, dtype=np.int64)  # completion sequence number, -1 = open
    num_bins = 0
    num_completed = 0
    for p in range(n):
        item = lengths[order[p]]
        if visual:
            for j in range(nb):
                needs[j] = budget_values[j, order[p]]
            b = _tree_first_fitting(tree, budget_trees, size, item, needs, stack)
            for j in range(nb):
                budget_left[j, b] -= needs[j]
                _tree_update(budget_trees[j], size, b, budget_left[j, b])
        else:
            b = _tree_first_at_least(tree, size, item)
        if b >= num_bins:
            num_bins = b + 1
        bin_of_pos[p] = b
        remaining[b] -= item
        count[b] += 1
        full = max_per_bin > 0 and count[b] >= max_per_bin
        for j in range(nb):  # a bin that can take nothing more leaves the search
            full = full or budget_left[j, b] < fewest[j]
        _tree_update(tree, size, b, _CLOSED if full else remaining[b])
        if completed_at[b] < 0 and (full or remaining[b] < shortest):
            completed_at[b] = num_completed
            num_completed += 1
    rank = np.empty(num_bins, dtype=np.int64)
    next_open_rank = num_completed
    for b in range(num_bins):
        if completed_at[b] >= 0:
            rank[b] = completed_at[b]
        else:
            rank[b] = next_open_rank
            next_open_rank += 1
    for p in range(n):
        bin_of_pos[p] = rank[bin_of_pos[p]]
    return bin_of_pos, num_bins


@numba.njit(cache=True, parallel=True)
def chunked_first_fit_ranks(lengths, order, capacity, max_per_bin, budget_values, budget_limits, chunk_size):
    """First fit run independently on consecutive chunks of ``order``, chunks in parallel.

    Bins of chunk k are ranked after all bins of chunks < k, so the result is the same
    for any number of threads.
    """
    n = order.shape[0]
    num_chunks = (n + chunk_size - 1) // chunk_size
    bin_of_pos = np.empty(n, dtype=np.int64)
    bins_in_chunk = np.zeros(num_chunks, dtype=np.int64)
    for c in numba.prange(num_chunks):
        start = c * chunk_size
        stop = min(start + chunk_size, n)
        local, nb = first_fit_ranks(lengths, order[start:stop], capacity, max_per_bin, budget_values, budget_limits)
        bin_of_pos[start:stop] = local
        bins_in_chunk[c] = nb
    base = 0
    for c in range(num_chunks):
        start = c * chunk_size
        stop = min(start + chunk_size, n)
        for p in range(start, stop):
            bin_of_pos[p] += base
        base += bins_in_chunk[c]
    return bin_of_pos, base


@numba.njit(cache=True)
def next_fit_ranks(lengths, order, capacity, max_per_bin, budget_values, budget_limits):
    """Next fit: fill the current bin in visit order; open a new one when the item does not fit
    (its length, or its value of one budget: ``budget_values[j]`` per sample, at most
    ``budget_limits[j]`` per bin)."""
    n = order.shape[0]
    nb = budget_limits.shape[0]
    bin_of_pos = np.empty(n, dtype=np.int64)
    current = -1
    load = capacity + 1
    count = 0
    held = np.zeros(nb, dtype=np.int64)
    for p in range(n):
        item = lengths[order[p]]
        new_bin = load + item > capacity or (max_per_bin > 0 and count >= max_per_bin)
        for j in range(nb):
            new_bin = new_bin or held[j] + budget_values[j, order[p]] > budget_limits[j]
        if new_bin:
            current += 1
            load = 0
            count = 0
            held[:] = 0
        load += item
        count += 1
        for j in range(nb):
            held[j] += budget_values[j, order[p]]
        bin_of_pos[p] = current
    return bin_of_pos, current + 1


@numba.njit(cache=True)
def group_by_bin(lengths, order, bin_of_pos, num_bins):
    """Counting sort of the visit order by bin rank: CSR offsets, indices and bin loads.

    Stable, so samples keep their insertion order inside a bin.
    """
    n = order.shape[0]
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    loads = np.zeros(num_bins, dtype=np.int64)
    for p in range(n):
        offsets[bin_of_pos[p] + 1] += 1
        loads[bin_of_pos[p]] += lengths[order[p]]
    for b in range(num_bins):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    indices = np.empty(n, dtype=np.int64)
    for p in range(n):
        b = bin_of_pos[p]
        indices[cursor[b]] = order[p]
        cursor[b] += 1
    return offsets, indices, loads
