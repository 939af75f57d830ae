"""balance_order: every N consecutive packs cost alike, the epoch is not sorted, same seed same order.

Straggler overhead = sum over steps of (max - mean) / sum of mean, N packs per step.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.cli import main
from neva_pack.packing import PackCosts, balance_order, pack, reorder_plan, straggler_overhead
from neva_pack.files import packed_prefix, plan_path, stats_path
from tests.conftest import SAMPLE_DATA


def costs_of(attention, tokens=None, images=None):
    attention = np.asarray(attention, dtype=np.int64)
    zeros = np.zeros_like(attention)
    return PackCosts(
        attention=attention,
        tokens=zeros if tokens is None else np.asarray(tokens, dtype=np.int64),
        images=zeros if images is None else np.asarray(images, dtype=np.int64),
    )


packs_strategy = st.lists(st.tuples(st.integers(1, 10**7), st.integers(1, 4096), st.integers(0, 6)), min_size=0, max_size=300)


@given(packs_strategy, st.integers(1, 16), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.01, 0.2]))
def test_balance_order_is_a_permutation_and_the_same_for_the_same_seed(packs, group, seed, tolerance):
    costs = costs_of(*zip(*packs)) if packs else costs_of([])
    order = balance_order(costs, group, np.random.default_rng(seed), tolerance)
    assert sorted(order.tolist()) == list(range(len(packs)))
    again = balance_order(costs, group, np.random.default_rng(seed), tolerance)
    assert np.array_equal(order, again)


@settings(max_examples=200)
@given(st.integers(1, 12), st.integers(1, 30), st.integers(0, 2**32 - 1), st.data())
def test_attention_alone_gives_the_least_overhead_of_any_order(group, steps, seed, data):
    """Cutting the sorted packs into consecutive groups minimises the sum of group maxima."""
    attention = data.draw(st.lists(st.integers(1, 10**6), min_size=group * steps, max_size=group * steps))
    other = np.asarray(data.draw(st.permutations(range(len(attention)))))
    costs = costs_of(attention)
    order = balance_order(costs, group, np.random.default_rng(seed), tolerance=0.0)
    assert straggler_overhead(attention, group, order) <= straggler_overhead(attention, group, other) + 1e-12


@settings(max_examples=200)
@given(packs_strategy, st.integers(1, 12), st.integers(0, 2**32 - 1), st.sampled_from([0.001, 0.01, 0.1]))
def test_balancing_images_and_tokens_costs_at_most_the_tolerance_in_attention(packs, group, seed, tolerance):
    costs = costs_of(*zip(*packs)) if packs else costs_of([])
    best = straggler_overhead(costs.attention, group, balance_order(costs, group, np.random.default_rng(seed), 0.0))
    order = balance_order(costs, group, np.random.default_rng(seed), tolerance)
    assert straggler_overhead(costs.attention, group, order) <= best + tolerance + 1e-12


def test_the_epoch_is_not_sorted_and_groups_come_in_random_order():
    rng = np.random.default_rng(7)
    lengths = np.minimum(rng.lognormal(6.5, 0.8, 50_000).astype(np.int64) + 1, 4096)
    plan = pack(lengths, 4096, algorithm="first_fit_shuffle", seed=0)
    costs = PackCosts.of(lengths[plan.indices], plan.offsets, np.ones(len(lengths), dtype=np.int64)[plan.indices])
    group = 8
    random_order = np.random.default_rng(1).permutation(plan.num_bins)
    order = balance_order(costs, group, np.random.default_rng(0))
    before = straggler_overhead(costs.attention, group, random_order)
    after = straggler_overhead(costs.attention, group, order)
    assert before > 0.2 and after < 0.01
    position_rank = np.corrcoef(np.arange(plan.num_bins), np.argsort(np.argsort(costs.attention[order])))[0, 1]
    assert abs(position_rank) < 0.05  # no length curriculum over the epoch
    other_seed = balance_order(costs, group, np.random.default_rng(1))
    assert not np.array_equal(order, other_seed)


def test_a_short_last_group_stays_last():
    costs = costs_of([50, 10, 40, 20, 30, 5, 1])
    order = balance_order(costs, 3, np.random.default_rng(0), tolerance=0.0)
    assert sorted(order[-1:].tolist()) == [6]  # 7 packs, groups of 3: the cheapest one is the short last group
    groups = sorted(sorted(costs.attention[order[k : k + 3]].tolist()) for k in (0, 3))
    assert groups == [[5, 10, 20], [30, 40, 50]]


def test_straggler_overhead_golden():
    # steps (4, 2) and (3, 3): (4 - 3 + 0) / (3 + 3)
    assert straggler_overhead([4, 2, 3, 3], 2) == pytest.approx(1 / 6)
    assert straggler_overhead([4, 2, 3, 3, 100], 2) == pytest.approx(1 / 6)  # incomplete last step left out
    assert straggler_overhead([4, 3, 2, 3], 2, order=np.array([0, 2, 1, 3])) == pytest.approx(1 / 6)


def test_reorder_plan_moves_whole_bins():
    plan = pack(np.array([5, 3, 4, 2, 8]), 8, algorithm="first_fit_decreasing")
    moved = reorder_plan(plan, np.array([2, 0, 1]))
    assert moved.bins() == [plan.bins()[2], plan.bins()[0], plan.bins()[1]]
    assert moved.bin_loads.tolist() == [plan.bin_loads[2], plan.bin_loads[0], plan.bin_loads[1]]


def test_pipeline_reorders_the_packs_and_reports_the_overheads(tmp_path, capsys):
    common = [
        "preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
        "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
        "--conv_template", "v1", "--num_workers", "0", "--hf_vision_encoder", "openai/clip-vit-base-patch32",
        "--max_seq_length", "300",
    ]  # fmt: skip
    assert main([*common, "--output_dir", str(tmp_path / "plain")]) == 0
    assert main([*common, "--output_dir", str(tmp_path / "balanced"), "--balance_data_parallel", "2"]) == 0
    out = capsys.readouterr().out
    plain, balanced = (np.load(plan_path(packed_prefix(tmp_path / name))) for name in ("plain", "balanced"))
    bins = lambda t: sorted(tuple(t["record_index"][a:b]) for a, b in zip(t["offsets"][:-1], t["offsets"][1:]))  # noqa: E731
    assert bins(plain) == bins(balanced)  # the same packs, another order
    report = json.loads(stats_path(tmp_path / "balanced").read_text())["balance"]
    assert report["data_parallel"] == 2
    assert report["attention_overhead_after"] <= report["attention_overhead_before"]
    assert "balance        N = 2 ranks: straggler overhead" in out
    attention = np.add.reduceat(balanced["length"].astype(np.int64) ** 2, balanced["offsets"][:-1])
    assert straggler_overhead(attention, 2) == pytest.approx(report["attention_overhead_after"])
    assert json.loads(stats_path(tmp_path / "plain").read_text())["balance"] is None
    # by default the order is the modelled step time's (auto: the fixed-crop family's preset), and the
    # summary says what a random order and the attention order would have wasted
    assert (report["step_cost_model"], report["step_model"]) == ("auto", "llava-1.5-7b")
    assert report["step_overhead_after"] <= report["step_overhead_today"] + 1e-12
    assert "step time      N = 2, model llava-1.5-7b: straggler overhead random " in out
    # stats models any output over N ranks, balanced or not; a bad model is one line
    assert main(["stats", str(tmp_path / "plain"), "--data_parallel", "4", "--step_cost_model", "internvl3.5-8b"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step time"))
    assert line.startswith("step time      N = 4, model internvl3.5-8b: straggler overhead random ") and "worth it" in line
    assert main(["stats", str(tmp_path / "plain"), "--data_parallel", "4", "--step_cost_model", "nope"]) == 2
    assert "--step_cost_model 'nope': choose one of auto, attention" in capsys.readouterr().err
