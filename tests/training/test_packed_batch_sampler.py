"""PackedBatchSampler: per-epoch packs dealt to data-parallel ranks (the specification, as properties)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neva_pack.packing import ALGORITHMS, step_cost_model
from neva_pack.training import PackedBatchSampler

CAPACITY = 64


@st.composite
def setups(draw):
    """Without drop_last every sample must be dealt: lengths of at most half the capacity and at least
    two samples per rank leave enough bins of two samples or more to cut (first fit fills all bins
    but one past half). Visual budgets, when drawn, are likewise at least twice any sample's images
    and image tokens (with drop_last: at least any sample's), and mostly binding."""
    replicas = draw(st.integers(1, 5))
    drop_last = draw(st.booleans())
    longest, fewest = (CAPACITY, 0) if drop_last else (CAPACITY // 2, 2 * replicas)
    lengths = draw(st.lists(st.integers(1, longest), min_size=fewest, max_size=120))
    setup = {
        "lengths": lengths,
        "num_replicas": replicas,
        "seed": draw(st.integers(0, 2**32)),
        "algorithm": draw(st.sampled_from(sorted(ALGORITHMS))),
        "drop_last": drop_last,
    }
    if draw(st.booleans()):
        setup |= draw(visual_budgets(len(lengths), 1 if drop_last else 2))
    return setup


@st.composite
def visual_budgets(draw, count, headroom):
    """Images and image tokens per sample, and budgets of ``headroom`` x the most of one sample or a
    little more (each budget, and max_samples_per_pack, drawn or not)."""
    images = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    tokens = [sum(draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))) for n in images]
    budgets = {"num_images": images, "image_tokens": tokens}
    for name, values in (("max_images_per_pack", images), ("max_image_tokens_per_pack", tokens)):
        if draw(st.booleans()):
            budgets[name] = max(1, headroom * max(values, default=0)) + draw(st.integers(0, 3))
    if draw(st.booleans()):
        budgets["max_samples_per_pack"] = draw(st.integers(2, 6))
    return budgets


def assert_within_every_limit(setup, batches):
    """Every batch holds at most the capacity in positions and every cap drawn."""
    per_sample = {
        "max_samples_per_pack": np.ones(len(setup["lengths"]), np.int64),
        "max_images_per_pack": np.asarray(setup.get("num_images", []), np.int64),
        "max_image_tokens_per_pack": np.asarray(setup.get("image_tokens", []), np.int64),
    }
    lengths = np.asarray(setup["lengths"], np.int64)
    for batch in batches:
        assert batch and lengths[batch].sum() <= CAPACITY
        for name, values in per_sample.items():
            if setup.get(name) is not None:
                assert values[batch].sum() <= setup[name], name


def every_rank(setup, epoch=0):
    """Each rank's batches for ``epoch`` from its own sampler, as on R machines."""
    batches = []
    for rank in range(setup["num_replicas"]):
        sampler = PackedBatchSampler(capacity=CAPACITY, rank=rank, **setup)
        sampler.set_epoch(epoch)
        batches.append(list(sampler))
        assert len(sampler) == len(batches[-1])
    return batches, sampler.dropped


@given(setups(), st.integers(0, 3))
def test_every_sample_once_per_epoch_across_ranks_or_listed_as_dropped(setup, epoch):
    batches, dropped = every_rank(setup, epoch)
    lengths = np.asarray(setup["lengths"])
    seen = [i for rank in batches for batch in rank for i in batch] + dropped.tolist()
    assert sorted(seen) == list(range(len(lengths)))
    assert_within_every_limit(setup, [batch for rank in batches for batch in rank])
    assert len({len(rank) for rank in batches}) == 1  # the same number of steps on every rank
    if not setup["drop_last"]:
        assert len(dropped) == 0
    else:  # only the bins that do not fill a last step: fewer bins than ranks
        assert lengths[dropped].sum() < setup["num_replicas"] * CAPACITY


@given(setups())
def test_each_step_groups_bins_of_alike_modelled_step_time(setup):
    """By default a bin costs its modelled step time (the default preset's FLOPs of its samples, their
    image tokens counted):
    the step maxima are every R-th cost of the bins sorted by it (the least sum of maxima any dealing has)."""
    replicas = setup["num_replicas"]
    sampler = PackedBatchSampler(capacity=CAPACITY, **setup)
    plan = sampler.plan_epoch(0)
    flops = step_cost_model("auto").sample_flops(setup["lengths"], setup.get("image_tokens"))  # image tokens, if drawn
    cost = np.array([flops[plan.batch(s, r)].sum() for s in range(plan.num_steps) for r in range(replicas)])
    steps = cost.reshape(-1, replicas)
    assert np.allclose(sorted(steps.max(axis=1).tolist(), reverse=True), np.sort(cost)[::-1][::replicas], rtol=1e-12)


