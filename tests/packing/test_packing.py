"""Packing algorithms: properties for every registered algorithm, golden cases, first fit == naive."""

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.packing import (
    ALGORITHMS, CTZ_TABLE, NO_BUDGETS, first_fit_shuffle, pack, sum_of_squares_bins, sum_of_squares_reference
)

CAPACITY = 64
lengths_strategy = st.lists(st.integers(min_value=1, max_value=CAPACITY), min_size=0, max_size=300)
ALL = sorted(ALGORITHMS)


def naive_first_fit(lengths, order, capacity, max_per_bin=0):
    """The textbook O(n * bins) first fit, as NeMo's reference loops it."""
    bins, loads = [], []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity and (max_per_bin == 0 or len(bins[b]) < max_per_bin):
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


@pytest.mark.parametrize("algorithm", ALL)
@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 2**32 - 1))
def test_bins_partition_the_samples_and_respect_capacity(algorithm, lengths, seed):
    plan = pack(np.array(lengths, dtype=np.int64), CAPACITY, algorithm=algorithm, seed=seed)
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))
    assert plan.offsets[0] == 0 and plan.offsets[-1] == len(lengths)
    assert np.all(np.diff(plan.offsets) >= 1)
    for b in range(plan.num_bins):
        load = sum(lengths[i] for i in plan.bin(b))
        assert load == plan.bin_loads[b] <= CAPACITY
    assert plan.num_bins >= plan.lower_bound


@pytest.mark.parametrize("algorithm", ALL)
@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 1000))
def test_same_seed_same_plan(algorithm, lengths, seed):
    a = pack(np.array(lengths, dtype=np.int64), CAPACITY, algorithm=algorithm, seed=seed)
    b = pack(np.array(lengths, dtype=np.int64), CAPACITY, algorithm=algorithm, seed=seed)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.indices, b.indices)


@pytest.mark.parametrize("algorithm", ALL)
@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy, cap=st.integers(1, 5), seed=st.integers(0, 1000))
def test_max_samples_per_pack_is_respected(algorithm, lengths, cap, seed):
    plan = pack(np.array(lengths, dtype=np.int64), CAPACITY, algorithm=algorithm, seed=seed, max_samples_per_pack=cap)
    assert plan.samples_per_bin.max(initial=0) <= cap
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, cap=st.integers(0, 4))
def test_first_fit_decreasing_gives_the_bins_of_naive_first_fit(lengths, cap):
    lengths = np.array(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    expected = naive_first_fit(lengths, order, CAPACITY, cap)
    plan = pack(lengths, CAPACITY, algorithm="first_fit_decreasing", max_samples_per_pack=cap or None)
    assert sorted(map(tuple, plan.bins())) == sorted(map(tuple, expected))


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 1000), chunk=st.integers(1, 50))
def test_first_fit_shuffle_is_naive_first_fit_per_chunk_in_chunk_order(lengths, seed, chunk):
    lengths = np.array(lengths, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths))
    plan = pack(lengths, CAPACITY, algorithm="first_fit_shuffle", seed=seed, chunk_size=chunk)
    position = 0
    for start in range(0, len(lengths), chunk):
        expected = naive_first_fit(lengths, order[start : start + chunk], CAPACITY)
        got = plan.bins()[position : position + len(expected)]
        assert sorted(map(tuple, got)) == sorted(map(tuple, expected))
        position += len(expected)
    assert position == plan.num_bins


def test_first_fit_shuffle_does_not_depend_on_the_number_of_threads():
    lengths = np.random.default_rng(3).integers(1, 200, size=5000)
    rng_args = dict(capacity=512, max_per_bin=0, chunk_size=700)
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        serial = first_fit_shuffle(lengths, rng=np.random.default_rng(9), **rng_args)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        parallel = first_fit_shuffle(lengths, rng=np.random.default_rng(9), **rng_args)
    finally:
        numba.set_num_threads(previous)
    for a, b in zip(serial, parallel):
        assert np.array_equal(a, b)


