"""The sample store: the intermediate, sharded, resumable store of encoded samples.

Written in shards so that a killed run resumes::

    output_dir/packed_seq_dataset/
      progress.json                 committed shards (record range, counts), settings fingerprint,
                                    "complete" once every record is in; rewritten atomically
      shard_00000.rows              raw little-endian SAMPLE_ROW records, one per sample
      shard_00000.skipped.jsonl     the shard's skipped records
      shard_00000_text.bin/.idx     IndexedDataset int32, document i = sample i: [tokens + the label
                                    of the last token, trained bits (labels != ignore_index, packed
                                    8 a byte), image_starts (where each image run begins)]; tokens
                                    and bits without each image run's first N - 1 positions
      shard_00000.image_refs        16-byte content key of every image of the shard's samples, in order
      shard_00000.images            the image pool part of the shard: each image not seen in an earlier
      shard_00000.image_keys        shard or earlier in this one, uint8 (3, H, W) after resize/crop/pad,
                                    before rescale/normalise (formats/image_pool.py); absent if none

An image run is the same N ids every time (progress.json's image_run, as [id, repeats] pairs)
with ignored labels (progress.json's ignore_index) except at its last position, so, as in the
compact format, only its last position is stored; the writer refuses a sample that breaks this
and the reader puts the runs back (``SampleStore.tokens_labels`` gives the exact arrays). A
label is the next id where trained (samples.py), so only which positions are trained is stored.

A sharded run (neva_pack.shards) writes one such store per record range, ``part_<i>_of_<N>/``
inside this directory; its final step appends each part as one shard (``join_part``).

The pool parts are also the compact format's image pool: re-packing at another size or with
another algorithm reads them, re-encodes nothing, and a compact output adds no pixel of its own.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.formats.common import fsync_close as _fsync_close
from neva_pack.formats.common import read_versioned as _read_versioned
from neva_pack.formats.indexed import IndexedReader, IndexedWriter, bin_path, idx_path, read_index
from neva_pack.formats.image_pool import KEY_BYTES, ImagePool, PoolPart, PoolWriter, image_key, load_keys, pool_part
from neva_pack.paths import (
    STORE_PROGRESS,
    shard_image_refs_path,
    shard_rows_path,
    shard_skipped_path,
    shard_text_prefix,
    write_json_atomic,
)

STORE_FORMAT = "neva_pack.sample_store"
STORE_FORMAT_VERSION = 5  # 5: image runs elided from the text, labels as trained bits
STORE_TEXT_DTYPE = np.int32
_TEXT_ITEMS = 3  # tokens + last label, trained bits, image_starts
STORE_IMAGE_DTYPE = np.uint8
"""Images are stored after resize/crop/pad, before rescale/normalise (formats/image_pool.py)."""
SAMPLE_ROW = np.dtype(
    [
        ("record_index", "<i8"),  # position of the source record in the input file
        ("length", "<i4"),  # len(tokens): text + image positions; what is packed
        ("num_images", "<i4"),  # images of the sample in the image store
        ("truncated", "u1"),  # 1 when the sample was cut to max_seq_length
    ]
)




@dataclass(frozen=True, slots=True, kw_only=True)
class ShardInfo:
    name: str
    """File stem of the shard (shard_00000)."""
    first_record: int
    """Index of the first input record the shard covers."""
    end_record: int
    """One past the last input record the shard covers."""
    samples: int
    """Samples stored in the shard."""
    images: int
    """Image instances of the shard's samples."""
    pool_images: int
    """Distinct images the shard added to the pool (its .images part)."""
    truncated: int
    """Truncated samples in the shard."""
    skipped_by_reason: dict
    """Skipped records of the shard, by reason."""
    pool_checksums: dict | None = None
    """Checksums of the shard's pool part, computed as it was written (``PoolPart.checksums``)."""


