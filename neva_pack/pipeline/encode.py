"""The encode stage: records -> DataLoader workers -> StoredBatch messages -> the sample store,
a segment committed every checkpoint, the skip fraction checked as records are read."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack.config import RunConfig, SampleConfig
from neva_pack.pipeline.skipped import too_many_skipped, write_run_skipped
from neva_pack.records import RecordIndex
from neva_pack.sample_store import SampleStoreWriter, StoredBatch
from neva_pack.samples import SampleStream, received
from neva_pack.core import worker_messages

__all__ = ["StoreImages", "encode_samples", "images_in_shared_memory", "record_stops", "records_per_message", "store_images"]

SKIP_CHECK_AFTER = 1_000
"""--max_skip_fraction is checked once this many records were read (and at the end)."""
RECORDS_PER_MESSAGE = 32
"""Records a DataLoader worker encodes and sends as one message (a round trip per record costs more
than tokenizing a short one)."""
TEXT_RECORDS_PER_MESSAGE = 256
"""Records per message of a run without an image folder: a text-only message is small, and each
message costs the main process a round trip."""
FIRST_RECORDS_PER_MESSAGE = 1
"""Records of each worker's first message: the first sample reaches the main process after one
record's work, not a whole message's."""
MESSAGES_IN_FLIGHT = 2
"""Messages each worker may have queued ahead (times RECORDS_PER_MESSAGE times the records' images:
what bounds the main process's memory)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreImages:
    """How the run's sample store holds its images (``SampleStoreWriter``'s arguments)."""

    image_shape: tuple | None
    """(3, H, W) of a fixed-crop run's images; None for a dynamic-resolution run (each its own size)."""
    image_run: object
    """A fixed run's ids, or the dynamic ImageRun (``positions`` None)."""
    image_processor: dict | None
    """A dynamic run's processor record (``images.processor_record``); None for fixed crops."""
    frame_compression: str | None = None
    """The codec a dynamic run's pool is compressed with (--frame_compression); None: raw uint8."""


def store_images(sample: SampleConfig, builder) -> StoreImages:
    """The store's image settings for the builder: a fixed crop's shape and run ids, or a dynamic
    family's run and the record of its processor (``builder.preprocessor``, its encoder's settings
    resolved again from ``sample.hf_vision_encoder``)."""
    if builder.image_run.positions is not None:
        return StoreImages(image_shape=tuple(builder.preprocessor.shape), image_run=builder.image_run.ids(), image_processor=None)
    from neva_pack.families import resolve_encoder
    from neva_pack.families import processor_record

    record = processor_record(resolve_encoder(sample.hf_vision_encoder), builder.preprocessor)
    return StoreImages(image_shape=None, image_run=builder.image_run, image_processor=record, frame_compression=sample.frame_compression)


def encode_samples(
    sample: SampleConfig, run: RunConfig, builder, store_directory: Path, report_dir: Path, index: RecordIndex,
    progress: bool, first: int = 0, end: int | None = None, extra: dict | None = None, *, input_digest: str,
    fingerprint: dict,
) -> None:  # fmt: skip
    """Stream samples of records [first, end) from the DataLoader into the store at ``store_directory``,
    committing a store segment every checkpoint. The workers seek to their records by ``index``.
    ``fingerprint``: what a resume must match (the run's sample fingerprint, ``PreprocessConfig.sample_fingerprint``:
    a shard's part gives its content fingerprint, which names no absolute path); ``input_digest``: the input's.
    What makes the samples comes from ``sample``; how to run (workers, checkpoints, resume, skips) from ``run``."""
    end = index.count if end is None else end
    images = store_images(sample, builder)
    writer = SampleStoreWriter(
        store_directory, images.image_shape, fingerprint, resume=run.resume, first_record=first, extra=extra,
        image_run=images.image_run, ignore_index=sample.ignore_index, input_digest=input_digest,
        data_path=sample.data_path, image_processor=images.image_processor, frame_compression=images.frame_compression,
    )  # fmt: skip
    start = writer.next_record
    skipped = sum(sum(s.skipped_by_reason.values()) for s in writer.segments)
    if start < end:
        stream = SampleStream(
            sample.data_path, builder, start=start, end=end, batch_size=records_per_message(sample),
            first_batch_size=FIRST_RECORDS_PER_MESSAGE, index=index,
            share_images=images_in_shared_memory(sample.image_folder is not None, run.num_workers, images.image_shape),
            frame_compression=images.frame_compression,
        )  # fmt: skip
        bar = tqdm(total=end - first, initial=start - first, desc="tokenize + images", unit="rec", disable=not progress)
        messages = worker_messages(stream, run.num_workers, MESSAGES_IN_FLIGHT)
        checked = None  # skipped records when the skip fraction was last checked (it grows only with a skip)
        done = start
        try:
            for batch in map(received, messages):
                if batch.first_record != done:
                    raise RuntimeError(f"a message starts at record {batch.first_record}, expected {done} (a bug)")
                for stop in record_stops(batch, run.checkpoint_every, first + SKIP_CHECK_AFTER):
                    writer.append_stored(batch, done, stop)
                    skipped += sum(done <= item.index < stop for item in batch.skipped)
                    done = stop
                    if done % run.checkpoint_every == 0 and done < end:
                        writer.commit(done)
                    if (done - first >= SKIP_CHECK_AFTER and skipped != checked) or done == end:
                        check_skip_fraction(run.max_skip_fraction, writer, skipped, done - first, report_dir)
                        checked = skipped
                if batch.skipped:
                    bar.set_postfix(skipped=skipped, refresh=False)
                bar.update(batch.records)
        finally:  # kills the workers at once when the run stops early (an error, Ctrl-C, SIGTERM)
            messages.close()
        bar.close()
    writer.finish(end)


def records_per_message(sample: SampleConfig) -> int:
    """Messages of an image run stay small (they bound the main process's memory); text-only runs
    (no ``sample.image_folder``), whose samples are a few KB, send larger ones."""
    return RECORDS_PER_MESSAGE if sample.image_folder is not None else TEXT_RECORDS_PER_MESSAGE


SHARED_IMAGES_PER_RECORD = 4
"""Images a record is taken to carry when sizing the shared memory that messages in flight need."""
SHARED_MEMORY = Path("/dev/shm")


def images_in_shared_memory(with_images: bool, workers: int, image_shape) -> bool:
    """Whether the workers' images may cross in shared memory (torch puts a tensor in /dev/shm):
    only where /dev/shm holds twice what the messages in flight could take (a container's is
    often 64 MB, where torch's workers die of a bus error); otherwise they go through the pipe
    (always for dynamic-resolution images, ``image_shape`` None: StoredImages, not one array).
    ``with_images``: the run has an image folder; ``workers``: its DataLoader workers (0: none cross)."""
    if not with_images or workers == 0 or image_shape is None:
        return False
    in_flight = workers * (MESSAGES_IN_FLIGHT + 1) * RECORDS_PER_MESSAGE * SHARED_IMAGES_PER_RECORD
    try:
        free = shutil.disk_usage(SHARED_MEMORY).free
    except OSError:  # no /dev/shm (not Linux)
        return False
    return free >= 2 * in_flight * int(np.prod(image_shape))


def record_stops(batch: StoredBatch, checkpoint_every: int, skip_check_from: int) -> list[int]:
    """Where to cut a message's records so that each checkpoint and skip-fraction check falls on
    the same record as when records are written one by one: after each checkpoint's last record,
    each skipped record, the record where checking starts, and the message's last record."""
    end = batch.first_record + batch.records
    stops = {end}
    stops.update(range(-(-(batch.first_record + 1) // checkpoint_every) * checkpoint_every, end, checkpoint_every))
    stops.update(item.index + 1 for item in batch.skipped)
    if batch.first_record < skip_check_from < end:
        stops.add(skip_check_from)
    return sorted(stops)


def check_skip_fraction(max_skip_fraction: float, writer, skipped: int, done: int, output_dir: Path) -> None:
    """--max_skip_fraction: past it, what was encoded is committed (a resume continues it) and the
    run stops with the reasons in the skip list."""
    if skipped <= max_skip_fraction * done:
        return
    writer.commit(writer.first_record + done)  # done counts from the first record of the run (or shard)
    write_run_skipped(writer.skipped_files(), output_dir)
    raise too_many_skipped(max_skip_fraction, skipped, f"the first {done}", output_dir)