def test_golden_first_fit_decreasing():
    # sorted: 6(0) 5(2) 4(4) 3(1) 2(3) 2(5); capacity 8
    # 6 -> bin0; 5 -> bin1; 4 -> bin2; 3 -> bin1 (5+3=8); 2 -> bin0 (8); 2 -> bin2 (6)
    plan = pack([6, 3, 5, 2, 4, 2], 8, algorithm="first_fit_decreasing")
    # completed (remaining < shortest 2) in order: bin1 (at the 3), bin0 (at the first 2); then open bin2
    assert plan.bins() == [[2, 1], [0, 3], [4, 5]]
    assert plan.num_bins == 3 and plan.lower_bound == 3
    assert plan.efficiency == pytest.approx(22 / 24)


def test_golden_shuffle_and_pack_is_next_fit_over_the_seeded_permutation():
    lengths = np.array([5, 4, 3, 6, 2])
    order = np.random.default_rng(7).permutation(5)
    expected, load = [[]], 0
    for i in order:
        if load + lengths[i] > 8:
            expected.append([])
            load = 0
        expected[-1].append(int(i))
        load += lengths[i]
    assert pack(lengths, 8, algorithm="shuffle_and_pack", seed=7).bins() == expected


def test_seed_changes_the_shuffled_plans():
    lengths = np.random.default_rng(0).integers(1, 60, size=400)
    for algorithm in ("first_fit_shuffle", "shuffle_and_pack", "near_optimal"):
        a = pack(lengths, CAPACITY, algorithm=algorithm, seed=1)
        b = pack(lengths, CAPACITY, algorithm=algorithm, seed=2)
        assert not np.array_equal(a.indices, b.indices)


@pytest.mark.parametrize(
    "lengths, capacity, message",
    [
        ([3, 9, 2], 8, "1 sample(s) longer than the capacity 8 (first: sample 1, length 9)"),
        ([3, 0], 8, "sample 1 has length 0"),
        ([3], 0, "capacity must be a positive integer"),
        ([[1, 2]], 8, "lengths must be a 1-D array"),
        ([1.5], 8, "lengths must be integers"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(lengths, capacity, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pack(lengths, capacity)


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        pack([1], 8, algorithm="best_fit_magic")


def test_empty_input_gives_an_empty_plan():
    plan = pack(np.zeros(0, dtype=np.int64), 8)
    assert plan.num_bins == 0 and plan.efficiency == 1.0


# ---------------------------------------------------------------------------------------------
# near_optimal: Sum-of-Squares + repack


@settings(max_examples=80, deadline=None)
@given(
    capacity=st.integers(2, 300),
    data=st.data(),
    seed=st.integers(0, 1000),
    cap=st.integers(0, 4),
)
def test_bitset_sum_of_squares_equals_the_full_scan(capacity, data, seed, cap):
    lengths = np.array(data.draw(st.lists(st.integers(1, capacity), max_size=400)), dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths)).astype(np.int64)
    fast = sum_of_squares_bins(lengths, order, capacity, cap, *NO_BUDGETS.kernel_args(), CTZ_TABLE)
    slow = sum_of_squares_reference(lengths, order, capacity, cap, *NO_BUDGETS.kernel_args())
    assert fast[1] == slow[1]
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[2], slow[2])


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 1000), cap=st.integers(0, 4))
def test_near_optimal_is_never_worse_than_first_fit_decreasing(lengths, seed, cap):
    lengths = np.array(lengths, dtype=np.int64)
    ours = pack(lengths, CAPACITY, algorithm="near_optimal", seed=seed, max_samples_per_pack=cap or None)
    ffd = pack(lengths, CAPACITY, algorithm="first_fit_decreasing", max_samples_per_pack=cap or None)
    assert ours.num_bins <= ffd.num_bins


