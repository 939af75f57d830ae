"""numba kernel of the sample store's reader: stored sample text -> tokens and labels.

A pack group's samples (hundreds for a group of text-only packs) are decoded in one compiled pass
over their positions: per-sample NumPy calls, or NumPy passes over every position (masks, gathers),
cost more than the samples' file reads. What is decoded, for one sample of ``length`` positions
whose image runs start at s_j, are L_j long and had their first E_j positions left out (L_j - 1, or 0
for a run kept whole: a video clip's) (``sample_store.SampleStore.texts``)::

    raw        [ stored ids + last label | trained bits (int32 words) | s_0 L_0 E_0 s_1 L_1 E_1 ... ]
    ids        stored ids, with the first E_j ids of run j put back at s_j (run_prefix[:E_j])
    tokens     ids[:keep]          labels  ids[p + 1] where position p is trained, else ignore

The trained bits are np.packbits' order: byte j of the words (little-endian int32) holds
positions 8j .. 8j + 7, the first in its highest bit; elided run positions have no bit.
"""

from __future__ import annotations

import numba

SOUND = -1
"""``decode_texts``' answer when every sample was decoded."""


@numba.njit(cache=True, nogil=True)
def decode_texts(raw, items, lengths, keep, run_prefix, ignore, tokens, labels):
    """Fills ``tokens`` and ``labels`` (sum(keep) each) with the samples' first keep[k] positions;
    returns SOUND, or the index of the first sample whose stored items do not fit its length or
    whose image runs overlap, leave it, elide neither L - 1 nor 0 positions or more than ``run_prefix``
    holds (the caller says which)."""
    base = 0
    out = 0
    for k in range(len(lengths)):
        length = lengths[k]
        n_ids, n_words, n_values = items[k, 0], items[k, 1], items[k, 2]
        first_word = base + n_ids
        first_start = first_word + n_words
        n_starts = n_values // 3
        if n_values != 3 * n_starts:
            return k
        elided_total = 0
        previous_end = 0
        for s in range(n_starts):
            start = raw[first_start + 3 * s]
            run = raw[first_start + 3 * s + 1]
            elide = raw[first_start + 3 * s + 2]
            if run < 1 or (elide != run - 1 and elide != 0) or elide > len(run_prefix) or start < previous_end or start + run > length:
                return k
            previous_end = start + run
            elided_total += elide
        trained_count = length - elided_total
        if n_ids != trained_count + 1 or n_words * 32 < trained_count:
            return k
        cut = keep[k]
        stored = base  # next stored id
        bit = 0  # next trained bit
        next_start = 0
        p = 0
        while p < cut:
            if next_start < n_starts and p == raw[first_start + 3 * next_start]:
                # the run's first L - 1 positions: ids from the image run, never trained (none: a run kept whole)
                elide = raw[first_start + 3 * next_start + 2]
                for r in range(elide):
                    if p + r < cut:
                        tokens[out + p + r] = run_prefix[r]
                        labels[out + p + r] = ignore
                p += elide
                next_start += 1
                continue
            word = raw[first_word + (bit >> 5)]
            byte = (word >> (8 * ((bit >> 3) & 3))) & 0xFF
            trained = (byte >> (7 - (bit & 7))) & 1
            tokens[out + p] = raw[stored]
            if trained:
                # the next position's id: stored next, or the run's first id if a run starts there
                if next_start < n_starts and p + 1 == raw[first_start + 3 * next_start] and raw[first_start + 3 * next_start + 2] > 0:
                    labels[out + p] = run_prefix[0]
                else:
                    labels[out + p] = raw[stored + 1]
            else:
                labels[out + p] = ignore
            stored += 1
            bit += 1
            p += 1
        out += cut
        base = first_start + n_values
    return SOUND
