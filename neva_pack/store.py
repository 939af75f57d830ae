"""The one place that knows the on-disk layouts: file names, item order, dtypes, modes, meta.

Packed output (NeMo's NevaPackedSeqDatatset reads it as is)::

    output_dir/packed_seq_dataset.bin/.idx      Megatron-Core IndexedDataset, float32, multimodal
      document p (one per pack), 4 items:
        +0 cu_seqlens  [0, l1, l1+l2, ..., total]             mode 0
        +1 tokens      concatenated sample tokens             mode 0
        +2 labels      concatenated sample labels             mode 0
        +3 image       (num_images * 3 * H * W) normalised    mode 1  (one zero image if the pack has none)
    output_dir/packed_seq_dataset.plan.npz      which input records each pack holds (offsets,
                                                record_index, length): what `verify` traces back
    output_dir/packed_seq_dataset.meta.json     written last: the mark of a complete output, with
                                                the checksum (xxh3-128) of every other output file

    pack with samples of length 5 and 3 (8 positions), one image in the first sample:
      cu_seqlens = [0, 5, 8]   tokens = [a a a a a | b b b]   image = [img_a]

Sample store (intermediate, ours), written in shards so that a killed run resumes::

    output_dir/packed_seq_dataset/
      progress.json                 committed shards (record range, counts), settings fingerprint,
                                    "complete" once every record is in; rewritten atomically
      shard_00000.rows              raw little-endian SAMPLE_ROW records, one per sample
      shard_00000.skipped.jsonl     the shard's skipped records
      shard_00000_text.bin/.idx     IndexedDataset int32, document i = sample i:
                                    [tokens, labels, image_starts (where each image run begins)]
      shard_00000_images.bin/.idx   IndexedDataset uint8, document i = sample i: one item per image,
                                    (3, H, W) after resize/crop/pad, before rescale/normalise
                                    (absent when the shard has no image)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PACKED_NAME = "packed_seq_dataset"
"""Prefix name of the packed output (NeMo's)."""
META_SUFFIX = ".meta.json"
PLAN_SUFFIX = ".plan.npz"
PACKED_FORMAT = "neva_pack.packed_seq_dataset"
PACKED_FORMAT_VERSION = 1
PACKED_DTYPE = np.float32
"""NeMo's builder dtype for every item, ids included (exact below 2**24)."""
ITEMS_PER_PACK = 4
ITEM_CU_SEQLENS, ITEM_TOKENS, ITEM_LABELS, ITEM_IMAGE = range(ITEMS_PER_PACK)
IMAGE_MODE = 1
"""Megatron-Core multimodal mode of the image item (text items are mode 0)."""
PACK_MODES = (0, 0, 0, IMAGE_MODE)

STORE_DIR = PACKED_NAME
STORE_FORMAT = "neva_pack.sample_store"
STORE_FORMAT_VERSION = 3
STORE_PROGRESS = "progress.json"
STORE_TEXT_DTYPE = np.int32
_TEXT_ITEMS = 3  # tokens, labels, image_starts
STORE_IMAGE_DTYPE = np.uint8
SAMPLE_ROW = np.dtype(
    [
        ("record_index", "<i8"),  # position of the source record in the input file
        ("length", "<i4"),  # len(tokens): text + image positions; what is packed
        ("num_images", "<i4"),  # images of the sample in the image store
        ("truncated", "u1"),  # 1 when the sample was cut to max_seq_length
    ]
)

SKIPPED_FILE = "skipped.jsonl"
STATS_FILE = "stats.json"
CHECKSUM = "xxh3_128"
_READ_CHUNK = 16 << 20


def packed_prefix(output_dir: Path, pack_size: int | None = None) -> Path:
    """output_dir/packed_seq_dataset, or output_dir/packed_seq_dataset_<size> in a multi-size run."""
    return Path(output_dir) / (PACKED_NAME if pack_size is None else f"{PACKED_NAME}_{pack_size}")


def stats_path(output_dir: Path, pack_size: int | None = None) -> Path:
    """output_dir/stats.json, or output_dir/stats_<size>.json in a multi-size run."""
    return Path(output_dir) / (STATS_FILE if pack_size is None else f"stats_{pack_size}.json")


def meta_path(prefix: Path) -> Path:
    return Path(str(prefix) + META_SUFFIX)


def plan_path(prefix: Path) -> Path:
    return Path(str(prefix) + PLAN_SUFFIX)


def store_dir(output_dir: Path) -> Path:
    return Path(output_dir) / STORE_DIR


def bin_path(prefix: Path) -> Path:
    return Path(str(prefix) + ".bin")


def idx_path(prefix: Path) -> Path:
    return Path(str(prefix) + ".idx")


def tmp_prefix(prefix: Path) -> Path:
    return Path(str(prefix) + ".tmp")


def output_paths(output_dir: Path) -> list[Path]:
    """Every path a run may create in output_dir (what --overwrite removes, and only that)."""
    output_dir = Path(output_dir)
    sizes = [None] + [int(m.group(1)) for p in output_dir.glob(f"{PACKED_NAME}_*") if (m := _SIZED.match(p.name))]
    paths = [store_dir(output_dir), output_dir / SKIPPED_FILE, output_dir / (SKIPPED_FILE + ".tmp")]
    for size in sorted(set(sizes), key=lambda v: -1 if v is None else v):
        prefix = packed_prefix(output_dir, size)
        tmp = tmp_prefix(prefix)
        stats = stats_path(output_dir, size)
        paths += [meta_path(prefix), bin_path(prefix), idx_path(prefix), plan_path(prefix), bin_path(tmp),
                  idx_path(tmp), Path(str(tmp) + _CHECKPOINT_SUFFIX), Path(str(tmp) + PLAN_SUFFIX), stats,
                  stats.with_name(stats.name + ".tmp")]  # fmt: skip
    return paths


_SIZED = re.compile(rf"{PACKED_NAME}_(\d+)\.")


@functools.cache
def _megatron():
    """Megatron-Core's indexed dataset module; imported lazily (seconds, and noisy warnings)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on CPU hosts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex / Transformer Engine
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _torch_view(array: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def file_checksum(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data) -> None:
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_close(file) -> None:
    file.flush()
    os.fsync(file.fileno())
    file.close()


# ---------------------------------------------------------------------------------------------
# Sample store


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
    """Images stored in the shard."""
    truncated: int
    """Truncated samples in the shard."""
    skipped_by_reason: dict
    """Skipped records of the shard, by reason."""


class SampleStoreWriter:
    """Appends samples as they stream in, committing a shard at each checkpoint.

    Nothing accumulates in memory beyond one shard's index. After a kill, ``resume=True``
    drops whatever was not committed and continues at ``next_record``.
    """

    def __init__(
        self, directory: Path, image_shape, fingerprint: dict, resume: bool = False, first_record: int = 0, extra: dict | None = None
    ):
        self.directory = Path(directory)
        self.image_shape = tuple(image_shape)
        self.fingerprint = fingerprint
        self.first_record = first_record  # a sharded run's part starts at its range (neva_pack.shards)
        self.extra = extra or {}  # written into progress.json as is (a part's partition, a join's origin)
        self.shards: list[ShardInfo] = []
        if resume and (self.directory / STORE_PROGRESS).is_file():
            progress = _read_progress(self.directory)
            _check_fingerprint(progress["fingerprint"], fingerprint)
            self.shards = [ShardInfo(**shard) for shard in progress["shards"]]
            self.complete = bool(progress["complete"])
        else:
            self.complete = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_uncommitted()
        self._open = None

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
            self._open = _OpenShard(self.directory, name, self.next_record, self.image_shape)
        return self._open

    def append(self, sample) -> None:
        self._shard().append(sample)

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
                "fingerprint": self.fingerprint,
                **self.extra,
                "complete": complete,
                "shards": [
                    {field: getattr(shard, field) for field in ShardInfo.__dataclass_fields__} for shard in self.shards
                ],
            },
        )


def shard_skipped_path(directory: Path, shard_name: str) -> Path:
    return Path(directory) / f"{shard_name}.skipped.jsonl"


def join_store_part(writer: SampleStoreWriter, part: Path, first_record: int, end_record: int) -> None:
    """Append a complete store ``part`` (its committed shards, in record order) to ``writer`` as one
    shard, with Megatron-Core's ``add_index``: bytes are copied, no sample is decoded."""
    chunks = [ShardInfo(**shard) for shard in _read_progress(part)["shards"]]
    if writer._open is not None or writer.next_record != first_record:
        raise ValueError(f"{part}: starts at record {first_record}, the store is at {writer.next_record}")
    mi = _megatron()
    name = f"shard_{len(writer.shards):05d}"
    directory = writer.directory
    text = images = None
    if any(chunk.samples for chunk in chunks):
        text = mi.IndexedDatasetBuilder(str(directory / f"{name}_text.bin"), dtype=STORE_TEXT_DTYPE)
    if any(chunk.images for chunk in chunks):
        images = mi.IndexedDatasetBuilder(str(directory / f"{name}_images.bin"), dtype=STORE_IMAGE_DTYPE)
    skipped_by_reason: dict[str, int] = {}
    with open(directory / f"{name}.rows", "wb") as rows, open(shard_skipped_path(directory, name), "wb") as skipped:
        for chunk in chunks:
            if chunk.samples:
                text.add_index(str(part / f"{chunk.name}_text"))
            if images is not None and chunk.images:
                images.add_index(str(part / f"{chunk.name}_images"))
            elif images is not None:
                for _ in range(chunk.samples):  # a chunk without any image has no image dataset
                    images.end_document()
            for source, target in ((part / f"{chunk.name}.rows", rows), (shard_skipped_path(part, chunk.name), skipped)):
                with open(source, "rb") as f:
                    shutil.copyfileobj(f, target)
            for reason, count in chunk.skipped_by_reason.items():
                skipped_by_reason[reason] = skipped_by_reason.get(reason, 0) + count
        for file in (rows, skipped):
            file.flush()
            os.fsync(file.fileno())
    for builder, kind in ((text, "text"), (images, "images")):
        if builder is not None:
            builder.data_file.flush()
            os.fsync(builder.data_file.fileno())
            builder.finalize(str(directory / f"{name}_{kind}.idx"))
    writer.shards.append(
        ShardInfo(
            name=name,
            first_record=first_record,
            end_record=end_record,
            samples=sum(chunk.samples for chunk in chunks),
            images=sum(chunk.images for chunk in chunks),
            truncated=sum(chunk.truncated for chunk in chunks),
            skipped_by_reason=skipped_by_reason,
        )
    )
    writer._write_progress(complete=False)


class _OpenShard:
    """The shard being written: builders are created on first use (Megatron cannot map an empty .bin)."""

    def __init__(self, directory: Path, name: str, first_record: int, image_shape):
        self.directory = directory
        self.name = name
        self.first_record = first_record
        self.image_shape = image_shape
        self._text = None
        self._images = None
        self._rows = open(directory / f"{name}.rows", "wb")
        self._skipped = open(shard_skipped_path(directory, name), "w", encoding="utf-8")
        self.samples = 0
        self.images = 0
        self.truncated = 0
        self.skipped_by_reason: dict[str, int] = {}

    def append(self, sample) -> None:
        if sample.images.shape[1:] != self.image_shape:
            raise ValueError(f"image shape {sample.images.shape[1:]} != store's {self.image_shape}")
        mi = _megatron()
        if self._text is None:
            self._text = mi.IndexedDatasetBuilder(str(self.directory / f"{self.name}_text.bin"), dtype=STORE_TEXT_DTYPE)
        # one write per document: the same bytes and index as an add_item per item, at a third of the cost
        items = (sample.tokens, sample.labels, sample.image_starts)
        self._text.add_document(np.concatenate(items, dtype=STORE_TEXT_DTYPE), [len(item) for item in items])
        if len(sample.images) and self._images is None:
            path = str(self.directory / f"{self.name}_images.bin")
            self._images = mi.IndexedDatasetBuilder(path, dtype=STORE_IMAGE_DTYPE)
            for _ in range(self.samples):  # earlier samples of the shard had no image
                self._images.end_document()
        if self._images is not None:
            image_size = int(np.prod(self.image_shape))
            self._images.add_document(sample.images.reshape(-1), [image_size] * len(sample.images))
        row = np.array([(sample.index, sample.length, len(sample.images), sample.truncated)], dtype=SAMPLE_ROW)
        self._rows.write(row.tobytes())
        self.samples += 1
        self.images += len(sample.images)
        self.truncated += int(sample.truncated)

    def skip(self, skipped) -> None:
        line = {"index": skipped.index, "id": skipped.record_id, "reason": skipped.reason, "detail": skipped.detail}
        self._skipped.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.skipped_by_reason[skipped.reason] = self.skipped_by_reason.get(skipped.reason, 0) + 1

    def close(self, end_record: int) -> ShardInfo:
        for builder, kind in ((self._text, "text"), (self._images, "images")):
            if builder is not None:
                builder.data_file.flush()
                os.fsync(builder.data_file.fileno())
                builder.finalize(str(self.directory / f"{self.name}_{kind}.idx"))
        _fsync_close(self._rows)
        _fsync_close(self._skipped)
        return ShardInfo(
            name=self.name,
            first_record=self.first_record,
            end_record=end_record,
            samples=self.samples,
            images=self.images,
            truncated=self.truncated,
            skipped_by_reason=dict(self.skipped_by_reason),
        )


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
        self.shards = [ShardInfo(**shard) for shard in progress["shards"]]
        rows = [np.fromfile(self.directory / f"{s.name}.rows", dtype=SAMPLE_ROW) for s in self.shards]
        self.rows = np.concatenate(rows) if rows else np.zeros(0, dtype=SAMPLE_ROW)
        self._first_sample = np.cumsum([0] + [s.samples for s in self.shards])
        self._text = {}
        self._images = {}

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

    def _dataset(self, cache: dict, shard: int, kind: str):
        if shard not in cache:
            prefix = self.directory / f"{self.shards[shard].name}_{kind}"
            cache[shard] = _megatron().IndexedDataset(str(prefix), mmap=False)
        return cache[shard]

    def tokens_labels(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        shard, local = self._locate(i)
        text = self._dataset(self._text, shard, "text")
        return text[_TEXT_ITEMS * local], text[_TEXT_ITEMS * local + 1]

    def image_starts(self, i: int) -> np.ndarray:
        shard, local = self._locate(i)
        return self._dataset(self._text, shard, "text")[_TEXT_ITEMS * local + 2]

    def images(self, i: int) -> np.ndarray:
        shard, local = self._locate(i)
        if self.rows["num_images"][i] == 0:
            return np.zeros((0, *self.image_shape), dtype=STORE_IMAGE_DTYPE)
        images = self._dataset(self._images, shard, "images")
        first, last = images.document_indices[local], images.document_indices[local + 1]
        return np.stack([images[k] for k in range(first, last)]).reshape(-1, *self.image_shape)


def _read_progress(directory: Path) -> dict:
    progress = _read_versioned(Path(directory) / STORE_PROGRESS, STORE_FORMAT, STORE_FORMAT_VERSION)
    if progress["version"] != STORE_FORMAT_VERSION:
        from neva_pack.errors import InputError

        raise InputError(f"{directory}: a sample store of version {progress['version']}; this neva_pack needs "
                         f"{STORE_FORMAT_VERSION} (run again with --overwrite)")  # fmt: skip
    return progress


def _check_fingerprint(stored: dict, current: dict) -> None:
    from neva_pack.errors import ConfigError

    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            raise ConfigError(
                f"--resume: the output was started with {key}={stored.get(key)!r}, this run has "
                f"{current.get(key)!r}; run with the same settings, or --overwrite to start again"
            )


# ---------------------------------------------------------------------------------------------
# Packed output

_CHECKPOINT_SUFFIX = ".checkpoint.npz"


class PackedWriter:
    """Writes packs in NeMo's layout under temporary names; ``publish`` renames them into place.

    ``checkpoint()`` makes the packs written so far durable; a writer created with
    ``resume=True`` for the same plan continues after the last checkpoint, appending to the
    same file, so the result is byte-identical to an uninterrupted run.
    """

    def __init__(self, prefix: Path, image_shape, plan_digest: str, resume: bool = False):
        mi = _megatron()
        self.prefix = Path(prefix)
        self.image_shape = tuple(image_shape)
        self.plan_digest = plan_digest
        self._tmp = tmp_prefix(self.prefix)
        self._checkpoint = Path(str(self._tmp) + _CHECKPOINT_SUFFIX)
        state = self._load_checkpoint() if resume else None
        if state is None:
            self._checkpoint.unlink(missing_ok=True)
            self._builder = mi.IndexedDatasetBuilder(str(bin_path(self._tmp)), dtype=PACKED_DTYPE, multimodal=True)
            self.num_packs = 0
        else:
            # Megatron's builder opens its file with "wb": build it on /dev/null, then hand it
            # the partial file cut back to the last checkpoint, and its index lists
            self._builder = mi.IndexedDatasetBuilder(os.devnull, dtype=PACKED_DTYPE, multimodal=True)
            self._builder.data_file.close()
            data = open(bin_path(self._tmp), "r+b")
            data.truncate(int(state["bytes"]))
            data.seek(int(state["bytes"]))
            self._builder.data_file = data
            self._builder.sequence_lengths = state["sequence_lengths"].tolist()
            self._builder.sequence_modes = state["sequence_modes"].tolist()
            self._builder.document_indices = state["document_indices"].tolist()
            self.num_packs = int(state["packs"])

    def _load_checkpoint(self):
        if not (self._checkpoint.is_file() and bin_path(self._tmp).is_file()):
            return None
        with np.load(self._checkpoint) as state:
            if str(state["plan_digest"]) != self.plan_digest or bin_path(self._tmp).stat().st_size < int(state["bytes"]):
                return None
            return {key: state[key] for key in state.files}

    def add_pack(self, lengths: np.ndarray, tokens: np.ndarray, labels: np.ndarray, images: np.ndarray) -> None:
        """One pack: per-sample lengths, concatenated tokens/labels, float32 (N, 3, H, W) images."""
        if len(images) == 0:
            images = np.zeros((1, *self.image_shape), dtype=PACKED_DTYPE)
        items = (np.concatenate([[0], np.cumsum(lengths)]), tokens, labels, images.reshape(-1))
        for item, mode in zip(items, PACK_MODES):
            self._builder.add_item(_torch_view(np.asarray(item, dtype=PACKED_DTYPE)), mode)
        self._builder.end_document()
        self.num_packs += 1

    def checkpoint(self) -> None:
        data = self._builder.data_file
        data.flush()
        os.fsync(data.fileno())
        tmp = Path(str(self._checkpoint) + ".tmp.npz")
        np.savez(
            tmp,
            bytes=np.int64(data.tell()),
            packs=np.int64(self.num_packs),
            plan_digest=np.str_(self.plan_digest),
            sequence_lengths=np.asarray(self._builder.sequence_lengths, dtype=np.int64),
            sequence_modes=np.asarray(self._builder.sequence_modes, dtype=np.int64),
            document_indices=np.asarray(self._builder.document_indices, dtype=np.int64),
        )
        os.replace(tmp, self._checkpoint)

    def publish(self, plan_table: dict, extra_files: list[Path], meta: dict) -> dict:
        """Finalize; write the plan table; rename .bin/.idx into place; write the meta last.

        Returns the meta as written (with the checksums of the output files).
        """
        self._builder.data_file.flush()
        os.fsync(self._builder.data_file.fileno())
        self._builder.finalize(str(idx_path(self._tmp)))
        tmp_plan = Path(str(self._tmp) + PLAN_SUFFIX)
        np.savez(tmp_plan, **plan_table)
        files = {
            bin_path(self.prefix): bin_path(self._tmp),
            idx_path(self.prefix): idx_path(self._tmp),
            plan_path(self.prefix): tmp_plan,
        }
        checksums = {final.name: file_checksum(tmp) for final, tmp in files.items()}
        checksums.update({path.name: file_checksum(path) for path in extra_files})
        os.replace(files[plan_path(self.prefix)], plan_path(self.prefix))
        os.replace(files[bin_path(self.prefix)], bin_path(self.prefix))
        os.replace(files[idx_path(self.prefix)], idx_path(self.prefix))
        self._checkpoint.unlink(missing_ok=True)
        full = {
            "format": PACKED_FORMAT,
            "version": PACKED_FORMAT_VERSION,
            "num_packs": self.num_packs,
            "image_shape": list(self.image_shape),
            "crop_size": list(self.image_shape[1:]),
            **meta,
            "checksums": {"algorithm": CHECKSUM, "files": checksums},
        }
        write_json_atomic(meta_path(self.prefix), full)
        return full


@dataclass(frozen=True, slots=True)
class Pack:
    cu_seqlens: np.ndarray
    """int, [0, l1, l1+l2, ..., total]."""
    tokens: np.ndarray
    """int64 token ids of all samples of the pack."""
    labels: np.ndarray
    """int64 labels (ignore value outside trained positions)."""
    images: np.ndarray
    """float32 (N, 3, H, W)."""


class PackedReader:
    """Reads a packed prefix through Megatron-Core's IndexedDataset, as NeMo's training does."""

    def __init__(self, prefix: Path):
        self.prefix = Path(prefix)
        self.meta = read_packed_meta(self.prefix)
        self.image_shape = tuple(self.meta["image_shape"])
        self.dataset = _megatron().IndexedDataset(str(self.prefix))
        self._multimodal = None

    def item_modes(self) -> np.ndarray:
        """The multimodal mode of every item (NeMo's reader ignores them; verify checks them)."""
        if self._multimodal is None:  # kept open: its memory map backs the returned array
            self._multimodal = _megatron().IndexedDataset(str(self.prefix), multimodal=True)
        return self._multimodal.index.sequence_modes

    def __len__(self) -> int:
        return len(self.dataset.document_indices) - 1

    def items_of(self, p: int) -> tuple[int, int]:
        """(first item, one past the last item) of pack p."""
        return int(self.dataset.document_indices[p]), int(self.dataset.document_indices[p + 1])

    def __getitem__(self, p: int) -> Pack:
        start = self.dataset.document_indices[p]
        return Pack(
            cu_seqlens=self.dataset[start + ITEM_CU_SEQLENS].astype(np.int64),
            tokens=self.dataset[start + ITEM_TOKENS].astype(np.int64),
            labels=self.dataset[start + ITEM_LABELS].astype(np.int64),
            images=self.dataset[start + ITEM_IMAGE].astype(np.float32).reshape(-1, *self.image_shape),
        )


def read_packed_meta(prefix: Path) -> dict:
    return _read_versioned(meta_path(prefix), PACKED_FORMAT, PACKED_FORMAT_VERSION)


def read_plan_table(prefix: Path) -> dict:
    with np.load(plan_path(prefix)) as table:
        return {key: table[key] for key in table.files}


def _read_versioned(path: Path, expected_format: str, supported_version: int) -> dict:
    from neva_pack.errors import InputError

    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing (the output is incomplete or not a neva_pack output)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from None
    if meta.get("format") != expected_format:
        raise InputError(f"{path}: format {meta.get('format')!r}, expected {expected_format!r}")
    if not isinstance(meta.get("version"), int) or meta["version"] > supported_version:
        raise InputError(f"{path}: version {meta.get('version')!r} is newer than this neva_pack reads ({supported_version})")
    return meta


def read_packs_from_index(prefix: Path, image_values: int) -> dict:
    """Per-pack sample lengths and image counts of any NeMo-layout prefix, meta or not.

    Reads only the small cu_seqlens items (and the image item of packs that carry exactly one
    image, to tell the zero image of an image-less pack from a real one).
    """
    dataset = _megatron().IndexedDataset(str(prefix))
    documents = dataset.document_indices
    sizes = dataset.index.sequence_lengths
    offsets, lengths, pack_images = [0], [], []
    for p in range(len(documents) - 1):
        first = int(documents[p])
        cu = dataset[first + ITEM_CU_SEQLENS].astype(np.int64)
        lengths.append(np.diff(cu))
        offsets.append(offsets[-1] + len(cu) - 1)
        images = int(sizes[first + ITEM_IMAGE]) // image_values
        if images == 1 and not np.any(dataset[first + ITEM_IMAGE]):
            images = 0
        pack_images.append(images)
    return {
        "offsets": np.asarray(offsets, dtype=np.int64),
        "length": np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        "pack_images": np.asarray(pack_images, dtype=np.int64),
    }
