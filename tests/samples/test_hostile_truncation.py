"""Truncation never cuts inside an image run (properties over any sample and capacity, and a real
run whose cut lands just after adjacent runs); a sample cut before its answer is skipped as no
supervised tokens; an id the output cannot hold is refused before any work. The harness:
tests/hostile_inputs.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.core import ImageRun
from neva_pack.packing import PackSpec, pack_problems
from neva_pack.samples import truncation
from tests.hostile_inputs import GOOD, HOSTILE_AT, TOKENIZER, adjacent_images_record, conversation, images, run_with  # noqa: F401 (images: the fixture)


RUN = 8  # image positions in the property test: start, 6 patches, end
SPEC = PackSpec(max_seq_length=10**6, ignore_index=-1, image_run=ImageRun(positions=RUN, patch_id=0, start_id=7, end_id=8))


def sample_ids(segments: list[int]) -> tuple[np.ndarray, list[int]]:
    """Text segments (lengths; text ids 10+) with an image run after each but the last, which
    has one token more (a conversation ends with its answer)."""
    segments = [*segments[:-1], segments[-1] + 1]
    ids, starts = [], []
    for position, length in enumerate(segments):
        ids += [10 + (k % 50) for k in range(length)]
        if position < len(segments) - 1:
            starts.append(len(ids))
            ids += SPEC.image_run.ids().tolist()
    return np.asarray(ids), starts


@settings(max_examples=300, deadline=None)
@given(segments=st.lists(st.integers(0, 12), min_size=1, max_size=5), capacity=st.integers(2, 60))
def test_property_truncated_samples_keep_whole_image_runs_only(segments, capacity):
    ids, starts = sample_ids(segments)
    if len(ids) < 2:
        return
    cut, kept = truncation(starts, RUN, capacity) if len(ids) > capacity + 1 else (len(ids), len(starts))
    kept_ids = ids[:cut]
    tokens, labels = kept_ids[:-1], kept_ids[1:]
    assert len(tokens) <= capacity
    if len(tokens) == 0:
        return
    spec = dataclasses.replace(SPEC, max_seq_length=capacity)
    assert pack_problems(spec, [0, len(tokens)], tokens, labels, kept) == []


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=4), min_size=1, max_size=4),
       capacity=st.integers(12, 40))  # fmt: skip
def test_property_a_pack_of_truncated_samples_has_as_many_whole_runs_as_images(samples, capacity):
    tokens, labels, lengths, images = [], [], [], 0
    for segments in samples:
        ids, starts = sample_ids(segments)
        cut, kept = truncation(starts, RUN, capacity) if len(ids) > capacity + 1 else (len(ids), len(starts))
        if cut < 2:
            continue
        tokens.append(ids[: cut - 1])
        labels.append(np.where(ids[1:cut] >= 10, ids[1:cut], -1))
        lengths.append(cut - 1)
        images += kept
    if not tokens:
        return
    spec = dataclasses.replace(SPEC, max_seq_length=capacity * len(tokens))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    assert pack_problems(spec, cu, np.concatenate(tokens), np.concatenate(labels), images) == []


def test_a_cut_run_is_an_invariant_violation():
    ids, starts = sample_ids([3, 2])
    tokens = ids[: starts[0] + RUN - 1]  # 7 of the run's 8 positions
    problems = pack_problems(SPEC, [0, len(tokens)], tokens, np.full(len(tokens), -1), 1)
    assert problems == ["1 incomplete image run(s) (first at position 3)", "1 images for 0 image runs"]


def test_a_cut_landing_just_after_adjacent_image_runs_keeps_them_whole(tmp_path, capsys, images):
    from neva_pack.config import PreprocessConfig
    from neva_pack.pipeline import build_sample_builder
    from neva_pack.records import RawRecord

    config = PreprocessConfig(data_path=TOKENIZER, tokenizer_path=TOKENIZER, output_dir=tmp_path / "unused",
                              image_folder=images, conv_template="v1")  # fmt: skip
    builder = build_sample_builder(config)
    first, second = builder.build(RawRecord(0, adjacent_images_record())).image_starts.tolist()
    run_length = builder.image_run.positions
    assert second == first + run_length  # adjacent runs
    for capacity in (first + run_length - 1, first + run_length, second + run_length - 1, second + run_length):
        (tmp_path / str(capacity)).mkdir()
        run = run_with(tmp_path / str(capacity), capsys, images, adjacent_images_record(),
                       "--max_seq_length", str(capacity), "--max_skip_fraction", "1")  # fmt: skip
        assert run.code == 0, run.err
        assert run.verified


@pytest.mark.parametrize("flag, value, says", [
    ("--image_patch_id", "16777217", "not an id of the tokenizer's vocabulary"),
    ("--pad_id", "16777217", "not an id of the tokenizer's vocabulary"),
    ("--pad_id", "999999", "not an id of the tokenizer's vocabulary"),
    ("--ignore_index", "5", "its labels would read as ignored"),
])  # fmt: skip
def test_an_id_the_output_cannot_hold_is_refused_before_any_work(tmp_path, capsys, images, flag, value, says):
    run = run_with(tmp_path, capsys, images, GOOD[0], flag, value, "--pad_to_multiple_of", "64")
    assert run.code == 2 and run.err.count("\n") == 1
    assert f"{flag} {value}: " in run.err and says in run.err
    assert not run.out.exists()


def test_a_sample_cut_before_its_answer_is_no_supervised_tokens(tmp_path, capsys, images):
    long_question = {"id": "long", "conversations": conversation("Tell me everything. " * 40, "No.")}
    run = run_with(tmp_path, capsys, images, long_question, "--max_seq_length", "100")
    # the image record cannot keep its 576 image positions either: cut before its image, nothing trained
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "no_supervised_tokens", 2: "no_supervised_tokens"}
    assert run.verified
