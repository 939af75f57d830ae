"""The Sum-of-Squares online packer (Csirik, Johnson, Kenyon, Orlin, Shor, Weber, J. ACM 2006).

SS keeps N(g) = number of open bins whose gap (free space) is g, and puts each item where it
least increases sum_g N(g)^2. Placing an item of size s changes that sum by::

    new bin          2 N(C - s) + 1
    gap g == s       1 - 2 N(s)                      (a perfect fit closes the bin)
    gap g >  s       2 + 2 N(g - s) - 2 N(g)

so SS avoids creating many bins with the same gap, which is exactly what makes first fit
strand gaps that nothing fits (LLaVA's 576-position image floor). Ties go to the smallest g.

Scanning every open gap per item costs O(C). Here gaps are bitsets (N == 0, N == 1) and the
few gaps with N >= 2 a list: "the smallest g > s with N(g) == 1 and N(g - s) == 0" is an AND
of one bitset with the other shifted by s, 64 gaps per word. The result is identical to the
full scan (tested against it), and fast enough for mix665k-sized inputs
(benchmarks/bench_packing.py; figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import numba
import numpy as np

_DE_BRUIJN = 0x03F79D71B4CB0A89


def _ctz_table() -> np.ndarray:
    table = np.zeros(64, dtype=np.int64)
    for i in range(64):
        table[((1 << i) * _DE_BRUIJN & 0xFFFFFFFFFFFFFFFF) >> 58] = i
    return table


CTZ_TABLE = _ctz_table()
"""Index of the lowest set bit of a 64-bit word, by de Bruijn multiplication."""


@numba.njit(cache=True, inline="always")
def _ctz(x, table):
    low = x & (~x + np.uint64(1))
    return table[np.int64((low * np.uint64(_DE_BRUIJN)) >> np.uint64(58))]


@numba.njit(cache=True, inline="always")
def _set_bit(bits, i):
    bits[i >> 6] |= np.uint64(1) << np.uint64(i & 63)


@numba.njit(cache=True, inline="always")
def _clear_bit(bits, i):
    bits[i >> 6] &= ~(np.uint64(1) << np.uint64(i & 63))


@numba.njit(cache=True, inline="always")
def _window(bits, base):
    """The 64 bits of ``bits`` starting at bit ``base``; bits outside the array read as 0."""
    words = bits.shape[0]
    if base <= -64:
        return np.uint64(0)
    if base < 0:
        return bits[0] << np.uint64(-base)
    w = base >> 6
    offset = base & 63
    low = bits[w] if w < words else np.uint64(0)
    if offset == 0:
        return low
    high = bits[w + 1] if w + 1 < words else np.uint64(0)
    return (low >> np.uint64(offset)) | (high << np.uint64(64 - offset))


@numba.njit(cache=True)
def _first_pair(a, b, shift, low, limit, table):
    """Smallest g in [low, limit) with bit g of ``a`` and bit g - shift of ``b`` set; else limit."""
    w = low >> 6
    words = a.shape[0]
    first = True
    while w < words and (w << 6) < limit:
        m = a[w] & _window(b, (w << 6) - shift)
        if first:
            m &= ~np.uint64(0) << np.uint64(low & 63)
            first = False
        if m != 0:
            g = (w << 6) + _ctz(m, table)
            return g if g < limit else limit
        w += 1
    return limit


@numba.njit(cache=True)
def _next_set(bits, start, limit, table):
    """Smallest i in [start, limit) whose bit is set; else limit."""
    w = start >> 6
    words = bits.shape[0]
    if w >= words:
        return limit
    x = bits[w] & (~np.uint64(0) << np.uint64(start & 63))
    while True:
        if x != 0:
            i = (w << 6) + _ctz(x, table)
            return i if i < limit else limit
        w += 1
        if w >= words:
            return limit
        x = bits[w]


@numba.njit(cache=True)
def _visual_fit(head, below, g, held_budget, needs, budget_limits):
    """The first bin of gap ``g``'s stack where every budget leaves room for the item, and the bin
    above it in the stack (-1: it is the head); (-1, -1) when none does."""
    above = -1
    b = head[g]
    while b >= 0:
        if _room(held_budget, b, needs, budget_limits):
            return b, above
        above = b
        b = below[b]
    return -1, -1


@numba.njit(cache=True)
def _room(held_budget, b, needs, budget_limits):
    """Whether bin ``b`` has room for ``needs`` in every budget."""
    for j in range(budget_limits.shape[0]):
        if held_budget[j, b] + needs[j] > budget_limits[j]:
            return False
    return True


@numba.njit(cache=True)
def _best_visual_fit(
    counts, single, multi, num_multi, head, below, s, capacity, held_budget, needs, budget_limits, table,
):  # fmt: skip
    """SS restricted to the bins with room for the item in every budget: the best gap
    (``capacity``: a new bin), its bin and the bin above that in its stack. It visits the open gaps
    only (the N == 1 bitset and the N >= 2 list) and runs only when the best gap overall has no such bin."""
    best_g = capacity
    best = 0 if s == capacity else 2 * counts[capacity - s] + 1
    best_bin = -1
    best_above = -1
    for k in range(num_multi + 1):  # the N >= 2 gaps, then (k == num_multi) the N == 1 ones in increasing order
        g = multi[k] if k < num_multi else _next_set(single, s, capacity, table)
        while s <= g < capacity:
            score = 1 - 2 * counts[g] if g == s else 2 + 2 * counts[g - s] - 2 * counts[g]
            if score < best or (score == best and g < best_g):
                b, above = _visual_fit(head, below, g, held_budget, needs, budget_limits)
                if b >= 0:
                    best, best_g, best_bin, best_above = score, g, b, above
            g = capacity if k < num_multi else _next_set(single, g + 1, capacity, table)
    return best_g, best_bin, best_above


@numba.njit(cache=True, nogil=True)
def sum_of_squares_bins(lengths, order, capacity, max_per_bin, budget_values, budget_limits, table):
    """SS over ``lengths[order]``: (bin id of each position, number of bins, gap of each bin).

    Bin ids are in opening order. A bin holding ``max_per_bin`` samples (if > 0) is closed:
    it leaves the gap counts and takes nothing more. With budgets (``budget_values[j]`` per sample,
    at most ``budget_limits[j]`` per bin; no rows: none) an item goes to the best gap among the
    bins with room for it in every budget (the first such bin of that gap's stack), and a bin left
    without room for the smallest item's value of one budget is closed too.
    """
    n = order.shape[0]
    nb = budget_limits.shape[0]
    visual = nb > 0
    fewest = np.zeros(nb, np.int64)
    for j in range(nb):
        if n > 0:
            fewest[j] = budget_values[j, order[0]]
        for p in range(n):
            fewest[j] = min(fewest[j], budget_values[j, order[p]])
    held_budget = np.zeros((nb, max(n, 1)), np.int64)
    needs = np.zeros(nb, np.int64)
    words = (capacity >> 6) + 1
    counts = np.zeros(capacity + 1, np.int64)  # N(g)
    zero = np.zeros(words, np.uint64)  # gaps 1..C-1 with N == 0
    single = np.zeros(words, np.uint64)  # gaps with N == 1
    for g in range(1, capacity):
        _set_bit(zero, g)
    multi = np.zeros(capacity + 1, np.int64)  # gaps with N >= 2, unordered
    multi_at = np.full(capacity + 1, -1, np.int64)
    num_multi = 0
    head = np.full(capacity + 1, -1, np.int64)  # a stack of open bins per gap
    below = np.full(max(n, 1), -1, np.int64)
    gap = np.zeros(max(n, 1), np.int64)
    held = np.zeros(max(n, 1), np.int64)
    bin_of_pos = np.empty(n, np.int64)
    num_bins = 0
    for p in range(n):
        s = lengths[order[p]]
        best_g = capacity  # capacity = open a new bin
        best = 0 if s == capacity else 2 * counts[capacity - s] + 1
        if s < capacity and counts[s] > 0 and 1 - 2 * counts[s] < best:
            best = 1 - 2 * counts[s]
            best_g = s
        for k in range(num_multi):
            g = multi[k]
            if g > s:
                score = 2 + 2 * counts[g - s] - 2 * counts[g]
                if score < best or (score == best and g < best_g):
                    best = score
                    best_g = g
        if s + 1 < capacity:
            # gaps with N(g) == 1 score 2 N(g - s): look for 0, then 2, then scan
            for score, partner in ((0, zero), (2, single)):  # N(g - s) == 0 scores 0, == 1 scores 2
                if best >= score:
                    limit = best_g if best == score else capacity
                    g = _first_pair(single, partner, s, s + 1, limit, table)
                    if g < limit:
                        best = score
                        best_g = g
            if best >= 4:
                g = _next_set(single, s + 1, capacity, table)
                while g < capacity:
                    score = 2 * counts[g - s]
                    if score < best or (score == best and g < best_g):
                        best = score
                        best_g = g
                    g = _next_set(single, g + 1, capacity, table)
        above = -1
        b = -1
        if visual:
            for j in range(nb):
                needs[j] = budget_values[j, order[p]]
            if best_g < capacity:
                b, above = _visual_fit(head, below, best_g, held_budget, needs, budget_limits)
                if b < 0:
                    best_g, b, above = _best_visual_fit(
                        counts, single, multi, num_multi, head, below, s, capacity, held_budget, needs, budget_limits, table,
                    )  # fmt: skip
        if best_g == capacity:
            b = num_bins
            num_bins += 1
            gap[b] = capacity
        else:
            if not visual:
                b = head[best_g]
            if above < 0:
                head[best_g] = below[b]
            else:
                below[above] = below[b]
            v = counts[best_g] - 1
            counts[best_g] = v
            if v == 0:
                _clear_bit(single, best_g)
                _set_bit(zero, best_g)
            elif v == 1:
                _set_bit(single, best_g)
                k = multi_at[best_g]
                last = multi[num_multi - 1]
                multi[k] = last
                multi_at[last] = k
                multi_at[best_g] = -1
                num_multi -= 1
        gap[b] -= s
        held[b] += 1
        bin_of_pos[p] = b
        g = gap[b]
        closed = max_per_bin > 0 and held[b] >= max_per_bin
        for j in range(nb):  # a bin without room for the smallest item's value of one budget takes nothing more
            held_budget[j, b] += needs[j]
            if held_budget[j, b] + fewest[j] > budget_limits[j]:
                closed = True
        if g > 0 and not closed:
            below[b] = head[g]
            head[g] = b
            v = counts[g] + 1
            counts[g] = v
            if v == 1:
                _set_bit(single, g)
                _clear_bit(zero, g)
            elif v == 2:
                _clear_bit(single, g)
                multi[num_multi] = g
                multi_at[g] = num_multi
                num_multi += 1
    return bin_of_pos, num_bins, gap[:num_bins].copy()


@numba.njit(cache=True)
def sum_of_squares_reference(lengths, order, capacity, max_per_bin, budget_values, budget_limits):
    """The same algorithm scanning every gap value (O(C) per item) and, with budgets, every
    bin of a gap: the specification the bitset kernel is tested against."""
    n = order.shape[0]
    nb = budget_limits.shape[0]
    fewest = np.zeros(nb, np.int64)
    for j in range(nb):
        for p in range(n):
            if p == 0 or budget_values[j, order[p]] < fewest[j]:
                fewest[j] = budget_values[j, order[p]]
    counts = np.zeros(capacity + 1, np.int64)
    gap = np.zeros(max(n, 1), np.int64)
    held = np.zeros(max(n, 1), np.int64)
    held_budget = np.zeros((nb, max(n, 1)), np.int64)
    needs = np.zeros(nb, np.int64)
    stack_head = np.full(capacity + 1, -1, np.int64)
    below = np.full(max(n, 1), -1, np.int64)
    bin_of_pos = np.empty(n, np.int64)
    num_bins = 0
    for p in range(n):
        s = lengths[order[p]]
        for j in range(nb):
            needs[j] = budget_values[j, order[p]]
        best_g = capacity
        best_bin = -1
        best_above = -1
        best = 0 if s == capacity else 2 * counts[capacity - s] + 1
        for g in range(s, capacity):
            if counts[g] == 0:
                continue
            score = 1 - 2 * counts[g] if g == s else 2 + 2 * counts[g - s] - 2 * counts[g]
            if score < best or (score == best and g < best_g):
                above = -1
                b = stack_head[g]
                while b >= 0:
                    room = True
                    for j in range(nb):
                        room = room and held_budget[j, b] + needs[j] <= budget_limits[j]
                    if room:
                        break
                    above = b
                    b = below[b]
                if b >= 0:
                    best, best_g, best_bin, best_above = score, g, b, above
        if best_g == capacity:
            b = num_bins
            num_bins += 1
            gap[b] = capacity
        else:
            b = best_bin
            if best_above < 0:
                stack_head[best_g] = below[b]
            else:
                below[best_above] = below[b]
            counts[best_g] -= 1
        gap[b] -= s
        held[b] += 1
        bin_of_pos[p] = b
        g = gap[b]
        closed = max_per_bin > 0 and held[b] >= max_per_bin
        for j in range(nb):
            held_budget[j, b] += needs[j]
            closed = closed or held_budget[j, b] + fewest[j] > budget_limits[j]
        if g > 0 and not closed:
            below[b] = stack_head[g]
            stack_head[g] = b
            counts[g] += 1
    return bin_of_pos, num_bins, gap[:num_bins].copy()
