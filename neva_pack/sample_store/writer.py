"""The store's write side: samples appended as they stream in, a segment committed at each checkpoint."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from neva_pack.files import IndexedWriter, bin_path, fsync_close, idx_path, write_json_atomic
from neva_pack.core import InputError
from neva_pack.sample_store.batches import StoredBatch, stored_batch
from neva_pack.sample_store.checks import check_input, check_settings, read_progress, segment_checksums, store_checksums_problem
from neva_pack.sample_store.files import (
    POOL_IMAGE_ROW,
    PROGRESS_FILE,
    SAMPLE_ROW,
    STORE_FORMAT,
    STORE_FORMAT_VERSION,
    STORE_TEXT_DTYPE,
    TEXT_ITEMS,
    SegmentInfo,
    StoreRun,
    segment_image_refs_path,
    segment_name,
    segment_of,
    segment_rows_path,
    segment_skipped_path,
    segment_text_prefix,
)
from neva_pack.sample_store.image_pool import KEY_BYTES, PoolSegment, PoolWriter, load_keys, pool_segment

__all__ = ["SampleStoreWriter", "commits_reported_to"]

_COMMIT_LISTENER: contextvars.ContextVar[Callable[[Path], None] | None] = contextvars.ContextVar("commit_listener", default=None)


@contextlib.contextmanager
def commits_reported_to(listener: Callable[[Path], None]) -> Iterator[None]:
    """Within the block, ``listener(directory)`` is called each time a store writer has written its
    progress file (a segment committed, the store finished): a remote output sends the committed files
    then (``pipeline/staging.py``). A listener's error stops the run as the commit's own would."""
    token = _COMMIT_LISTENER.set(listener)
    try:
        yield
    finally:
        _COMMIT_LISTENER.reset(token)


class SampleStoreWriter:
    """Appends samples as they stream in, committing a segment at each checkpoint.

    Nothing accumulates in memory beyond one segment's index. After a kill, ``resume=True``
    drops whatever was not committed and continues at ``next_record``.

    A fixed store: ``image_shape`` (3, H, W) and ``image_run`` the run's ids (or a fixed ImageRun). A
    dynamic store: ``image_shape`` None, ``image_run`` an ImageRun with ``positions`` None, and
    ``image_processor`` the settings that rebuild its processor (``images.processor_record``);
    ``frame_compression`` a codec its pool's entries are compressed with (frame_codec.py; None: raw uint8).
    """

    def __init__(
        self, directory: Path, image_shape, fingerprint: dict, resume: bool = False, first_record: int = 0,
        extra: dict | None = None, *, image_run, ignore_index: int, input_digest: str | None = None, data_path=None,
        image_processor: dict | None = None, frame_compression: str | None = None,
    ):  # fmt: skip
        self.directory = Path(directory)
        self.run = StoreRun.of(image_run)
        if self.run.dynamic != (image_shape is None) or self.run.dynamic != (image_processor is not None):
            raise ValueError("a dynamic store has no image shape and records its image processor; a fixed one the opposite (a bug)")
        self.image_shape = None if image_shape is None else tuple(image_shape)
        self.image_processor = image_processor
        if frame_compression is not None and not self.run.dynamic:
            raise ValueError("only a dynamic store's pool is compressed (a bug)")
        self.frame_compression = frame_compression
        self.fingerprint = fingerprint
        self.image_run = self.run.ids  # a fixed store's run ids (None: dynamic)
        self.ignore_index = int(ignore_index)
        self.first_record = first_record  # a sharded run's part starts at its range (pipeline/parts.py)
        self.extra = extra or {}  # written into progress.json as is (a part's partition, a join's origin)
        self.input_digest = input_digest  # the input's content digest: a resume proves it is the same input
        self.segments: list[SegmentInfo] = []
        if resume and (self.directory / PROGRESS_FILE).is_file():
            progress = read_progress(self.directory)
            check_input(self.directory, progress.get("input_digest"), input_digest, data_path)
            check_settings(progress["fingerprint"], fingerprint)
            check_settings(
                {key: progress.get(key) for key in ("image_run", "image_shape", "image_processor", "ignore_index", "frame_compression")},
                self._image_settings(),
            )
            problem = store_checksums_problem(self.directory, progress)
            if problem is not None:
                raise InputError(f"--resume: the sample store in {self.directory} is damaged ({problem}); "
                                 "run with --overwrite to start again")  # fmt: skip
            self.segments = [SegmentInfo(**segment) for segment in progress["shards"]]
            self.complete = bool(progress["complete"])
        else:
            self.complete = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_uncommitted()
        self._known = load_keys(self.pool_segments())
        self._open = None

    def _image_settings(self) -> dict:
        """What progress.json records of the store's images and runs (and a resume must match)."""
        return {
            "image_run": self.run.to_json(),
            "image_shape": None if self.image_shape is None else list(self.image_shape),
            "image_processor": self.image_processor,
            "ignore_index": self.ignore_index,
            "frame_compression": self.frame_compression,  # written only when set: a raw store's progress.json as before
        }

    def pool_segments(self) -> list[PoolSegment]:
        return [pool_segment(self.directory, s.name, s.pool_images, s.pool_checksums, dynamic=self.run.dynamic,
                             codec=self.frame_compression) for s in self.segments]  # fmt: skip

    @property
    def next_record(self) -> int:
        return self.segments[-1].end_record if self.segments else self.first_record

    def _remove_uncommitted(self) -> None:
        keep = {segment.name for segment in self.segments}
        for path in self.directory.iterdir():
            segment = segment_of(path.name)
            if segment and segment not in keep:
                path.unlink()

    def _segment(self) -> "_OpenSegment":
        if self._open is None:
            name = segment_name(len(self.segments))
            self._open = _OpenSegment(
                self.directory, name, self.next_record, self.image_shape, self.new_pool_segment(name),
                image_run=self.run, ignore_index=self.ignore_index,
            )  # fmt: skip
        return self._open

    def new_pool_segment(self, name: str) -> PoolWriter:
        """The pool writer of segment ``name``, which adds only images no committed segment holds."""
        segment = pool_segment(self.directory, name, 0, dynamic=self.run.dynamic, codec=self.frame_compression)
        return PoolWriter(segment, self._known, sum(s.pool_images for s in self.segments))

    def append(self, sample) -> None:
        self._segment().append(sample)

    def append_stored(self, batch: StoredBatch, start: int, stop: int) -> None:
        """Append the batch's records in [start, stop) (a batch may straddle a checkpoint)."""
        self._segment().append_stored(batch, start, stop)

    def skip(self, skipped) -> None:
        self._segment().skip(skipped)

    def commit(self, end_record: int) -> None:
        """Make every record before ``end_record`` durable (a resume starts there)."""
        self.add_segment(self._segment().close(end_record))

    def add_segment(self, segment: SegmentInfo) -> None:
        """Record a segment whose files are written and durable (the open one, or one joined from a part)."""
        if self._open is not None and self._open.name != segment.name:
            raise ValueError(f"{segment.name}: segment {self._open.name} is open (a bug)")
        if segment.checksums is None:
            segment = dataclasses.replace(segment, checksums=segment_checksums(self.directory, segment.name))
        self.segments.append(segment)
        self._open = None
        self._write_progress(complete=False)

    @property
    def between_segments(self) -> bool:
        """Whether every appended record is committed (nothing is open)."""
        return self._open is None

    def skipped_files(self) -> list[Path]:
        """The skipped-record files of the committed segments, in record order."""
        return [segment_skipped_path(self.directory, s.name) for s in self.segments]

    def finish(self, total_records: int) -> None:
        if self._open is not None or self.next_record < total_records:
            self.commit(total_records)
        self.complete = True
        self._write_progress(complete=True)

    def _write_progress(self, complete: bool) -> None:
        write_json_atomic(
            self.directory / PROGRESS_FILE,
            {
                "format": STORE_FORMAT,
                "version": STORE_FORMAT_VERSION,
                **{key: value for key, value in self._image_settings().items() if value is not None or key == "image_shape"},
                "fingerprint": self.fingerprint,
                "input_digest": self.input_digest,
                **self.extra,
                "complete": complete,
                "shards": [segment.to_json() for segment in self.segments],
            },
        )
        listener = _COMMIT_LISTENER.get()
        if listener is not None:
            listener(self.directory)