class SampleStoreWriter:
    """Appends samples as they stream in, committing a shard at each checkpoint.

    Nothing accumulates in memory beyond one shard's index. After a kill, ``resume=True``
    drops whatever was not committed and continues at ``next_record``.
    """

    def __init__(
        self, directory: Path, image_shape, fingerprint: dict, resume: bool = False, first_record: int = 0,
        extra: dict | None = None, *, image_run, ignore_index: int,
    ):  # fmt: skip
        self.directory = Path(directory)
        self.image_shape = tuple(image_shape)
        self.fingerprint = fingerprint
        self.image_run = np.asarray(image_run, dtype=STORE_TEXT_DTYPE)
        self.ignore_index = int(ignore_index)
        self.first_record = first_record  # a sharded run's part starts at its range (neva_pack.shards)
        self.extra = extra or {}  # written into progress.json as is (a part's partition, a join's origin)
        self.shards: list[ShardInfo] = []
        if resume and (self.directory / STORE_PROGRESS).is_file():
            progress = _read_progress(self.directory)
            check_settings(progress["fingerprint"], fingerprint)
            check_settings(
                {"image_run": progress["image_run"], "ignore_index": progress["ignore_index"]},
                {"image_run": _run_pairs(self.image_run), "ignore_index": self.ignore_index},
            )
            self.shards = [ShardInfo(**shard) for shard in progress["shards"]]
            self.complete = bool(progress["complete"])
        else:
            self.complete = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_uncommitted()
        self._known = load_keys(self.pool_parts())
        self._open = None

    def pool_parts(self) -> list[PoolPart]:
        return [pool_part(self.directory, s.name, s.pool_images, s.pool_checksums) for s in self.shards]

    @property
    def next_record(self) -> int:
        return self.shards[-1].end_record if self.shards else self.first_record

    def _remove_uncommitted(self) -> None:
        keep = {shard.name for shard in self.shards}
        for path in self.directory.iterdir():
            shard = re.match(r"shard_\d+", path.name)
            if shard and shard.group() not in keep:
                path.unlink()

    def _shard(self) -> "_OpenShard":
        if self._open is None:
            name = f"shard_{len(self.shards):05d}"
            pool = PoolWriter(pool_part(self.directory, name, 0), self._known, sum(s.pool_images for s in self.shards))
            self._open = _OpenShard(
                self.directory, name, self.next_record, self.image_shape, pool,
                image_run=self.image_run, ignore_index=self.ignore_index,
            )  # fmt: skip
        return self._open

    def append(self, sample) -> None:
        self._shard().append(sample)

    def append_stored(self, batch: StoredBatch, start: int, stop: int) -> None:
        """Append the batch's records in [start, stop) (a batch may straddle a checkpoint)."""
        self._shard().append_stored(batch, start, stop)

    def skip(self, skipped) -> None:
        self._shard().skip(skipped)

    def commit(self, end_record: int) -> None:
        """Make every record before ``end_record`` durable (a resume starts there)."""
        shard = self._shard()
        self.shards.append(shard.close(end_record))
        self._open = None
        self._write_progress(complete=False)

    def skipped_files(self) -> list[Path]:
        """The skipped-record files of the committed shards, in record order."""
        return [shard_skipped_path(self.directory, s.name) for s in self.shards]

    def finish(self, total_records: int) -> None:
        if self._open is not None or self.next_record < total_records:
            self.commit(total_records)
        self.complete = True
        self._write_progress(complete=True)

    def _write_progress(self, complete: bool) -> None:
        write_json_atomic(
            self.directory / STORE_PROGRESS,
            {
                "format": STORE_FORMAT,
                "version": STORE_FORMAT_VERSION,
                "image_shape": list(self.image_shape),
                "image_run": _run_pairs(self.image_run),
                "ignore_index": self.ignore_index,
                "fingerprint": self.fingerprint,
                **self.extra,
                "complete": complete,
                "shards": [
                    {field: getattr(shard, field) for field in ShardInfo.__dataclass_fields__} for shard in self.shards
                ],
            },
        )


