"""PackedBatchSampler states carry a fingerprint of what their epochs were planned over, and a state that is
not this sampler's, or that is out of range, is refused in one line naming the field
(neva_pack/training/sampler_state.py). Property tests over random edits of saved states, by class:
a fingerprint field changed, a key dropped or added, an epoch or step out of range or of the wrong type."""

import importlib.resources
import json

import numpy as np
import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from neva_pack.training import PackedBatchSampler

CAPACITY = 16


@st.composite
def samplers(draw):
    lengths = draw(st.lists(st.integers(1, CAPACITY), min_size=4, max_size=40))
    replicas = draw(st.integers(1, 3))
    rank = draw(st.sampled_from([0, None]))
    try:
        return PackedBatchSampler(lengths, CAPACITY, num_replicas=replicas, rank=rank, seed=draw(st.integers(0, 5)),
                                  drop_last=draw(st.booleans()))  # fmt: skip
    except ValueError:  # fewer samples than ranks x steps: refused at construction (tested elsewhere)
        reject()


def saved(sampler, data) -> dict:
    """A state saved part way through a random epoch, stored as a checkpoint stores it (JSON)."""
    sampler.set_epoch(data.draw(st.integers(0, 3), label="epoch"))
    iterator = iter(sampler)
    for _ in range(data.draw(st.integers(0, len(sampler)), label="steps")):
        next(iterator)
    return json.loads(json.dumps(sampler.state_dict()))


def refused(state: dict, field: str, fresh: PackedBatchSampler) -> str:
    with pytest.raises(ValueError) as caught:
        fresh.load_state_dict(state)
    message = str(caught.value)
    assert "\n" not in message and (field in message or repr(field) in message), message
    return message


def twin(sampler: PackedBatchSampler) -> PackedBatchSampler:
    """A sampler made as ``sampler`` was (what a resumed job builds)."""
    return PackedBatchSampler(sampler.lengths, sampler.capacity, num_replicas=sampler.num_replicas, rank=sampler.rank,
                              seed=sampler.seed, drop_last=sampler.drop_last)  # fmt: skip


OTHER_VALUES = st.one_of(st.integers(-5, 10**6), st.text(max_size=5), st.none(), st.booleans(), st.floats(allow_nan=False),
                         st.lists(st.integers(), max_size=2))  # fmt: skip


@settings(max_examples=150)
@given(samplers(), st.data())
def test_a_state_with_any_fingerprint_field_changed_is_refused_naming_it(sampler, data):
    state = saved(sampler, data)
    fields = sorted(set(state) - {"version", "epoch", "step"})
    field = data.draw(st.sampled_from(fields), label="field")
    value = data.draw(OTHER_VALUES, label="value")
    if value == state[field] and type(value) is type(state[field]):
        value = [value]  # never the same value
    refused({**state, field: value}, field, twin(sampler))


@settings(max_examples=100)
@given(samplers(), st.data())
def test_a_state_missing_a_key_or_with_an_unknown_one_is_refused_naming_it(sampler, data):
    state = saved(sampler, data)
    field = data.draw(st.sampled_from(sorted(set(state) - {"version"})), label="dropped")
    refused({name: value for name, value in state.items() if name != field}, field, twin(sampler))
    extra = data.draw(st.text(min_size=1, max_size=8).filter(lambda name: name not in state), label="extra")
    refused({**state, extra: 1}, extra, twin(sampler))


@settings(max_examples=100)
@given(samplers(), st.data())
def test_an_epoch_or_step_out_of_range_or_not_an_integer_is_refused_naming_it(sampler, data):
    state = saved(sampler, data)
    fresh = twin(sampler)
    batches = len(fresh.plan_epoch(state["epoch"]).offsets) - 1 if sampler.rank is None else fresh.plan_epoch(state["epoch"]).num_steps
    field = data.draw(st.sampled_from(["epoch", "step"]), label="field")
    bad = st.one_of(st.integers(max_value=-1), st.floats(allow_nan=False), st.text(max_size=3), st.none(), st.booleans())
    if field == "step":
        bad = st.one_of(bad, st.integers(batches + 1, batches + 10**6))
    refused({**state, field: data.draw(bad, label="value")}, field, fresh)


@settings(max_examples=60)
@given(samplers(), st.data())
def test_a_state_loaded_back_unedited_resumes_where_it_was(sampler, data):
    state = saved(sampler, data)
    fresh = twin(sampler)
    fresh.load_state_dict(state)
    assert (fresh.epoch, fresh.state_dict()["step"]) == (state["epoch"], state["step"])