class _OpenSegment:
    """The segment being written: its text file is created on first use (a segment of skipped records has none)."""

    def __init__(
        self, directory: Path, name: str, first_record: int, image_shape, pool: PoolWriter, *, image_run, ignore_index
    ):
        self.directory = directory
        self.image_run = image_run
        self.ignore_index = ignore_index
        self.name = name
        self.first_record = first_record
        self.image_shape = image_shape
        self._text = None
        self._pool = pool
        self._refs = open(segment_image_refs_path(directory, name), "wb")
        self._rows = open(segment_rows_path(directory, name), "wb")
        self._skipped = open(segment_skipped_path(directory, name), "w", encoding="utf-8")
        self.samples = 0
        self.images = 0
        self.truncated = 0
        self.skipped_by_reason: dict[str, int] = {}

    def append(self, sample) -> None:
        """Write one sample (a caller without a worker's StoredBatch): the batch path, for one record."""
        batch = stored_batch([sample], self.image_run, self.ignore_index, self.image_shape)
        self.append_stored(batch, sample.index, sample.index + 1)

    def append_stored(self, batch: StoredBatch, start: int, stop: int) -> None:
        """Write the batch's records in [start, stop): few writes for many samples."""
        rows = np.frombuffer(batch.rows, dtype=SAMPLE_ROW)
        first, last = np.searchsorted(rows["record_index"], [start, stop]).tolist()
        if last > first:
            lengths = np.frombuffer(batch.lengths, dtype=np.int64).reshape(-1, TEXT_ITEMS)
            ends = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))]) * np.dtype(STORE_TEXT_DTYPE).itemsize
            if self._text is None:
                self._text = IndexedWriter(bin_path(segment_text_prefix(self.directory, self.name)), STORE_TEXT_DTYPE, buffered=True)
            self._text.add_documents_bytes(memoryview(batch.text)[ends[first] : ends[last]], lengths[first:last])
            counts = rows["num_images"].astype(np.int64)
            image_ends = np.concatenate([[0], np.cumsum(counts)]).tolist()
            image_first, image_last = image_ends[first], image_ends[last]
            keys = batch.image_keys
            for k in range(image_first, image_last):
                if batch.entries:  # compressed by the worker: the pool's own bytes
                    row, frame = batch.entries[k]
                    self._pool.add_entry(keys[k * KEY_BYTES : (k + 1) * KEY_BYTES], np.frombuffer(row, dtype=POOL_IMAGE_ROW), frame)
                else:
                    self._pool.add_keyed(keys[k * KEY_BYTES : (k + 1) * KEY_BYTES], batch.images[k])
            self._refs.write(keys[image_first * KEY_BYTES : image_last * KEY_BYTES])
            self._rows.write(batch.rows[first * SAMPLE_ROW.itemsize : last * SAMPLE_ROW.itemsize])
            self.samples += last - first
            self.images += image_last - image_first
            self.truncated += int(rows["truncated"][first:last].sum())
        for skipped in batch.skipped:
            if start <= skipped.index < stop:
                self.skip(skipped)

    def skip(self, skipped) -> None:
        line = {"index": skipped.index, "id": skipped.record_id, "reason": skipped.reason, "detail": skipped.detail}
        self._skipped.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.skipped_by_reason[skipped.reason] = self.skipped_by_reason.get(skipped.reason, 0) + 1

    def close(self, end_record: int) -> SegmentInfo:
        if self._text is not None:
            self._text.finalize(idx_path(segment_text_prefix(self.directory, self.name)))
        pool_images = self._pool.close()
        fsync_close(self._refs)
        fsync_close(self._rows)
        fsync_close(self._skipped)
        return SegmentInfo(
            name=self.name,
            first_record=self.first_record,
            end_record=end_record,
            samples=self.samples,
            images=self.images,
            pool_images=pool_images,
            truncated=self.truncated,
            skipped_by_reason=dict(self.skipped_by_reason),
            pool_checksums=self._pool.checksums(),
        )
