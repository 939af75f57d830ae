"""Records of an input file -> ``StoredBatch`` messages, built in the workers of a torch DataLoader,
arriving in input order whatever the number of workers (``SampleStream``)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset, get_worker_info

from neva_pack.records import RecordIndex, iter_raw_records
from neva_pack.sample_store import StoredBatch, stored_batch

if TYPE_CHECKING:
    from neva_pack.samples.sample_builder import SampleBuilder

__all__ = ["SampleStream", "in_shared_memory", "received"]


class SampleStream(IterableDataset):
    """Records of ``data_path`` -> sample_store.StoredBatch messages, for a multi-worker DataLoader.

    Records are dealt in messages of consecutive records, message k to worker k mod W: each
    worker's first message holds ``first_batch_size`` records (the first record reaches the main
    process after one record's work, not a whole batch's), every later one ``batch_size`` (one
    round trip per batch, not per record). The DataLoader takes one message from each worker in
    turn, so messages, and the records in them, arrive in input order whatever W is: the outputs
    are byte-identical for any number of workers::

        records   0   1   2..33   34..65   66..97  ...
        worker    0   1     0        1        0    ...     (W = 2, first_batch_size 1, batch_size 32)

    A message is one StoredBatch (the store's bytes of its records' samples, and its skips), not
    a list of Samples: one cheap object to unpickle per message in the main process.
    ``index`` (record_stream.index_records, taken before the workers fork): with its offsets a worker
    seeks to its own messages instead of delimiting every record of the file. ``share_images``: a
    stored message's images cross to the main process in shared memory (``received`` takes them back).
    """

    def __init__(
        self, data_path, builder: SampleBuilder, start: int = 0, end: int | None = None, batch_size: int = 32,
        first_batch_size: int | None = None, index: RecordIndex | None = None,
        share_images: bool = False, frame_compression: str | None = None,
    ):  # fmt: skip
        self.data_path = data_path
        self.frame_compression = frame_compression  # the store's codec: a worker compresses its images
        self.share_images = share_images
        self.index = index
        self.builder = builder
        self.start = start
        self.end = end
        self.batch_size = batch_size
        self.first_batch_size = batch_size if first_batch_size is None else first_batch_size

    def _message(self, offset: int, workers: int) -> int:
        """Number of the message that carries the record ``offset`` records after ``start``."""
        first = workers * self.first_batch_size
        if offset < first:
            return offset // self.first_batch_size
        return workers + (offset - first) // self.batch_size

    def _first_record(self, message: int, workers: int) -> int:
        """The record message number ``message`` starts with (the inverse of ``_message``)."""
        if message < workers:
            return self.start + message * self.first_batch_size
        return self.start + workers * self.first_batch_size + (message - workers) * self.batch_size

    def _ranges(self, worker: int, workers: int):
        """The record ranges [first, stop) of ``worker``'s messages, in order (endless when ``end``
        is None: the file's end stops the reader)."""
        for message in itertools.count(worker, workers):
            first, stop = self._first_record(message, workers), self._first_record(message + 1, workers)
            if self.end is not None:
                if first >= self.end:
                    return
                stop = min(stop, self.end)
            yield first, stop

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        image_run, ignore_index = self.builder.image_run, self.builder.ignore_index
        if image_run.positions is None:  # dynamic-resolution images: each its own run length and size
            run, shape = image_run, None
        else:
            run, shape = image_run.ids(), self.builder.preprocessor.shape
        batch = []
        ranges = self._ranges(worker, workers)
        send = in_shared_memory if self.share_images else _as_is
        for raw in iter_raw_records(self.data_path, self.builder.record_limits, ranges=ranges, index=self.index):
            offset = raw.index - self.start
            message = self._message(offset, workers)
            batch.append(self.builder.build(raw))
            if self._message(offset + 1, workers) != message:
                yield send(stored_batch(batch, run, ignore_index, shape, self.frame_compression))
                batch = []
        if batch:
            yield send(stored_batch(batch, run, ignore_index, shape, self.frame_compression))


def in_shared_memory(batch: StoredBatch) -> StoredBatch:
    """The batch with its images as a torch tensor: a DataLoader worker hands a tensor over in
    shared memory (only a handle crosses the pipe), where a NumPy array is pickled through the pipe
    and copied twice more in the main process, which every batch goes through.
    ``received`` undoes it."""
    if not batch.images.size:
        return batch
    return replace(batch, images=torch.from_numpy(batch.images))


def _as_is(batch: StoredBatch) -> StoredBatch:
    return batch


def received(batch: StoredBatch) -> StoredBatch:
    """A message as the main process receives it, its images a NumPy array again (no copy)."""
    if isinstance(batch.images, torch.Tensor):
        return replace(batch, images=batch.images.numpy())
    return batch
