"""The step cost model: one rank's step in FLOPs from the model's shape, its presets, and the order it balances.

A pack's modelled step time is the sum over its samples of m_lm (2 P s + 4 d pairs) + 3 (2 P_proj t)
+ m_vis (2 P_vis p + 4 d_vis c): linear layers, causal attention (s²/2 pairs a full layer), the
projector and the vision encoder (packing/step_cost.py).
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.bench_balance import MIXES, mix_costs
from neva_pack.packing import (
    ATTENTION, PackCosts, balance_order, modelled_costs, preset_names, step_cost_model, step_overheads, straggler_overhead
)  # fmt: skip

TINY = {
    "lm": {"hidden_size": 2, "layers": 2, "heads": 1, "kv_heads": 1, "head_dim": 2, "intermediate_size": 3,
           "gated_mlp": True, "vocab_size": 5, "trained": True},
    "vision": {"hidden_size": 2, "layers": 1, "heads": 1, "kv_heads": 1, "head_dim": 2, "intermediate_size": 2,
               "gated_mlp": False, "trained": False},
    "patches_per_image_token": 4,
    "projector_params": 1,
}  # fmt: skip


def written(tmp_path, entry, name="model.json"):
    path = tmp_path / name
    path.write_text(json.dumps(entry))
    return str(path)


def test_golden_flops_of_a_hand_computed_model(tmp_path):
    """By hand: LM params per layer q,o 2*2*1*2 + k,v 2*2*1*2 + gated MLP 3*2*3 = 34, two layers and a
    head of 5 x 2: P = 78, d = 2. Vision: 8 + 8 + 2*2*2 = 24, d = 2. A sample of 4 positions, 2 of them
    image tokens (8 patches, one pass: c = 64), then a text sample of 3:
      LM linear 3*2*78*4 = 1872, attention 3*4*(2 layers * 2 * 16/2) = 384, projector 3*2*1*2 = 12,
      vision (frozen: x1) 2*24*8 + 4*2*64 = 896                       -> 3164
      LM linear 3*2*78*3 = 1404, attention 3*4*(2 * 2 * 9/2) = 216      -> 1620
    """
    model = step_cost_model(written(tmp_path, TINY))
    assert model.lm.params == 78 and model.vision.params == 24
    parts = model.components([4, 3], [2, 0], [64, 0])
    assert {k: v.tolist() for k, v in parts.items()} == {
        "lm_linear": [1872.0, 1404.0], "lm_attention": [384.0, 216.0], "projector": [12.0, 0.0], "vision": [896.0, 0.0],
    }  # fmt: skip
    costs = modelled_costs(model, np.array([4, 3]), np.array([0, 2]), np.array([1, 0]), np.array([2, 0]), np.array([64, 0]))
    assert costs.modelled.tolist() == [4784.0]
    assert model.shares([4, 3], [2, 0], [64, 0])["vision"] == pytest.approx(896 / 4784)


def test_golden_sliding_window_and_a_frozen_lm(tmp_path):
    """One of the two LM layers slides a window of 2 with head dim 1: its params 2*2*1*1 * 2 + 18 = 26,
    P = 34 + 26 + 10 = 70; a sample of 4 has 2*4 - 2²/2 = 6 window pairs and 16/2 = 8 full ones:
    attention 4*(2*8 + 1*6) = 88. Frozen, the LM costs twice its forward (gradients still pass it)."""
    lm = {**TINY["lm"], "window_layers": 1, "window": 2, "window_head_dim": 1}
    model = step_cost_model(written(tmp_path, {**TINY, "lm": lm}))
    assert model.lm.params == 70
    parts = model.components([4])
    assert (parts["lm_linear"][0], parts["lm_attention"][0]) == (3 * 2 * 70 * 4, 3 * 88)
    frozen = step_cost_model(written(tmp_path, {**TINY, "lm": {**lm, "trained": False}}, "frozen.json"))
    assert frozen.sample_flops([4])[0] == 2 * (2 * 70 * 4 + 88)


def test_every_preset_is_a_model_with_its_source():
    names = preset_names()
    assert {"llava-1.5-7b", "qwen2.5-vl-7b", "qwen3-vl-8b", "gemma-4-e4b", "internvl3.5-8b"} <= set(names)
    for name in names:
        model = step_cost_model(name)
        assert model.name == name and model.lm.params > 10**9 and model.vision is not None
    # the derived LM weights match the published sizes (non-embedding weights plus the head)
    assert step_cost_model("llava-1.5-7b").lm.params == pytest.approx(6.61e9, rel=0.01)
    assert step_cost_model("qwen2.5-vl-7b").lm.params == pytest.approx(7.07e9, rel=0.01)
    # Gemma 4's large checkpoints: 31B dense (its full layers' fewer kv heads counted as the sliding ones'), 26B-A4B
    # as the ~3.8B weights one position meets (shared expert + top 8 of 128)
    assert step_cost_model("gemma-4-31b").lm.params == pytest.approx(30.7e9, rel=0.03)
    assert step_cost_model("gemma-4-26b-a4b").lm.params == pytest.approx(3.8e9, rel=0.03)


@pytest.mark.parametrize("encoder, preset", [("google/gemma-4-31B-it", "gemma-4-31b"), ("google/gemma-4-26B-A4B-it", "gemma-4-26b-a4b"),
                                             ("google/gemma-4-E2B-it", "gemma-4-e4b")])  # fmt: skip
def test_auto_takes_each_gemma_checkpoints_own_preset_before_its_familys(encoder, preset):
    assert step_cost_model("auto", encoder, "gemma4").name == preset


def test_the_presets_ship_as_package_data():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "step_cost_presets.json" in pyproject["tool"]["setuptools"]["package-data"]["neva_pack.packing"]


def test_auto_picks_the_preset_of_the_encoder_then_of_the_family_then_the_default():
    assert step_cost_model("auto", encoder="Qwen/Qwen2.5-VL-7B-Instruct").name == "qwen2.5-vl-7b"
    assert step_cost_model("auto", encoder="/checkpoints/qwen3-vl-8b-instruct/").name == "qwen3-vl-8b"
    assert step_cost_model("auto", encoder="/my/own/ckpt", family="internvl").name == "internvl3.5-8b"
    assert step_cost_model(None).name == step_cost_model("auto", encoder="unknown", family="unknown").name == "llava-1.5-7b"
    assert step_cost_model(ATTENTION) is None


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.pop("projector_params"), "missing key 'projector_params'"),
    (lambda e: e.update(extra=1), "unknown key 'extra'"),
    (lambda e: e["lm"].update(layers=-2), "lm.layers -2: expected a positive integer"),
    (lambda e: e["lm"].update(trained="yes"), "lm.trained 'yes': expected true or false"),
    (lambda e: e["vision"].update(window_layers=1), "vision.window_layers 1: needs a window"),
])  # fmt: skip
def test_a_bad_model_file_is_refused_in_one_line_naming_the_key(tmp_path, change, message):
    entry = json.loads(json.dumps(TINY))
    change(entry)
    with pytest.raises(ValueError, match=message) as raised:
        step_cost_model(written(tmp_path, entry))
    assert "\n" not in str(raised.value)


def test_an_unknown_name_or_file_is_refused_listing_the_choices(tmp_path):
    with pytest.raises(ValueError, match="choose one of auto, attention, gemma-4-26b-a4b, gemma-4-31b, gemma-4-e4b"):
        step_cost_model("llava-7b")
    with pytest.raises(ValueError, match="no such regular file"):
        step_cost_model(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        step_cost_model(str(tmp_path / "bad.json"))


packs = st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 3)), min_size=0, max_size=200)


def costs_of(samples, per_pack: int):
    """Samples (length, images) laid into packs of ``per_pack`` in turn, at 256 tokens an image."""
    lengths = np.array([length for length, _ in samples], dtype=np.int64)
    images = np.array([count for _, count in samples], dtype=np.int64)
    offsets = np.unique(np.append(np.arange(0, len(lengths), per_pack), len(lengths)))
    model = step_cost_model("qwen2.5-vl-7b")
    return modelled_costs(model, lengths, offsets, images, images * 256, images * (256 * 4) ** 2)


@settings(max_examples=50)
@given(packs, st.integers(1, 4), st.integers(1, 16), st.integers(0, 2**32 - 1))
def test_the_modelled_order_is_a_permutation_and_the_same_for_the_same_seed(samples, per_pack, group, seed):
    costs = costs_of(samples, per_pack)
    _, order = step_overheads(costs, group, seed)
    assert sorted(order.tolist()) == list(range(len(costs.tokens)))
    assert np.array_equal(order, step_overheads(costs, group, seed)[1])


@settings(max_examples=60)
@given(st.integers(1, 12), st.integers(1, 25), st.integers(0, 2**32 - 1), st.data())
def test_the_modelled_order_has_the_least_modelled_overhead_of_any_order(group, steps, seed, data):
    """Whole steps only (N divides the packs): no order, today's included, wastes less modelled time."""
    samples = data.draw(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 3)), min_size=group * steps, max_size=group * steps))
    costs = costs_of(samples, 1)
    overheads, order = step_overheads(costs, group, seed)
    other = np.asarray(data.draw(st.permutations(range(len(samples)))))
    assert overheads.modelled <= straggler_overhead(costs.modelled, group, other) + 1e-12
    assert overheads.modelled <= overheads.today + 1e-12
    assert overheads.modelled == straggler_overhead(costs.modelled, group, order)


@pytest.mark.parametrize("name", sorted(MIXES))
@pytest.mark.parametrize("capacity", [4096, 16384, 65536])
def test_never_worse_than_the_attention_order_on_the_benchmark_mixes(name, capacity):
    """benchmarks/bench_balance.py's mixes (a twentieth of LLaVA-665K, 20,000 native-resolution samples)."""
    costs, _, _ = mix_costs(name, capacity, scale=0.05, native_samples=20_000)
    for ranks in (8, 64):
        overheads, _ = step_overheads(costs, ranks)
        assert overheads.modelled <= overheads.today + 1e-12
        assert overheads.modelled <= overheads.random


def test_without_a_model_the_order_is_the_one_of_old():
    """PackCosts without ``modelled`` balance attention + vision, as before the model."""
    costs = PackCosts(attention=np.array([9, 1, 4, 16]), tokens=np.ones(4, np.int64), images=np.zeros(4, np.int64))
    order = balance_order(costs, 2, np.random.default_rng(0), 0.0)
    assert sorted(sorted(costs.attention[order[k : k + 2]].tolist()) for k in (0, 2)) == [[1, 4], [9, 16]]