def test_sum_of_squares_golden():
    # C = 6, items in order 2, 2, 3, 4:
    #   2 -> new bin A (gap 4);  2 -> A scores 2+2N(2)-2N(4) = 0, a new bin 2N(4)+1 = 3: A (gap 2)
    #   3 -> no gap fits: new bin B (gap 3);  4 -> gap 2 and 3 too small: new bin C (gap 2)
    bins, count, gaps = sum_of_squares_bins(np.array([2, 2, 3, 4]), np.arange(4), 6, 0, *NO_BUDGETS.kernel_args(), CTZ_TABLE)
    assert bins.tolist() == [0, 0, 1, 2] and count == 3 and gaps.tolist() == [2, 3, 2]


def llava_like_lengths(n, seed=0):
    """Image samples (576 + lognormal text) and 6% text-only, as benchmarks/distributions.py."""
    rng = np.random.default_rng(seed)
    image = 576 + np.clip(np.round(rng.lognormal(np.log(140), 0.75, n - n // 16)), 12, 3000)
    text = np.clip(np.round(rng.lognormal(np.log(260), 1.0, n // 16)), 8, 4000)
    return np.minimum(np.concatenate([image, text]).astype(np.int64), 4096)


def pack_order_correlation(plan, lengths):
    """Spearman correlation of pack position and mean sample length in the pack."""
    means = np.add.reduceat(lengths[plan.indices], plan.offsets[:-1]) / plan.samples_per_bin
    _, inverse, counts = np.unique(means, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - counts + (counts - 1) / 2)[inverse]  # ties share their mean rank
    return np.corrcoef(np.arange(plan.num_bins), ranks)[0, 1]


def test_near_optimal_beats_ffd_on_llava_like_data_and_mixes_lengths():
    lengths = llava_like_lengths(40_000)
    ours = pack(lengths, 4096, algorithm="near_optimal", seed=0)
    ffd = pack(lengths, 4096, algorithm="first_fit_decreasing")
    assert ours.num_bins < ffd.num_bins
    assert ours.num_bins <= ours.lower_bound * 1.01
    assert abs(pack_order_correlation(ours, lengths)) < 0.05  # packs in random order
    assert pack_order_correlation(ffd, lengths) < -0.5  # FFD: longest samples first
    other_seed = pack(lengths, 4096, algorithm="near_optimal", seed=1)
    assert not np.array_equal(ours.indices, other_seed.indices)


def test_the_summary_suggests_near_optimal_when_it_saves_more_than_one_percent():
    from neva_pack.pipeline import better_algorithm
    from neva_pack.commands import format_summary

    lengths = llava_like_lengths(20_000)
    plan = pack(lengths, 4096, algorithm="shuffle_and_pack")
    suggestion = better_algorithm(lengths, plan, algorithm="shuffle_and_pack", seed=0, max_samples_per_pack=None)
    assert suggestion.algorithm == "near_optimal" and suggestion.saving > 0.05
    assert suggestion.packs == pack(lengths, 4096, algorithm="near_optimal").num_bins
    near_optimal = pack(lengths, 4096, algorithm="near_optimal")
    assert better_algorithm(lengths, near_optimal, algorithm="near_optimal", seed=0, max_samples_per_pack=None) is None
    from neva_pack.commands import RunReport
    from neva_pack.commands import PackingArrays, packing_stats

    arrays = PackingArrays(capacity=4096, offsets=plan.offsets, lengths=lengths[plan.indices], num_images=None,
                           image_positions=None, pack_images=np.zeros(plan.num_bins, dtype=np.int64))  # fmt: skip
    report = RunReport(packing=packing_stats(arrays), records=None, algorithm="shuffle_and_pack", seed=0, data_prefix="x",
                       crop_size=[336, 336], max_seq_length=4096, training_overrides=[], suggestion=suggestion)  # fmt: skip
    assert f"hint           --packing_algorithm near_optimal would need {suggestion.packs:,} packs" in format_summary(report)