@given(setups(), st.integers(0, 2**32))
def test_each_step_groups_bins_of_alike_attention_and_vision_cost(setup, salt):
    """Under step_cost_model="attention" (the order of old), given each sample's vision cost (the vision
    encoder's attention), a bin costs its LM attention plus that: with tolerance 0 the step maxima are
    every R-th cost of the bins sorted by the sum."""
    replicas = setup["num_replicas"]
    lengths = np.asarray(setup["lengths"], dtype=np.int64)
    vision = np.random.default_rng(salt).integers(0, 4, len(lengths)) * 576**2
    sampler = PackedBatchSampler(capacity=CAPACITY, tolerance=0, vision_cost=vision, step_cost_model="attention", **setup)
    plan = sampler.plan_epoch(0)
    cost = np.array([
        (lengths[plan.batch(s, r)] ** 2).sum() + vision[plan.batch(s, r)].sum()
        for s in range(plan.num_steps) for r in range(replicas)
    ])  # fmt: skip
    steps = cost.reshape(-1, replicas)
    assert sorted(steps.max(axis=1).tolist(), reverse=True) == np.sort(cost)[::-1][::replicas].tolist()


@given(setups())
def test_the_plan_is_a_function_of_seed_and_epoch_only(setup):
    first, second = (PackedBatchSampler(capacity=CAPACITY, rank=r, **setup) for r in (0, setup["num_replicas"] - 1))
    for epoch in (0, 1):
        a, b = first.plan_epoch(epoch), second.plan_epoch(epoch)
        assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.indices, b.indices)


def test_epochs_differ_and_seeds_differ():
    lengths = np.random.default_rng(0).integers(1, 500, 400)
    sampler = PackedBatchSampler(lengths, 1024, num_replicas=4)
    epochs = [sampler.plan_epoch(e).indices.tolist() for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    other = PackedBatchSampler(lengths, 1024, num_replicas=4, seed=1)
    assert other.plan_epoch(0).indices.tolist() != epochs[0]


def test_the_same_batches_in_another_process():
    """Same seed and epoch, another interpreter (another hash seed): the same batches."""
    code = (
        "import json, numpy as np; from neva_pack.training import PackedBatchSampler;"
        "s = PackedBatchSampler(np.arange(1, 300) % 97 + 1, 256, num_replicas=3, rank=2, seed=5); s.set_epoch(7);"
        "print(json.dumps(list(s)))"
    )
    here = PackedBatchSampler(np.arange(1, 300) % 97 + 1, 256, num_replicas=3, rank=2, seed=5)
    here.set_epoch(7)
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(there.stdout) == list(here)


@given(setups(), st.integers(0, 2), st.data())
def test_a_resumed_sampler_continues_mid_epoch_where_the_saved_one_was(setup, epoch, data):
    sampler = PackedBatchSampler(capacity=CAPACITY, **setup)
    sampler.set_epoch(epoch)
    whole = list(sampler)
    sampler = PackedBatchSampler(capacity=CAPACITY, **setup)
    sampler.set_epoch(epoch)
    done = data.draw(st.integers(0, len(whole)))
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(done)]
    state = sampler.state_dict()
    resumed = PackedBatchSampler(capacity=CAPACITY, **setup)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint stores it as JSON
    resumed.set_epoch(epoch)  # what a trainer calls before iterating: keeps the resumed step
    assert head + list(resumed) == whole
    assert list(resumed) == whole  # iterated again without set_epoch: the epoch repeats
    resumed.set_epoch(epoch + 1)
    assert len(list(resumed)) == len(resumed)  # the next epoch starts at its first step


