"""Runs that no record could make a sample of are refused up front, before any record is encoded, in
one line (pipeline/doomed.py states the conditions); a run that some record can make a sample of goes
on, whatever the rest. Both sides of each condition. The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import pytest

from neva_pack.files import skipped_path
from tests.hostile_inputs import GOOD, conversation, images, run_on, write_data  # noqa: F401 (images: the fixture)

IMAGE_FIRST = {"id": "img", "image": "chelsea.jpg", "conversations": conversation("<image>\nWhat is this?", "A cat.")}
TEXT = GOOD[0]
ANSWER_FIRST = {"id": "late", "image": "chelsea.jpg",
                "conversations": conversation("Hi", "Hello.") + conversation("<image>\nAnd this?", "A cat.")}  # fmt: skip
CLIP = ("--hf_vision_encoder", "openai/clip-vit-large-patch14-336")  # 576 positions an image


def refused(run) -> bool:
    return run.code == 2 and run.err.count("\n") == 1 and run.err.startswith("neva-pack: error: ") and not skipped_path(run.out).exists()


def test_a_sequence_shorter_than_any_image_run_with_every_record_image_first_is_refused_before_encoding(tmp_path, capsys, images):
    data = write_data(tmp_path / "data.jsonl", [IMAGE_FIRST] * 3, "jsonl")
    run = run_on(tmp_path, capsys, data, images, *CLIP, "--max_seq_length", "512")
    assert refused(run), run.err
    assert "--max_seq_length 512: shorter than the smallest image run of openai/clip-vit-large-patch14-336 (576 positions)" in run.err
    assert "every record of" in run.err and "has an image before its first answer" in run.err


@pytest.mark.parametrize("other", ["a text-only record", "a record answered before its image"])
def test_one_record_that_can_be_trained_lets_the_run_go_on(tmp_path, capsys, images, other):
    record = TEXT if other == "a text-only record" else ANSWER_FIRST
    data = write_data(tmp_path / "data.jsonl", [IMAGE_FIRST, record, IMAGE_FIRST], "jsonl")
    run = run_on(tmp_path, capsys, data, images, *CLIP, "--max_seq_length", "512", "--max_skip_fraction", "1")
    assert run.code == 0, run.err
    assert run.reasons == {0: "no_supervised_tokens", 2: "no_supervised_tokens"}  # record 1 packed (its image cut away)
    assert run.verified


def test_a_sequence_that_holds_the_image_run_is_not_refused(tmp_path, capsys, images):
    data = write_data(tmp_path / "data.jsonl", [IMAGE_FIRST] * 3, "jsonl")
    run = run_on(tmp_path, capsys, data, images, *CLIP, "--max_seq_length", "700")
    assert run.code == 0 and run.reasons == {}, run.err


def test_without_truncation_every_record_with_an_image_is_too_long_and_refused(tmp_path, capsys, images):
    data = write_data(tmp_path / "data.jsonl", [ANSWER_FIRST, IMAGE_FIRST], "jsonl")
    run = run_on(tmp_path, capsys, data, images, *CLIP, "--max_seq_length", "512", "--no_truncate")
    assert refused(run), run.err
    assert "has an image: each would be too long (--no_truncate)" in run.err
    data = write_data(tmp_path / "data.jsonl", [ANSWER_FIRST, TEXT], "jsonl")  # the other side: a text record
    run = run_on(tmp_path, capsys, data, images, *CLIP, "--max_seq_length", "512", "--no_truncate", "--max_skip_fraction", "1")
    assert run.code == 0 and run.reasons == {0: "too_long"}, run.err


def test_a_text_only_format_over_records_that_all_have_images_is_refused_before_encoding(tmp_path, capsys, images):
    data = write_data(tmp_path / "data.jsonl", [IMAGE_FIRST, ANSWER_FIRST, IMAGE_FIRST], "jsonl")
    run = run_on(tmp_path, capsys, data, images, "--output_format", "bridge")
    assert refused(run), run.err
    assert "has images, which --output_format bridge cannot hold (text only): use --output_format" in run.err
    data = write_data(tmp_path / "data.jsonl", [IMAGE_FIRST, TEXT, TEXT], "jsonl")  # the other side
    run = run_on(tmp_path, capsys, data, images, "--output_format", "bridge")
    assert run.code == 0 and run.reasons == {0: "images_not_held"}, run.err
