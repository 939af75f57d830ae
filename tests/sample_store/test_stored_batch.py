"""A worker's StoredBatch, written in record ranges, leaves the same store bytes as appending its
records one by one; the main loop cuts a message where a checkpoint or skip check falls."""

import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.files import IndexedWriter
from neva_pack.sample_store import STORE_TEXT_DTYPE, StoredBatch, stored_batch
from neva_pack.pipeline import record_stops
from neva_pack.samples import Skipped, stream as sample_stream
from neva_pack.core import passthrough
from tests.sample_store.test_sample_store_runs import IGNORE, SHAPE, sample, samples_and_run, writer


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@settings(max_examples=15, deadline=None)  # each example writes two whole stores
@given(case=samples_and_run(), skips=st.lists(st.booleans(), min_size=6, max_size=6), data=st.data())
def test_a_batch_written_in_ranges_is_byte_identical_to_records_one_by_one(case, skips, data):
    run, samples, per_shard = case
    items = []
    for s in samples:  # some records skipped, the others renumbered in order
        index = len(items)
        if skips[index % len(skips)]:
            items.append(Skipped(index=index, record_id=None, reason="empty", detail="no turns"))
            index += 1
        items.append(type(s)(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "index": index}))
    stops = sorted(set(data.draw(st.lists(st.integers(1, len(items)), max_size=4))) | {len(items)})
    run = np.array(run, dtype=STORE_TEXT_DTYPE)
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as batched:
        by_record, by_batch = writer(Path(one), run), writer(Path(batched), run)
        for item in items:
            (by_record.skip if isinstance(item, Skipped) else by_record.append)(item)
            if item.index + 1 in stops:
                by_record.commit(item.index + 1)
        batch = stored_batch(items, run, IGNORE, SHAPE)
        assert (batch.first_record, batch.records) == (0, len(items))
        done = 0
        for stop in stops:
            by_batch.append_stored(batch, done, stop)
            by_batch.commit(stop)
            done = stop
        by_record.finish(len(items))
        by_batch.finish(len(items))
        assert _files(Path(batched)) == _files(Path(one))


def test_add_documents_bytes_matches_one_document_at_a_time(tmp_path):
    documents = [np.arange(k * 5, dtype=np.int32) for k in range(4)]
    lengths = np.array([[k, 2 * k, 2 * k] for k in range(4)], dtype=np.int64)
    one, many = IndexedWriter(tmp_path / "one.bin", np.int32), IndexedWriter(tmp_path / "many.bin", np.int32)
    for document, sizes in zip(documents, lengths.tolist()):
        one.add_document_bytes(document.tobytes(), sizes)
    many.add_documents_bytes(b"".join(d.tobytes() for d in documents), lengths)
    one.finalize(tmp_path / "one.idx")
    many.finalize(tmp_path / "many.idx")
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "many.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "many.idx").read_bytes()


def _batch(first: int, records: int, skipped=()) -> StoredBatch:
    return StoredBatch(
        first_record=first, records=records, text=b"", lengths=b"", rows=b"", image_keys=b"",
        images=np.zeros((0, *SHAPE), np.uint8),
        skipped=tuple(Skipped(index=i, record_id=None, reason="empty", detail="") for i in skipped),
    )  # fmt: skip


def test_a_message_is_cut_after_each_checkpoint_skip_and_where_checks_start():
    assert record_stops(_batch(2, 32), checkpoint_every=1000, skip_check_from=1000) == [34]
    assert record_stops(_batch(990, 32), checkpoint_every=1000, skip_check_from=1000) == [1000, 1022]
    assert record_stops(_batch(990, 32), checkpoint_every=10, skip_check_from=0) == [1000, 1010, 1020, 1022]
    assert record_stops(_batch(1000, 32, skipped=[1003, 1021]), checkpoint_every=1000, skip_check_from=1000) == [
        1004, 1022, 1032,
    ]  # fmt: skip
    assert record_stops(_batch(5, 1, skipped=[5]), checkpoint_every=1, skip_check_from=0) == [6]


class _Messages(torch.utils.data.IterableDataset):
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter([sample_stream.in_shared_memory(batch) for batch in self.batches])


def test_images_cross_the_dataloader_in_shared_memory_and_arrive_unchanged():
    """A worker's images travel as a tensor in shared memory (a handle through the pipe, not the
    pixels); the main process gets the same NumPy array back. Text-only batches are left as they are."""
    run = np.array([1, 2, 3], dtype=STORE_TEXT_DTYPE)
    with_images = stored_batch([sample(0, [10, 1, 2, 3, 11], [-100, -100, -100, 11, 12], [1], len(run)),
                                sample(1, [12, 1, 2, 3, 1, 2, 3], [-100, -100, -100, -100, -100, -100, 40], [1, 4], len(run))],
                               run, IGNORE, SHAPE)  # fmt: skip
    text_only = stored_batch([sample(2, [10, 11], [11, 12], [])], run, IGNORE, SHAPE)
    assert with_images.images.shape == (3, *SHAPE)
    loader = torch.utils.data.DataLoader(_Messages([with_images, text_only]), batch_size=None, num_workers=1,
                                         collate_fn=passthrough)  # fmt: skip
    sent = list(loader)
    assert isinstance(sent[0].images, torch.Tensor) and sent[0].images.is_shared()
    assert isinstance(sent[1].images, np.ndarray)
    got = [sample_stream.received(batch) for batch in sent]
    for before, after in zip([with_images, text_only], got):
        assert isinstance(after.images, np.ndarray) and after.images.dtype == np.uint8
        np.testing.assert_array_equal(after.images, before.images)
        assert (after.text, after.rows, after.image_keys, after.lengths) == (before.text, before.rows, before.image_keys, before.lengths)