def test_a_state_over_another_packing_of_as_many_records_is_refused():
    """Same count and total length (the fields a version 1 state compared), other samples."""
    lengths = [3, 4, 5, 9, 2, 7]
    state = PackedBatchSampler(lengths, CAPACITY).state_dict()
    message = refused(state, "lengths_digest", PackedBatchSampler(lengths[::-1], CAPACITY))
    assert "planned over other samples" in message


def test_a_state_with_a_tampered_step_is_refused():
    sampler = PackedBatchSampler([3, 4, 5, 9, 2, 7, 8, 8], CAPACITY)
    state = sampler.state_dict()
    refused({**state, "step": -3}, "step", PackedBatchSampler([3, 4, 5, 9, 2, 7, 8, 8], CAPACITY))
    refused({**state, "step": len(sampler) + 3}, "step", PackedBatchSampler([3, 4, 5, 9, 2, 7, 8, 8], CAPACITY))


def test_a_state_saved_before_the_fingerprint_is_refused_saying_so_and_how_to_resume_it_knowingly():
    lengths = [3, 4, 5, 9, 2, 7]
    old = {"version": 1, "epoch": 1, "step": 2, "seed": 0, "capacity": CAPACITY, "num_replicas": 1, "algorithm": "first_fit_shuffle",
           "drop_last": False, "num_samples": 6, "total_length": 30, "max_images_per_pack": None,
           "max_image_tokens_per_pack": None, "vision_cost": None}  # fmt: skip
    sampler = PackedBatchSampler(lengths, CAPACITY)
    message = refused(old, "predates the fingerprint", sampler)
    assert "load_state_dict" in message
    sampler.load_state_dict({**sampler.state_dict(), "epoch": old["epoch"], "step": old["step"]})  # the way it names
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["step"] == 2


def test_the_meta_checksum_of_the_output_is_part_of_the_fingerprint(tmp_path):
    """Samplers over two outputs whose samples have the same figures differ by the outputs' metas."""
    from neva_pack.reading import PackedSamples, PackedSeqDataset
    from tests.formats.test_formats import write_tiny

    write_tiny(tmp_path / "a", "compact")
    samples = PackedSamples(PackedSeqDataset(tmp_path / "a"))
    state = PackedBatchSampler.for_samples(samples, CAPACITY).state_dict()
    assert state["meta_checksum"] == json.loads((tmp_path / "a" / "packed_seq_dataset.meta.json").read_text())["meta_checksum"]
    other = PackedBatchSampler(samples.lengths, CAPACITY, num_images=samples.num_images, image_tokens=samples.image_tokens,
                               vision_cost=samples.vision_cost, meta_checksum="0" * 32)  # fmt: skip
    refused(state, "meta_checksum", other)
    np.testing.assert_array_equal(other.lengths, samples.lengths)


def test_the_step_cost_model_is_part_of_the_fingerprint(tmp_path):
    """A state planned by one step cost model is refused by a sampler balancing by another (its steps
    are other bins), whether the model is a preset, a file of other numbers or the attention order."""
    from neva_pack.packing import step_cost_model

    lengths = [3, 4, 5, 9, 2, 7, 8, 8, 1, 6]
    state = PackedBatchSampler(lengths, CAPACITY, num_replicas=2, step_cost_model="llava-1.5-7b").state_dict()
    assert state["step_cost_model"] == step_cost_model("llava-1.5-7b").fingerprint
    PackedBatchSampler(lengths, CAPACITY, num_replicas=2).load_state_dict(state)  # auto, no encoder: the default preset
    for other in ("internvl3.5-8b", "attention"):
        refused(state, "step_cost_model", PackedBatchSampler(lengths, CAPACITY, num_replicas=2, step_cost_model=other))
    shipped = importlib.resources.files("neva_pack.packing") / "step_cost_presets.json"
    preset = json.loads(shipped.read_text())["presets"]["llava-1.5-7b"]
    trained = {**preset, "vision": {**preset["vision"], "trained": True}}
    (tmp_path / "trained.json").write_text(json.dumps(trained))
    refused(state, "step_cost_model", PackedBatchSampler(lengths, CAPACITY, num_replicas=2, step_cost_model=str(tmp_path / "trained.json")))
