"""The sample store keeps only the last position of each image run and which positions are trained,
and gives back every token and label."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.core import InputError
from neva_pack.sample_store import (
    PROGRESS_FILE, RUN_VALUES, SampleStore, SampleStoreWriter, segment_text_prefix, stored_batch
)
from neva_pack.files import bin_path
from neva_pack.samples import Sample

SHAPE = (3, 2, 2)
IGNORE = -100


def sample(index, tokens, labels, starts, run_length=1) -> Sample:
    images = np.stack([np.full(SHAPE, (index * 7 + k) % 256, np.uint8) for k in range(len(starts))] or [np.zeros(SHAPE, np.uint8)])
    return Sample(
        index=index, record_id=str(index), tokens=np.array(tokens, np.int32), labels=np.array(labels, np.int32),
        images=images[: len(starts)], image_starts=np.array(starts, np.int32), truncated=False,
        image_tokens=np.full(len(starts), run_length, np.int32), vision_cost=len(starts) * 16,
    )  # fmt: skip


def writer(directory, run, **kwargs) -> SampleStoreWriter:
    return SampleStoreWriter(directory, SHAPE, {"test": 1}, image_run=run, ignore_index=IGNORE, **kwargs)


@st.composite
def samples_and_run(draw):
    """Samples of text ids (>= 10) and image runs of 1 to 4 ids below 10; a label is the next id or
    ignored (always at an image run's first N - 1 positions), tokens = ids[:-1], as samples.py makes them."""
    run = draw(st.lists(st.integers(-300, 9), min_size=1, max_size=4))
    samples = []
    for index in range(draw(st.integers(1, 6))):
        ids, starts = [], []
        for part in draw(st.lists(st.sampled_from(["text", "image"]), min_size=1, max_size=5)):
            if part == "image":
                starts.append(len(ids))
                ids += run
            else:
                ids += draw(st.lists(st.integers(10, 99), min_size=1, max_size=4))
        ids.append(draw(st.integers(10, 99)))  # the last id, only a label
        in_run = np.zeros(len(ids), dtype=bool)
        for start in starts:
            in_run[start : start + len(run) - 1] = True
        labels = [IGNORE if in_run[k] or not draw(st.booleans()) else ids[k + 1] for k in range(len(ids) - 1)]
        samples.append(sample(index, ids[:-1], labels, starts, len(run)))
    return run, samples, draw(st.integers(1, 3))


@settings(max_examples=20, deadline=None)  # each example writes and reads a whole store
@given(case=samples_and_run(), reverse=st.booleans())
def test_store_elides_image_runs_and_reads_back_every_position(case, reverse):
    """Property: whatever the run and the mix of text and images, the text files hold each sample's
    length minus (run - 1) per image, and the reader returns exactly the tokens and labels written."""
    run, samples, per_segment = case
    with tempfile.TemporaryDirectory() as tmp:
        store_writer = writer(Path(tmp), run)
        for s in samples:
            store_writer.append(s)
            if (s.index + 1) % per_segment == 0:
                store_writer.commit(s.index + 1)
        store_writer.finish(len(samples))
        store = SampleStore(Path(tmp))
        kept = [len(s.tokens) - (len(run) - 1) * len(s.image_starts) for s in samples]
        stored_bytes = sum(bin_path(segment_text_prefix(tmp, segment.name)).stat().st_size
                           for segment in store.segments if segment.samples)  # fmt: skip
        bits_bytes = sum(-(-n // 32) * 4 for n in kept)  # 8 positions a byte, in int32 words
        runs = RUN_VALUES * sum(len(s.image_starts) for s in samples)  # each run's start and length
        assert stored_bytes == 4 * (sum(kept) + len(samples) + runs) + bits_bytes
        for i, s in enumerate(samples):
            tokens, labels = store.tokens_labels(i)
            assert tokens.dtype == labels.dtype == np.int32
            np.testing.assert_array_equal(tokens, s.tokens)
            np.testing.assert_array_equal(labels, s.labels)
            np.testing.assert_array_equal(store.image_starts(i), s.image_starts)
        # several samples at once (a pack, or a group of packs read together), in an order that
        # crosses segments back and forth, some cut: what each gives alone, concatenated
        order = list(reversed(range(len(samples)))) if reverse else list(range(0, len(samples), 2)) + list(range(1, len(samples), 2))
        keep = [len(samples[i].tokens) // (1 + i % 2) for i in order]
        text = store.texts(order, keep)
        assert text.lengths.tolist() == keep
        np.testing.assert_array_equal(text.tokens, np.concatenate([samples[i].tokens[:k] for i, k in zip(order, keep)]))
        np.testing.assert_array_equal(text.labels, np.concatenate([samples[i].labels[:k] for i, k in zip(order, keep)]))
        for i, starts in zip(order, text.image_starts):
            np.testing.assert_array_equal(starts, samples[i].image_starts)
        # the same samples as a worker sends them (one StoredBatch per segment's records) give the same files
        worker_built = Path(tmp) / "worker_built"
        store_writer = writer(worker_built, run)
        for first in range(0, len(samples), per_segment):
            chunk = samples[first : first + per_segment]
            store_writer.append_stored(stored_batch(chunk, np.array(run), IGNORE, SHAPE), first, first + len(chunk))
            if len(chunk) == per_segment:
                store_writer.commit(first + per_segment)
        store_writer.finish(len(samples))
        for path in (path for path in Path(tmp).iterdir() if path.is_file()):
            assert (worker_built / path.name).read_bytes() == path.read_bytes(), path.name


RUN = [5, 6, 6, 7]


def test_a_stored_image_run_that_leaves_its_sample_is_refused_on_read(tmp_path):
    """A store whose text file was altered (an image start moved past the sample's end) is not
    read back as tokens: the elided positions would land in another sample."""
    from neva_pack.files import IndexedReader

    store_writer = writer(tmp_path, RUN)
    store_writer.append(sample(0, [10, 11, 5, 6, 6, 7, 12], [IGNORE] * 7, [2], len(RUN)))
    store_writer.append(sample(1, [10, 11, 12], [11, 12, IGNORE], []))
    store_writer.finish(2)
    store = SampleStore(tmp_path)
    assert store.texts([1, 0]).tokens.tolist() == [10, 11, 12, 10, 11, 5, 6, 6, 7, 12]
    prefix = segment_text_prefix(tmp_path, store.segments[0].name)
    start_item = IndexedReader(prefix).sequence_pointers[2]  # document 0's image starts
    with open(bin_path(prefix), "r+b") as f:
        f.seek(int(start_item))
        f.write(np.int32(5).tobytes())  # a run of 4 from position 5 of 7 positions
    with pytest.raises(ValueError, match=r"image runs at \[5\] overlap or leave the sample of 7 positions"):
        SampleStore(tmp_path).texts([1, 0])


@pytest.mark.parametrize(
    "tokens, labels, why",
    [
        ([10, 5, 6, 8, 7, 11], [IGNORE] * 6, "an id of the run is not the image run's"),
        ([10, 5, 6, 6, 7, 11], [IGNORE, IGNORE, 6, IGNORE, IGNORE, IGNORE], "a position of the run is trained"),
        ([10, 5, 6, 6], [IGNORE] * 4, "the run leaves the sample"),
        ([10, 5, 6, 6, 7, 11], [IGNORE] * 4 + [12, IGNORE], "a trained label is not the next token"),
    ],
)
def test_a_sample_whose_image_run_is_not_the_stores_is_refused(tmp_path, tokens, labels, why):
    with pytest.raises(ValueError, match="a bug"):
        writer(tmp_path, RUN).append(sample(0, tokens, labels, [1], len(RUN)))


def test_the_image_run_and_ignore_index_are_recorded_and_checked_on_resume(tmp_path):
    store_writer = writer(tmp_path, RUN)
    store_writer.append(sample(0, [10, *RUN, 11], [IGNORE, IGNORE, IGNORE, IGNORE, 11, IGNORE], [1], len(RUN)))
    store_writer.commit(1)
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert progress["image_run"] == [[5, 1], [6, 2], [7, 1]] and progress["ignore_index"] == IGNORE
    from neva_pack.core import ConfigError

    with pytest.raises(ConfigError, match="image_run"):
        writer(tmp_path, [5, 6, 7], resume=True)
    assert writer(tmp_path, RUN, resume=True).next_record == 1


def test_a_store_of_an_older_version_is_refused(tmp_path):
    store_writer = writer(tmp_path, RUN)
    store_writer.finish(0)
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    (tmp_path / PROGRESS_FILE).write_text(json.dumps({**progress, "version": 4}))
    with pytest.raises(InputError, match="run again with --overwrite"):
        SampleStore(tmp_path)
