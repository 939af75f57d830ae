"""Packing under visual budgets: every algorithm keeps each pack within its capacity, its images and
its image tokens (and video tokens); without budgets the plans are those of packing by length alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.packing import ALGORITHMS, CTZ_TABLE, pack, sum_of_squares_bins, sum_of_squares_reference, visual_budgets

CAPACITY = 64
ALL = sorted(ALGORITHMS)


@st.composite
def workloads(draw, max_size=250):
    """Samples (length, images, image tokens) and budgets that every sample fits alone (or None)."""
    n = draw(st.integers(0, max_size))
    lengths = draw(st.lists(st.integers(1, CAPACITY), min_size=n, max_size=n))
    images = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    tokens = [draw(st.integers(0, 10)) * count for count in images]  # image tokens come with images
    max_images = draw(st.none() | st.integers(max(images, default=0) or 1, 12))
    max_tokens = draw(st.none() | st.integers(max(tokens, default=0) or 1, 80))
    as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return as_array(lengths), as_array(images), as_array(tokens), max_images, max_tokens


def per_bin(plan, values):
    return np.array([int(values[plan.bin(b)].sum()) for b in range(plan.num_bins)], dtype=np.int64)


def naive_first_fit_over(order, capacity, columns, limits):
    """The textbook first fit over any limits: each sample into the first bin where every column fits."""
    bins, loads = [], []
    for i in order:
        item = [int(column[i]) for column in columns]
        for b, load in enumerate(loads):
            if all(used + need <= limit for used, need, limit in zip(load, item, limits)):
                bins[b].append(int(i))
                loads[b] = [used + need for used, need in zip(load, item)]
                break
        else:
            bins.append([int(i)])
            loads.append(item)
    return bins


def naive_first_fit(lengths, images, tokens, order, capacity, max_images, max_tokens):
    """The textbook first fit over three limits: each sample into the first bin where all three fit."""
    return naive_first_fit_over(order, capacity, (lengths, images, tokens), (capacity, max_images or np.inf, max_tokens or np.inf))


@pytest.mark.parametrize("algorithm", ALL)
@settings(max_examples=60, deadline=None)
@given(workload=workloads(), seed=st.integers(0, 2**32 - 1), cap=st.integers(0, 5))
def test_every_sample_once_and_every_pack_within_its_three_limits(algorithm, workload, seed, cap):
    lengths, images, tokens, max_images, max_tokens = workload
    plan = pack(lengths, CAPACITY, algorithm, seed=seed, max_samples_per_pack=cap or None, images=images,
                image_tokens=tokens, max_images_per_pack=max_images, max_image_tokens_per_pack=max_tokens)  # fmt: skip
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))
    assert np.all(plan.samples_per_bin >= 1) and np.all(plan.bin_loads <= CAPACITY)
    if cap:
        assert plan.samples_per_bin.max(initial=0) <= cap
    if max_images is not None:
        assert per_bin(plan, images).max(initial=0) <= max_images
    if max_tokens is not None:
        assert per_bin(plan, tokens).max(initial=0) <= max_tokens
    budgets = visual_budgets(len(lengths), images, tokens, max_images, max_tokens)
    assert plan.num_bins >= max(plan.lower_bound, budgets.bins_needed())


@settings(max_examples=60, deadline=None)
@given(workload=workloads())
def test_first_fit_decreasing_gives_the_bins_of_naive_first_fit_over_three_limits(workload):
    lengths, images, tokens, max_images, max_tokens = workload
    order = np.argsort(-lengths, kind="stable")
    expected = naive_first_fit(lengths, images, tokens, order, CAPACITY, max_images, max_tokens)
    plan = pack(lengths, CAPACITY, "first_fit_decreasing", images=images, image_tokens=tokens,
                max_images_per_pack=max_images, max_image_tokens_per_pack=max_tokens)  # fmt: skip
    assert sorted(map(tuple, plan.bins())) == sorted(map(tuple, expected))


@settings(max_examples=40, deadline=None)
@given(workload=workloads(), seed=st.integers(0, 1000), chunk=st.integers(1, 50))
def test_first_fit_shuffle_under_budgets_is_naive_first_fit_per_chunk(workload, seed, chunk):
    lengths, images, tokens, max_images, max_tokens = workload
    order = np.random.default_rng(seed).permutation(len(lengths))
    plan = pack(lengths, CAPACITY, "first_fit_shuffle", seed=seed, chunk_size=chunk, images=images, image_tokens=tokens,
                max_images_per_pack=max_images, max_image_tokens_per_pack=max_tokens)  # fmt: skip
    position = 0
    for start in range(0, len(lengths), chunk):
        expected = naive_first_fit(lengths, images, tokens, order[start : start + chunk], CAPACITY, max_images, max_tokens)
        got = plan.bins()[position : position + len(expected)]
        assert sorted(map(tuple, got)) == sorted(map(tuple, expected))
        position += len(expected)
    assert position == plan.num_bins


@settings(max_examples=80, deadline=None)
@given(workload=workloads(max_size=300), seed=st.integers(0, 1000), cap=st.integers(0, 4))
def test_bitset_sum_of_squares_under_budgets_equals_the_full_scan(workload, seed, cap):
    lengths, images, tokens, max_images, max_tokens = workload
    budgets = visual_budgets(len(lengths), images, tokens, max_images, max_tokens)
    order = np.random.default_rng(seed).permutation(len(lengths)).astype(np.int64)
    fast = sum_of_squares_bins(lengths, order, CAPACITY, cap, *budgets.kernel_args(), CTZ_TABLE)
    slow = sum_of_squares_reference(lengths, order, CAPACITY, cap, *budgets.kernel_args())
    assert fast[1] == slow[1]
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[2], slow[2])


@pytest.mark.parametrize("algorithm", ALL)
@settings(max_examples=25, deadline=None)
@given(workload=workloads(), seed=st.integers(0, 1000))
def test_without_budgets_the_counts_change_nothing(algorithm, workload, seed):
    lengths, images, tokens, _, _ = workload
    plain = pack(lengths, CAPACITY, algorithm, seed=seed)
    given_counts = pack(lengths, CAPACITY, algorithm, seed=seed, images=images, image_tokens=tokens)
    assert np.array_equal(plain.offsets, given_counts.offsets) and np.array_equal(plain.indices, given_counts.indices)


def dynamic_resolution_workload(n, seed=0):
    """LLaVA-NeXT-like samples: 0-3 images of 600-2,900 tokens each, plus text."""
    rng = np.random.default_rng(seed)
    images = rng.choice([0, 1, 1, 1, 2, 3], size=n)
    tokens = np.array([rng.integers(600, 2900, size=k).sum() for k in images], dtype=np.int64)
    text = np.clip(np.round(rng.lognormal(np.log(200), 0.9, n)), 8, 3000).astype(np.int64)
    lengths = np.minimum(tokens + text, 16384)
    return lengths, images.astype(np.int64), np.minimum(tokens, lengths)


def test_near_optimal_stays_near_the_lower_bound_when_budgets_are_loose():
    lengths, images, tokens = dynamic_resolution_workload(20_000)
    plan = pack(lengths, 16384, "near_optimal", seed=0, images=images, image_tokens=tokens,
                max_images_per_pack=16, max_image_tokens_per_pack=15_000)  # fmt: skip
    assert per_bin(plan, images).max() <= 16 and per_bin(plan, tokens).max() <= 15_000
    assert plan.num_bins <= plan.lower_bound * 1.01


def test_a_tight_image_budget_decides_the_pack_count():
    lengths, images, tokens = dynamic_resolution_workload(5_000, seed=1)
    budgets = visual_budgets(len(lengths), images, tokens, 4, None)
    for algorithm in ALL:
        plan = pack(lengths, 16384, algorithm, seed=0, images=images, max_images_per_pack=4)
        assert per_bin(plan, images).max() <= 4
        assert plan.num_bins >= budgets.bins_needed() > plan.lower_bound
    best = pack(lengths, 16384, "near_optimal", seed=0, images=images, max_images_per_pack=4)
    assert best.num_bins <= budgets.bins_needed() * 1.02


def test_golden_first_fit_decreasing_under_an_image_budget():
    # lengths 6 5 4 3 (capacity 12), images 2 2 1 1, at most 3 images a pack:
    #   6 -> bin0 (2 images); 5 -> bin0 would be 11 long but hold 4 images: bin1
    #   4 -> bin0 (10 long, 3 images); 3 -> bin0 would be 13 long: bin1 (8 long, 3 images)
    plan = pack([6, 5, 4, 3], 12, "first_fit_decreasing", images=[2, 2, 1, 1], max_images_per_pack=3)
    assert sorted(map(sorted, plan.bins())) == [[0, 2], [1, 3]]
    assert pack([6, 5, 4, 3], 12, "first_fit_decreasing").bins() == [[0, 1], [2, 3]]  # by length alone


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(images=[1, 5, 0], max_images_per_pack=4),
         "1 sample(s) with more images than max_images_per_pack 4 (first: sample 1, 5); no pack can hold them"),
        (dict(image_tokens=[900, 0, 3000], max_image_tokens_per_pack=2000),
         "1 sample(s) with more image_tokens than max_image_tokens_per_pack 2000 (first: sample 2, 3000)"),
        (dict(max_images_per_pack=4), "max_images_per_pack needs the images of every sample"),
        (dict(images=[1, 1], max_images_per_pack=4), "images must be 3 integers (one per sample)"),
        (dict(images=[1, -1, 0], max_images_per_pack=4), "sample 1 has -1 images"),
        (dict(images=[1, 1, 0], max_images_per_pack=0), "max_images_per_pack must be a positive integer"),
    ],
)  # fmt: skip
def test_bad_budgets_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pack([3, 4, 5], 8, **options)


@st.composite
def clip_workloads(draw, max_size=200):
    """Samples of images and video clips (a clip is one of its sample's images, its run one of its
    image runs, so its tokens count in both), with a video-token budget and maybe the image budgets;
    every sample fits each budget alone."""
    n = draw(st.integers(0, max_size))
    lengths = draw(st.lists(st.integers(1, CAPACITY), min_size=n, max_size=n))
    stills = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    clips = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    video = [sum(draw(st.integers(1, 12)) for _ in range(count)) for count in clips]
    images = [a + b for a, b in zip(stills, clips)]
    tokens = [v + draw(st.integers(0, 8)) * count for v, count in zip(video, stills)]
    max_video = draw(st.integers(max(video, default=0) or 1, 40))
    max_images = draw(st.none() | st.integers(max(images, default=0) or 1, 10))
    max_tokens = draw(st.none() | st.integers(max(tokens, default=0) or 1, 80))
    as_array = [np.array(values, dtype=np.int64) for values in (lengths, images, tokens, video)]
    return (*as_array, max_images, max_tokens, max_video)


def pack_clips(lengths, images, tokens, video, max_images, max_tokens, max_video, algorithm, **options):
    return pack(lengths, CAPACITY, algorithm, images=images, image_tokens=tokens, video_tokens=video,
                max_images_per_pack=max_images, max_image_tokens_per_pack=max_tokens, max_video_tokens_per_pack=max_video,
                **options)  # fmt: skip


@pytest.mark.parametrize("algorithm", ALL)
@settings(max_examples=60, deadline=None)
@given(workload=clip_workloads(), seed=st.integers(0, 2**32 - 1), cap=st.integers(0, 5))
def test_every_algorithm_places_every_clip_sample_once_within_the_video_token_budget(algorithm, workload, seed, cap):
    lengths, images, tokens, video, max_images, max_tokens, max_video = workload
    plan = pack_clips(*workload, algorithm, seed=seed, max_samples_per_pack=cap or None)
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))
    assert np.all(plan.samples_per_bin >= 1) and np.all(plan.bin_loads <= CAPACITY)
    assert per_bin(plan, video).max(initial=0) <= max_video
    if max_images is not None:
        assert per_bin(plan, images).max(initial=0) <= max_images
    if max_tokens is not None:
        assert per_bin(plan, tokens).max(initial=0) <= max_tokens
    budgets = visual_budgets(len(lengths), images, tokens, max_images, max_tokens, video_tokens=video,
                             max_video_tokens_per_pack=max_video)  # fmt: skip
    assert plan.num_bins >= max(plan.lower_bound, budgets.bins_needed())
    assert budgets.bins_needed() >= -(-int(video.sum()) // max_video)


@settings(max_examples=60, deadline=None)
@given(workload=clip_workloads())
def test_first_fit_decreasing_with_a_video_budget_is_naive_first_fit_over_four_limits(workload):
    lengths, images, tokens, video, max_images, max_tokens, max_video = workload
    plan = pack_clips(*workload, "first_fit_decreasing")
    order = np.argsort(-lengths, kind="stable")
    expected = naive_first_fit_over(order, CAPACITY, (lengths, images, tokens, video),
                                    (CAPACITY, max_images or np.inf, max_tokens or np.inf, max_video))  # fmt: skip
    assert sorted(map(tuple, plan.bins())) == sorted(map(tuple, expected))


@settings(max_examples=60, deadline=None)
@given(workload=clip_workloads(max_size=250), seed=st.integers(0, 1000), cap=st.integers(0, 4))
def test_bitset_sum_of_squares_with_a_video_budget_equals_the_full_scan(workload, seed, cap):
    lengths, images, tokens, video, max_images, max_tokens, max_video = workload
    budgets = visual_budgets(len(lengths), images, tokens, max_images, max_tokens, video_tokens=video,
                             max_video_tokens_per_pack=max_video)  # fmt: skip
    order = np.random.default_rng(seed).permutation(len(lengths)).astype(np.int64)
    fast = sum_of_squares_bins(lengths, order, CAPACITY, cap, *budgets.kernel_args(), CTZ_TABLE)
    slow = sum_of_squares_reference(lengths, order, CAPACITY, cap, *budgets.kernel_args())
    assert fast[1] == slow[1]
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[2], slow[2])


def test_a_video_budget_binds_where_the_image_budgets_do_not():
    # four samples of one 30-token clip each: any two fit the positions and the image budgets, not 40 video tokens
    lengths, images, tokens, video = np.full(4, 10), np.ones(4, np.int64), np.full(4, 30), np.full(4, 30)
    for algorithm in ALL:
        loose = pack(lengths, CAPACITY, algorithm, images=images, image_tokens=tokens, max_image_tokens_per_pack=120)
        tight = pack_clips(lengths, images, tokens, video, None, 120, 40, algorithm)
        assert (loose.num_bins, tight.num_bins) == (1, 4), algorithm


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_video_tokens_per_pack": 4}, "max_video_tokens_per_pack needs the video_tokens of every sample"),
        ({"video_tokens": [1, 2, 3], "max_video_tokens_per_pack": 0}, "max_video_tokens_per_pack must be a positive integer"),
        ({"video_tokens": [1, -2, 3], "max_video_tokens_per_pack": 4}, "sample 1 has -2 video_tokens"),
        ({"video_tokens": [1, 9, 3], "max_video_tokens_per_pack": 4},
         "1 sample(s) with more video_tokens than max_video_tokens_per_pack 4 (first: sample 1, 9)"),
    ],
)  # fmt: skip
def test_bad_video_budgets_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pack([3, 4, 5], 8, **options)


def test_a_row_over_the_video_budget_alone_is_the_one_a_run_skips():
    from neva_pack.packing import budget_options, over_image_budget

    rows = np.zeros(3, dtype=[("num_images", "<i8"), ("image_tokens", "<i8"), ("video_tokens", "<i8")])
    rows["num_images"], rows["image_tokens"], rows["video_tokens"] = [1, 1, 2], [50, 90, 60], [0, 90, 20]
    assert over_image_budget(rows, None, None, 64).tolist() == [1]
    assert over_image_budget(rows, None, 80, None).tolist() == [1]
    assert over_image_budget(rows[["num_images", "image_tokens"]], 1, None).tolist() == [2]  # no video column needed
    kept = rows[[0, 2]]
    plan = pack([5, 5], 64, **budget_options(kept, None, None, 64))
    assert plan.num_bins == 1
    assert "video_tokens" not in budget_options(kept, 4, None)
    assert budget_options(kept, None, None, 64)["video_tokens"].tolist() == [0, 20]


def test_budget_problems_name_each_budget_a_pack_exceeds():
    from neva_pack.packing.invariants import budget_problems

    lengths, whole = [10, 30, 20], [False, True, True]  # one image run, two clips' runs (50 video positions)
    assert budget_problems(3, lengths, whole, max_images=3, max_image_tokens=60, max_video_tokens=50) == []
    assert budget_problems(3, lengths, whole, max_images=2, max_image_tokens=59, max_video_tokens=49) == [
        "3 images, over max_images_per_pack 2",
        "60 image tokens, over max_image_tokens_per_pack 59",
        "50 video tokens, over max_video_tokens_per_pack 49",
    ]
    assert budget_problems(1, [10], None, max_video_tokens=1) == []  # no clip run in the pack