def join_part(writer: SampleStoreWriter, part: Path, first_record: int, end_record: int) -> None:
    """Append a complete store ``part`` (one shard's record range of a sharded run, neva_pack.shards)
    to ``writer`` as one store shard, decoding nothing:

    - text: the part's chunks joined by ``add_index`` (bytes copied, index extended: formats/indexed.py);
    - rows, image refs, skipped lines: concatenated in record order;
    - images: those of the part's pool that no earlier part holds, in the part's order. A part
      dedups only within itself; dropping what an earlier part already stored leaves each image
      once, in order of first use -- the pool (and so every pool index) of a run without shards.
    """
    progress = _read_progress(part)
    if progress.get("image_run") != _run_pairs(writer.image_run) or progress.get("ignore_index") != writer.ignore_index:
        raise ValueError(f"{part}: written with another image run or ignore value than the store it joins")
    chunks = [ShardInfo(**shard) for shard in progress["shards"]]
    if writer._open is not None or writer.next_record != first_record:
        raise ValueError(f"{part}: starts at record {first_record}, the store is at {writer.next_record}")
    directory, name = writer.directory, f"shard_{len(writer.shards):05d}"
    text = None
    if any(chunk.samples for chunk in chunks):
        text = IndexedWriter(bin_path(shard_text_prefix(directory, name)), STORE_TEXT_DTYPE)
    pool = PoolWriter(pool_part(directory, name, 0), writer._known, sum(s.pool_images for s in writer.shards))
    targets = [open(path(directory, name), "wb") for path in _CONCATENATED]
    for chunk in chunks:
        if chunk.samples:
            text.add_index(shard_text_prefix(part, chunk.name))
        for path, target in zip(_CONCATENATED, targets):
            with open(path(part, chunk.name), "rb") as source:
                shutil.copyfileobj(source, target)
        source = pool_part(part, chunk.name, chunk.pool_images, chunk.pool_checksums)
        read = _copy_new_images(source, pool, writer.image_shape)
        if source.checksums is not None and read is not None and read != source.checksums[0]:
            raise StoreDamage(f"{source.images_file.name} does not hash to the checksum its progress file records")
    for target in targets:
        _fsync_close(target)
    if text is not None:
        text.finalize(idx_path(shard_text_prefix(directory, name)))
    writer.shards.append(
        ShardInfo(
            name=name,
            first_record=first_record,
            end_record=end_record,
            samples=sum(chunk.samples for chunk in chunks),
            images=sum(chunk.images for chunk in chunks),
            pool_images=pool.close(),
            truncated=sum(chunk.truncated for chunk in chunks),
            skipped_by_reason=_sum_counts(chunk.skipped_by_reason for chunk in chunks),
            pool_checksums=pool.checksums(),
        )
    )
    writer._write_progress(complete=False)


_CONCATENATED = (shard_rows_path, shard_image_refs_path, shard_skipped_path)
"""Files of a store shard that join by concatenation."""


class StoreDamage(ValueError):
    """A store's files disagree with what its progress file records (``store_files_problem``, ``join_part``)."""


_IMAGES_PER_READ = 32


def _copy_new_images(source: PoolPart, pool: PoolWriter, image_shape) -> str | None:
    """Add the images of ``source`` that ``pool`` lacks; returns the xxh3-128 of the source's images
    file as read (every image is read: the check that the part arrived whole costs no extra read)."""
    if source.count == 0:
        return None
    import xxhash

    keys = source.keys_file.read_bytes()
    size = int(np.prod(image_shape))
    digest = xxhash.xxh3_128()
    with open(source.images_file, "rb") as f:
        for first in range(0, source.count, _IMAGES_PER_READ):
            count = min(_IMAGES_PER_READ, source.count - first)
            data = f.read(count * size)
            if len(data) != count * size:
                raise StoreDamage(f"{source.images_file.name} ends before its image {first + len(data) // size}")
            digest.update(data)
            images = np.frombuffer(data, dtype=STORE_IMAGE_DTYPE).reshape(count, *image_shape)
            for k in range(count):
                pool.add_keyed(keys[(first + k) * KEY_BYTES : (first + k + 1) * KEY_BYTES], images[k])
    return digest.hexdigest()


