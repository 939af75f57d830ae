"""Record -> Sample: image placeholder expansion, truncation, skips."""

import numpy as np
import pytest

from neva_pack.records import RawRecord
from neva_pack.families import image_run_for
from neva_pack.samples import Sample, Skipped
from neva_pack.text import load_tokenizer
from tests.conftest import SAMPLE_DATA
from tests.text.test_templates import make_builder


def image_record(n_images=1, question="What is shown?"):
    return {
        "id": "img",
        "image": ["coffee.jpg", "chelsea.jpg", "rocket.jpg"][:n_images],
        "conversations": [
            {"from": "human", "value": "<image>\n" * n_images + question},
            {"from": "gpt", "value": "Photos."},
        ],
    }


def builder_with_images(tokenizer_path, template="v1", **kwargs):
    from neva_pack.families import ImageSource

    builder = make_builder(tokenizer_path, template, **kwargs)
    builder.image_source = ImageSource(SAMPLE_DATA / "images")
    return builder


def test_nemo_image_run_when_the_tokenizer_has_extra_id_4_and_5(sample_tokenizer_path):
    tokenizer = load_tokenizer(sample_tokenizer_path)
    start, end = tokenizer.token_to_id("<extra_id_4>"), tokenizer.token_to_id("<extra_id_5>")
    image_run = image_run_for(tokenizer, 576)
    run = image_run.ids()
    assert len(run) == 576 and run[0] == start and run[-1] == end and set(run[1:-1]) == {0}
    with_start_end = image_run_for(tokenizer, 576, use_im_start_end=True)
    assert len(with_start_end.ids()) == 578


def test_plain_patch_ids_when_the_tokenizer_lacks_them(mistral_tokenizer_path):
    image_run = image_run_for(load_tokenizer(mistral_tokenizer_path), 576)
    assert image_run.start_id is None and np.array_equal(image_run.ids(), np.zeros(576))
    custom = image_run_for(load_tokenizer(mistral_tokenizer_path), 576, patch_id=7, start_id=5, end_id=6)
    assert list(custom.ids()[:2]) == [5, 7] and custom.ids()[-1] == 6 and len(custom.ids()) == 576


def test_image_sample_length_counts_image_positions(sample_tokenizer_path):
    builder = builder_with_images(sample_tokenizer_path)
    sample = builder.build(RawRecord(0, image_record(2)))
    assert isinstance(sample, Sample)
    assert sample.images.shape == (2, 3, 336, 336) and sample.images.dtype == np.uint8
    starts = np.flatnonzero(sample.tokens == builder.image_run.start_id)
    assert len(starts) == 2 and sample.length > 2 * 576
    assert np.all(sample.labels[: starts[-1] + 576] == -1)  # nothing of the prompt or images is trained


def two_turn_record():
    """The first answer is trained whatever happens to the images of the second turn."""
    return {
        "id": "img",
        "image": ["coffee.jpg", "chelsea.jpg", "rocket.jpg"],
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is shown?"},
            {"from": "gpt", "value": "A cup."},
            {"from": "human", "value": "<image>\n<image>\nAnd these?"},
            {"from": "gpt", "value": "A cat and a rocket."},
        ],
    }


def test_truncation_never_splits_an_image_run(sample_tokenizer_path):
    builder = builder_with_images(sample_tokenizer_path, max_seq_length=900)
    full = builder_with_images(sample_tokenizer_path).build(RawRecord(0, two_turn_record()))
    second_run_start = int(np.flatnonzero(full.tokens == builder.image_run.start_id)[1])
    assert second_run_start < 900 < second_run_start + 576  # a cut at 900 would split the 2nd image
    cut = builder.build(RawRecord(0, two_turn_record()))
    assert cut.truncated and len(cut.images) == 1
    assert cut.length == second_run_start  # the tokens end right before the run (tokens = ids[:-1])
    assert np.array_equal(cut.tokens, full.tokens[: cut.length])
    assert np.array_equal(cut.images[0], full.images[0])


def test_no_truncate_skips_too_long(sample_tokenizer_path):
    builder = builder_with_images(sample_tokenizer_path, max_seq_length=300, truncate=False)
    skipped = builder.build(RawRecord(3, image_record(1)))
    assert isinstance(skipped, Skipped) and skipped.reason == "too_long" and skipped.index == 3


@pytest.mark.parametrize(
    "image, reason",
    [("nope.jpg", "missing_image"), ("../build_records.py", "outside_image_folder")],
)
def test_image_problems_become_skips(sample_tokenizer_path, image, reason):
    record = {**image_record(1), "image": image}
    skipped = builder_with_images(sample_tokenizer_path).build(RawRecord(5, record))
    assert isinstance(skipped, Skipped) and skipped.reason == reason and skipped.record_id == "img"