def test_a_state_from_other_settings_is_refused():
    state = PackedBatchSampler([3, 4, 5], 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1, this sampler has 2"):
        PackedBatchSampler([3, 4, 5], 8, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        PackedBatchSampler([3, 4, 5, 6], 8, seed=1).load_state_dict(state)


def test_bad_settings_fail_at_construction_with_one_line():
    with pytest.raises(ValueError, match="rank must be in"):
        PackedBatchSampler([1, 2], 8, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="longer than the capacity 8"):
        PackedBatchSampler([1, 9], 8)
    with pytest.raises(ValueError, match="use drop_last=True"):
        PackedBatchSampler([8, 8, 8], 8, num_replicas=2)  # 3 full bins for 2 ranks and no sample to spare
    with pytest.raises(ValueError, match="num_images has 1 entries for 2 lengths"):
        PackedBatchSampler([1, 2], 8, num_images=[1])


def test_without_drop_last_bins_are_taken_apart_into_a_whole_step_of_lighter_bins():
    """First fit decreasing makes 6 bins (four of one sample, 4 + 4, 2 + 2 + 2 + 2) for 4 ranks: the
    two bins of most samples are dealt to 4 bins of 4 (one whole step), every sample is trained;
    drop_last drops two bins instead (all are full: two of a single sample)."""
    lengths = [8, 4, 4, 8, 8, 2, 2, 2, 2, 8]
    plan = PackedBatchSampler(lengths, 8, num_replicas=4, algorithm="first_fit_decreasing").plan_epoch(0)
    assert plan.num_steps == 2 and len(plan.dropped) == 0 and sorted(plan.indices.tolist()) == list(range(10))
    steps = sorted(sorted(plan.loads[s * 4 : s * 4 + 4].tolist()) for s in range(2))
    assert steps == [[4, 4, 4, 4], [8, 8, 8, 8]]  # no step mixes full and light bins
    dropping = PackedBatchSampler(lengths, 8, num_replicas=4, drop_last=True, algorithm="first_fit_decreasing")
    assert dropping.plan_epoch(0).num_steps == 1 and len(dropping.dropped) == 2


def test_every_sample_is_dealt_while_there_are_enough_samples():
    """Bins of 3, 3, 1, 1, 1 samples for 4 ranks: 3 more bins are needed and no single bin holds
    4 samples, so all five are dealt to 8 bins."""
    lengths = [1, 1, 1, 1, 1, 1, 3, 3, 3]
    plan = PackedBatchSampler(lengths, 3, num_replicas=4, algorithm="first_fit_decreasing").plan_epoch(0)
    assert plan.num_steps == 2 and sorted(plan.indices.tolist()) == list(range(9))
    assert all(load <= 3 for load in plan.loads.tolist())


@given(setups())
def test_rank_none_yields_every_rank_step_by_step_as_a_round_robin_dealer_expects(setup):
    batches, _ = every_rank(setup)
    everyone = PackedBatchSampler(capacity=CAPACITY, rank=None, **setup)
    replicas = setup["num_replicas"]
    dealt = list(everyone)
    assert len(dealt) == len(everyone) == replicas * len(batches[0])
    assert [dealt[r::replicas] for r in range(replicas)] == batches


def test_a_sample_dealt_to_new_bins_goes_to_the_lightest_bin_with_an_image_to_spare():
    """First fit decreasing under 2 images a bin: [4 3 1] (2 images) and [1 1] (2 images), two bins
    for 3 ranks, so both are dealt to 3 longest first. The last 1 (an image) would go to the lightest
    bin, [1 1], a third image: it goes to [3] instead. Without the budget plain LPT puts it there."""
    lengths, images = [1, 1, 4, 3, 1], [1, 1, 0, 1, 1]
    options = {"num_replicas": 3, "algorithm": "first_fit_decreasing", "num_images": images}
    plan = PackedBatchSampler(lengths, 8, max_images_per_pack=2, **options).plan_epoch(0)
    assert sorted(plan.batch(0, r) for r in range(3)) == [[0, 1], [2], [3, 4]]
    plain = PackedBatchSampler(lengths, 8, **options).plan_epoch(0)
    assert sorted(plain.batch(0, r) for r in range(3)) == [[0, 1, 4], [2], [3]]


def test_the_budgets_are_settings_of_the_state():
    options = {"num_images": [1, 2, 0], "image_tokens": [10, 20, 0]}
    state = PackedBatchSampler([3, 4, 5], 8, max_images_per_pack=2, **options).state_dict()
    assert state["max_images_per_pack"] == 2 and state["max_image_tokens_per_pack"] is None
    with pytest.raises(ValueError, match="max_images_per_pack=2, this sampler has 3"):
        PackedBatchSampler([3, 4, 5], 8, max_images_per_pack=3, **options).load_state_dict(state)
    with pytest.raises(ValueError, match="max_image_tokens_per_pack=None, this sampler has 30"):
        PackedBatchSampler([3, 4, 5], 8, max_images_per_pack=2, max_image_tokens_per_pack=30, **options).load_state_dict(state)


def test_a_budget_without_its_counts_or_below_one_sample_fails_at_construction():
    with pytest.raises(ValueError, match="max_images_per_pack needs the images"):
        PackedBatchSampler([1, 2], 8, max_images_per_pack=2)
    with pytest.raises(ValueError, match="max_image_tokens_per_pack needs the image_tokens"):
        PackedBatchSampler([1, 2], 8, num_images=[1, 1], max_image_tokens_per_pack=100)
    with pytest.raises(ValueError, match="no pack can hold them"):
        PackedBatchSampler([1, 2], 8, num_images=[1, 3], max_images_per_pack=2)


IMAGE_POSITIONS = 49  # openai/clip-vit-base-patch32: 7 x 7 patches


@pytest.fixture(scope="module")
def budgeted_samples(tmp_path_factory):
    """The sample data packed under 2 images and one image's positions a pack (compact)."""
    from neva_pack.cli import main
    from neva_pack.reading import PackedSamples, PackedSeqDataset
    from tests.conftest import SAMPLE_DATA

    out = tmp_path_factory.mktemp("budgets") / "out"
    assert main([
        "preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
        "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
        "--output_dir", str(out), "--conv_template", "v1", "--num_workers", "0", "--output_format", "compact",
        "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--max_seq_length", "1024",
        "--max_images_per_pack", "2", "--max_image_tokens_per_pack", str(IMAGE_POSITIONS),
    ]) == 0  # fmt: skip
    return PackedSamples(PackedSeqDataset(out))


def test_for_samples_keeps_the_budgets_the_output_was_packed_under(budgeted_samples):
    samples = budgeted_samples
    assert np.array_equal(samples.image_tokens, samples.num_images * IMAGE_POSITIONS)
    sampler = PackedBatchSampler.for_samples(samples, 4096, num_replicas=2, rank=None, seed=1)
    assert (sampler.max_images_per_pack, sampler.max_image_tokens_per_pack) == (2, IMAGE_POSITIONS)
    assert np.array_equal(sampler.vision_cost, samples.num_images * IMAGE_POSITIONS**2)  # balanced with attention
    batches = list(sampler)
    assert max(samples.image_tokens[b].sum() for b in batches) == IMAGE_POSITIONS  # one image a batch
    assert sorted(i for b in batches for i in b) == list(range(len(samples)))
    assert all(samples.lengths[b].sum() <= 4096 for b in batches)
    lifted = list(PackedBatchSampler.for_samples(samples, 4096, seed=1, max_image_tokens_per_pack=None))
    assert max(samples.num_images[b].sum() for b in lifted) == 2  # the meta's image budget still holds
    free = list(PackedBatchSampler.for_samples(samples, 4096, seed=1, max_images_per_pack=None, max_image_tokens_per_pack=None))
    assert max(samples.num_images[b].sum() for b in free) > 2


def test_for_samples_refuses_a_token_budget_over_an_output_without_image_tokens(budgeted_samples):
    """An output written before the plan kept image tokens reads them as None."""
    import copy

    older = copy.copy(budgeted_samples)
    older.image_tokens = None
    with pytest.raises(ValueError, match="max_image_tokens_per_pack=49 needs the image tokens of every sample"):
        PackedBatchSampler.for_samples(older, 4096)
    sampler = PackedBatchSampler.for_samples(older, 4096, max_image_tokens_per_pack=None)
    assert max(older.num_images[b].sum() for b in sampler) <= 2


def test_for_samples_refuses_a_video_token_budget_it_cannot_hold(budgeted_samples):
    """Outputs keep no per-sample video tokens: the sampler names the budget rather than drop it."""
    with pytest.raises(ValueError, match="max_video_tokens_per_pack=64: an output does not keep the video tokens"):
        PackedBatchSampler.for_samples(budgeted_samples, 4096, max_video_tokens_per_pack=64)
    sampler = PackedBatchSampler.for_samples(budgeted_samples, 4096, max_video_tokens_per_pack=None)
    assert sampler.max_images_per_pack == 2  # the meta has no video budget: FROM_META is none
    assert PackedBatchSampler.for_samples(budgeted_samples, 4096).max_images_per_pack == 2
    import copy
    import dataclasses

    video = copy.copy(budgeted_samples)  # an output packed under a video budget: its meta's, refused by default
    video.meta = video.meta.replace(packing=dataclasses.replace(video.meta.packing, max_video_tokens_per_pack=64))
    with pytest.raises(ValueError, match="max_video_tokens_per_pack=64"):
        PackedBatchSampler.for_samples(video, 4096)


@pytest.mark.parametrize("lengths", [[1.5, 2, 3, 4], ["3", "4", "5", "6"], [True] * 4, np.array([1, np.nan, 3, 4]), [[3, 4], [5, 6]]])
def test_lengths_that_are_not_integers_are_refused_naming_what_they_are(lengths):
    """1.5 was truncated to 1, "3" and True read as numbers, NaN became -2**63 ("sample 1 has length
    -9223372036854775808"), and a 2-D array was refused as a num_images mismatch."""
    with pytest.raises(ValueError, match=r"^lengths must be a 1-D sequence of integers, got \S+ of shape \(\d+,( \d+)?\)$"):
        PackedBatchSampler(lengths, 16)