def store_files_problem(directory: Path, progress: dict) -> str | None:
    """What is wrong with the files of a store's committed shards, checked against what its progress
    file records: each file's size (rows, image refs, the pool's images and keys; the text index's
    documents and the size of the text it points into), the skipped lines' count, and the checksum of
    each pool part's keys (a part's images are hashed as ``join_part`` copies them). None when all agree.
    Cheap: reads the indexes and keys, never the text or the pixels."""
    from neva_pack.errors import InputError
    from neva_pack.checksums import file_checksum

    directory = Path(directory)
    image_bytes = int(np.prod(progress["image_shape"]))
    for shard in (ShardInfo(**info) for info in progress["shards"]):
        pool = pool_part(directory, shard.name, shard.pool_images, shard.pool_checksums)
        sizes = [(shard_rows_path(directory, shard.name), shard.samples * SAMPLE_ROW.itemsize),
                 (shard_image_refs_path(directory, shard.name), shard.images * KEY_BYTES)]  # fmt: skip
        if pool.count:
            sizes += [(pool.images_file, pool.count * image_bytes), (pool.keys_file, pool.count * KEY_BYTES)]
        text = shard_text_prefix(directory, shard.name)
        if shard.samples:
            try:
                index = read_index(idx_path(text))
            except (OSError, InputError) as exc:
                return f"{idx_path(text).name}: {exc.strerror if isinstance(exc, OSError) else exc}"
            if len(index.sequence_lengths) != _TEXT_ITEMS * shard.samples or len(index.document_indices) != shard.samples + 1:
                return f"{idx_path(text).name} indexes {len(index.document_indices) - 1} samples, {shard.samples} expected"
            end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * np.dtype(STORE_TEXT_DTYPE).itemsize
            sizes.append((bin_path(text), end))
        for path, expected in sizes:
            if not path.is_file():
                return f"{path.name} is missing"
            if path.stat().st_size != expected:
                return f"{path.name} is {path.stat().st_size:,} bytes, {expected:,} expected"
        skipped = shard_skipped_path(directory, shard.name)
        if not skipped.is_file():
            return f"{skipped.name} is missing"
        with open(skipped, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        if lines != sum(shard.skipped_by_reason.values()):
            return f"{skipped.name} lists {lines} records, {sum(shard.skipped_by_reason.values())} expected"
        if pool.count and pool.checksums is not None and file_checksum(pool.keys_file) != pool.checksums[1]:
            return f"{pool.keys_file.name} does not hash to the checksum its progress file records"
    return None


def _sum_counts(counts) -> dict:
    total: dict[str, int] = {}
    for count in counts:
        for reason, value in count.items():
            total[reason] = total.get(reason, 0) + value
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreDocument:
    """One sample as the store writes it, computed where the sample is built (a worker), so that
    the main process only writes bytes. Bytes, not arrays: they pickle as one copy each."""

    text: bytes
    """int32 items of the sample's text document: stored tokens + the last label, trained bits, image starts."""
    lengths: tuple[int, int, int]
    """Values in each of the three items."""
    image_keys: bytes
    """16-byte content key of each image (formats/image_pool.py), in placeholder order."""
    row: bytes
    """The sample's SAMPLE_ROW record."""


def store_document(sample, image_run: np.ndarray, ignore_index: int, image_shape) -> StoreDocument:
    """The checks every stored sample passes, and its bytes in the store (pure: a worker runs it).

    The store leaves out the first N - 1 positions of each image run and keeps only which
    positions are trained, so a sample that breaks either assumption is refused (a bug)."""
    if sample.images.shape[1:] != tuple(image_shape):
        raise ValueError(f"image shape {sample.images.shape[1:]} != store's {tuple(image_shape)}")
    tokens, labels, starts = sample.tokens, sample.labels, sample.image_starts
    trained = labels != ignore_index
    if not np.array_equal(labels[:-1][trained[:-1]], tokens[1:][trained[:-1]]):
        raise ValueError(f"record {sample.index}: a trained label is not the next token (a bug)")
    if len(starts):
        elided = _run_positions(starts, len(image_run), len(tokens))
        if not (np.array_equal(tokens[elided], np.tile(image_run[:-1], len(starts))) and not trained[elided].any()):
            raise ValueError(f"record {sample.index}: an image run is not the layout's ids with ignored labels (a bug)")
        kept = np.ones(len(tokens), dtype=bool)
        kept[elided] = False
        tokens, trained = tokens[kept], trained[kept]
    bits = _pack_bits(trained)
    sizes = (len(tokens) + len(labels[-1:]), len(bits), len(starts))
    values = np.empty(sum(sizes), dtype=STORE_TEXT_DTYPE)
    values[: len(tokens)] = tokens
    values[len(tokens) : sizes[0]] = labels[-1:]
    values[sizes[0] : sizes[0] + sizes[1]] = bits
    values[sizes[0] + sizes[1] :] = starts
    row = np.array([(sample.index, len(sample.tokens), len(sample.images), sample.truncated)], dtype=SAMPLE_ROW)
    return StoreDocument(
        text=values.tobytes(),
        lengths=sizes,
        image_keys=b"".join(image_key(image) for image in sample.images),
        row=row.tobytes(),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredBatch:
    """The store's bytes of one message of consecutive records (samples.SampleStream), built by
    a worker: the main process unpickles one object and makes a handful of writes per message,
    not a pickled Sample (its arrays, one slow dataclass ``__setstate__``) and a write per record.
    A batch can be written in record ranges (``SampleStoreWriter.append_stored``), so checkpoints
    and skip checks fall on the same records as when samples are appended one by one."""

    first_record: int
    """Index of the batch's first record."""
    records: int
    """Consecutive records in the batch (samples and skipped)."""
    text: bytes
    """The samples' text documents (StoreDocument.text), concatenated."""
    lengths: bytes
    """int64 (samples, 3): each document's item lengths (StoreDocument.lengths)."""
    rows: bytes
    """The samples' SAMPLE_ROW records (record index, length, images, truncated)."""
    image_keys: bytes
    """16-byte content key of each image of the samples, in order."""
    images: np.ndarray
    """uint8 (images, 3, H, W), the samples' images in order (none for text-only samples)."""
    skipped: tuple
    """The batch's samples.Skipped records."""


def stored_batch(items, image_run: np.ndarray, ignore_index: int, image_shape) -> StoredBatch:
    """Consecutive records' Sample | Skipped items as one StoredBatch (pure: a worker runs it)."""
    samples = [item for item in items if hasattr(item, "tokens")]
    documents = [store_document(item, image_run, ignore_index, image_shape) for item in samples]
    images = [item.images for item in samples if len(item.images)]
    return StoredBatch(
        first_record=items[0].index if items else 0,
        records=len(items),
        text=b"".join(document.text for document in documents),
        lengths=np.array([document.lengths for document in documents], dtype=np.int64).reshape(-1, _TEXT_ITEMS).tobytes(),
        rows=b"".join(document.row for document in documents),
        image_keys=b"".join(document.image_keys for document in documents),
        images=np.concatenate(images) if images else np.zeros((0, *image_shape), dtype=STORE_IMAGE_DTYPE),
        skipped=tuple(item for item in items if not hasattr(item, "tokens")),
    )


class _OpenShard:
    """The shard being written: its text file is created on first use (a shard of skipped records has none)."""

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
        self._refs = open(shard_image_refs_path(directory, name), "wb")
        self._rows = open(shard_rows_path(directory, name), "wb")
        self._skipped = open(shard_skipped_path(directory, name), "w", encoding="utf-8")
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
            lengths = np.frombuffer(batch.lengths, dtype=np.int64).reshape(-1, _TEXT_ITEMS)
            ends = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))]) * np.dtype(STORE_TEXT_DTYPE).itemsize
            if self._text is None:
                self._text = IndexedWriter(bin_path(shard_text_prefix(self.directory, self.name)), STORE_TEXT_DTYPE, buffered=True)
            self._text.add_documents_bytes(memoryview(batch.text)[ends[first] : ends[last]], lengths[first:last])
            counts = rows["num_images"].astype(np.int64)
            image_ends = np.concatenate([[0], np.cumsum(counts)]).tolist()
            image_first, image_last = image_ends[first], image_ends[last]
            keys = batch.image_keys
            for k in range(image_first, image_last):
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

    def close(self, end_record: int) -> ShardInfo:
        if self._text is not None:
            self._text.finalize(idx_path(shard_text_prefix(self.directory, self.name)))
        pool_images = self._pool.close()
        _fsync_close(self._refs)
        _fsync_close(self._rows)
        _fsync_close(self._skipped)
        return ShardInfo(
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


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredTexts:
    """Samples' text as read back from the store (``SampleStore.texts``)."""

    tokens: np.ndarray
    """int32 tokens of the samples, concatenated."""
    labels: np.ndarray
    """int32 labels, aligned with the tokens."""
    lengths: np.ndarray
    """int64 positions of each sample (after its cut)."""
    image_starts: list[np.ndarray]
    """Per sample, int64 where each of its image runs starts (in the sample, before any cut)."""


class SampleStore:
    """Read side of the sample store: lengths for the packer, samples by index for the writer.

    Samples are read with file reads, not memory maps, so reading a large store does not grow
    the process's resident memory.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        progress = _read_progress(self.directory)
        if not progress["complete"]:
            from neva_pack.errors import InputError

            raise InputError(f"{self.directory}: the sample store is incomplete (resume the run with --resume)")
        self.fingerprint = progress["fingerprint"]
        self.image_shape = tuple(progress["image_shape"])
        self.image_run = np.repeat(*np.array(progress["image_run"], dtype=np.int64).reshape(-1, 2).T).astype(STORE_TEXT_DTYPE)
        self.ignore_index = int(progress["ignore_index"])
        self.shards = [ShardInfo(**shard) for shard in progress["shards"]]
        rows = [np.fromfile(shard_rows_path(self.directory, s.name), dtype=SAMPLE_ROW) for s in self.shards]
        self.rows = np.concatenate(rows) if rows else np.zeros(0, dtype=SAMPLE_ROW)
        self._first_sample = np.cumsum([0] + [s.samples for s in self.shards])
        self._first_image = np.cumsum([0] + [s.images for s in self.shards])
        self._sample_first_image = np.concatenate([[0], np.cumsum(self.rows["num_images"].astype(np.int64))])
        self.pool_parts = [pool_part(self.directory, s.name, s.pool_images, s.pool_checksums) for s in self.shards]
        self.pool = ImagePool(self.pool_parts, self.image_shape, mmap=False)
        self._known = None
        self._text = {}
        self._refs = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        return self.rows["length"].astype(np.int64)

    @property
    def skipped_by_reason(self) -> dict:
        total: dict[str, int] = {}
        for shard in self.shards:
            for reason, count in shard.skipped_by_reason.items():
                total[reason] = total.get(reason, 0) + count
        return total

    def skipped_files(self) -> list[Path]:
        return [shard_skipped_path(self.directory, s.name) for s in self.shards]

    def _locate(self, i: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self._first_sample, i, side="right")) - 1
        return shard, i - int(self._first_sample[shard])

    def _text_reader(self, shard: int) -> IndexedReader:
        """The shard's text file, opened on first use."""
        if shard not in self._text:
            self._text[shard] = IndexedReader(shard_text_prefix(self.directory, self.shards[shard].name))
        return self._text[shard]

    def tokens_labels(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        text = self.texts([i])
        return text.tokens, text.labels

    def image_starts(self, i: int) -> np.ndarray:
        shard, local = self._locate(i)
        return self._text_reader(shard)[_TEXT_ITEMS * local + 2]

    def texts(self, indices, keep=None) -> "StoredTexts":
        """Tokens and labels of samples ``indices``, concatenated, each cut to ``keep[k]`` positions
        when given (None: whole), with one file read per sample and one compiled pass over them all
        (``store_kernels.decode_texts``): what assembly needs for a group of packs.

            stored (per sample)   [t0 t2 t3 | last label]  bits [1 0 1]  starts [1]     (run S P, N = 2)
            ids (per sample)      [t0 S  t2 t3 | last label]        S filled in from the image run
            tokens                [t0 S  t2 t3]       labels  = next id where trained, else ignore
        """
        from neva_pack.formats.store_kernels import SOUND, decode_texts  # numba: imported on first read

        indices = np.asarray(indices, dtype=np.int64)
        lengths = self.rows["length"][indices].astype(np.int64)
        keep = lengths if keep is None else np.minimum(np.asarray(keep, dtype=np.int64), lengths)
        raw, items = self._raw_texts(indices)  # per sample: stored ids + last label | trained bits | image starts
        total = int(keep.sum())
        tokens = np.empty(total, dtype=STORE_TEXT_DTYPE)
        labels = np.empty(total, dtype=STORE_TEXT_DTYPE)
        run_prefix = self.image_run[:-1].astype(STORE_TEXT_DTYPE)
        bad = decode_texts(raw, items, lengths, keep, run_prefix, STORE_TEXT_DTYPE(self.ignore_index), tokens, labels)
        sizes = items.sum(axis=1)
        starts_at = (np.cumsum(sizes) - items[:, 2]).tolist()
        if bad != SOUND:
            k = int(bad)
            sample_starts = raw[starts_at[k] : starts_at[k] + int(items[k, 2])]
            _run_positions(sample_starts, len(self.image_run), int(lengths[k]))  # raises when the runs are at fault
            raise ValueError(f"sample {int(indices[k])}: its stored text does not fit its {int(lengths[k])} positions (a bug)")
        no_images = np.zeros(0, dtype=np.int64)
        return StoredTexts(
            tokens=tokens,
            labels=labels,
            lengths=keep,
            image_starts=[raw[at : at + n].astype(np.int64) if n else no_images for at, n in zip(starts_at, items[:, 2].tolist())],
        )

    def _raw_texts(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples' stored text values, concatenated in the order asked (one read per sample),
        and the lengths of their three items."""
        shards = np.searchsorted(self._first_sample, indices, side="right") - 1
        present = np.unique(shards)
        if len(present) == 1:  # the usual case: read in order, nothing to reorder
            shard = int(present[0])
            return self._text_reader(shard).raw_documents(indices - self._first_sample[shard], _TEXT_ITEMS)
        items = np.zeros((len(indices), _TEXT_ITEMS), dtype=np.int64)
        parts = []
        for shard in present.tolist():
            chosen = np.flatnonzero(shards == shard)
            values, items[chosen] = self._text_reader(shard).raw_documents(indices[chosen] - self._first_sample[shard], _TEXT_ITEMS)
            parts.append((chosen, values))
        sizes = items.sum(axis=1)
        block = np.cumsum(sizes) - sizes
        raw = np.empty(int(sizes.sum()), dtype=STORE_TEXT_DTYPE)
        for chosen, values in parts:  # each shard's samples to their places in the order asked
            raw[np.repeat(block[chosen] - (np.cumsum(sizes[chosen]) - sizes[chosen]), sizes[chosen]) + np.arange(len(values))] = values
        return raw, items

    def image_indices(self, i: int) -> np.ndarray:
        """Pool index of each image of sample i, in placeholder order."""
        count = int(self.rows["num_images"][i])
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        shard, _ = self._locate(i)
        if shard not in self._refs:
            self._refs[shard] = shard_image_refs_path(self.directory, self.shards[shard].name).read_bytes()
        if self._known is None:
            self._known = load_keys(self.pool_parts)
        first = int(self._sample_first_image[i] - self._first_image[shard])
        refs = self._refs[shard]
        return np.array([self._known[refs[k * KEY_BYTES : (k + 1) * KEY_BYTES]] for k in range(first, first + count)])

    def images(self, i: int) -> np.ndarray:
        """uint8 (num_images, 3, H, W) of sample i."""
        return self.pool.read(self.image_indices(i))


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """A bool mask as int32 words, 8 positions a byte (the text file holds int32 items)."""
    packed = np.packbits(mask)
    words = np.zeros(-(-len(packed) // 4) * 4, dtype=np.uint8)
    words[: len(packed)] = packed
    return words.view(STORE_TEXT_DTYPE)


def _run_pairs(run: np.ndarray) -> list[list[int]]:
    """The run as [id, repeats] pairs: [start, patch x 576, end] is 3 pairs in progress.json, not 578 lines."""
    breaks = np.flatnonzero(np.diff(run)) + 1
    return [[int(part[0]), len(part)] for part in np.split(run, breaks)]


def _run_positions(image_starts, run_length: int, length: int) -> np.ndarray:
    """Positions of the first run_length - 1 ids of each image run: what the store leaves out."""
    starts = np.asarray(image_starts, dtype=np.int64)
    if len(starts) and (starts[0] < 0 or np.any(np.diff(starts) < run_length) or starts[-1] + run_length > length):
        raise ValueError(f"image runs at {starts.tolist()} overlap or leave the sample of {length} positions (a bug)")
    return (starts[:, None] + np.arange(max(run_length - 1, 0))).ravel()


def _read_progress(directory: Path) -> dict:
    progress = _read_versioned(Path(directory) / STORE_PROGRESS, STORE_FORMAT, STORE_FORMAT_VERSION)
    if progress["version"] != STORE_FORMAT_VERSION:
        from neva_pack.errors import InputError

        raise InputError(f"{directory}: a sample store of version {progress['version']}; this neva_pack needs "
                         f"{STORE_FORMAT_VERSION} (run again with --overwrite)")  # fmt: skip
    return progress


def check_settings(stored: dict, current: dict) -> None:
    """--resume: ConfigError naming the first setting (by key) whose stored value differs from this run's."""
    from neva_pack.errors import ConfigError

    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            raise ConfigError(
                f"--resume: the output was started with {key}={stored.get(key)!r}, this run has "
                f"{current.get(key)!r}; run with the same settings, or --overwrite to start again"
            )


