"""Energon's WebDataset files, as ``energon prepare`` leaves them: what the energon format's writer
and reader need of tars, tar indexes and ``.nv-meta/``, apart from what a pack is.

    <dataset>/shard_000000.tar ...        ustar streams, one sample = consecutive members ``<key>.<part>``
    <dataset>/shard_000000.tar.idx ...    int64 byte offset of each sample, then where the last one ends
    <dataset>/.nv-meta/split.yaml         every shard in ``train`` (brace-collapsed, as prepare writes it)
    <dataset>/.nv-meta/.info.json         samples per shard, the Energon version
    <dataset>/.nv-meta/index.sqlite       Energon's ``samples`` and ``sample_parts`` tables
    <dataset>/.nv-meta/index.uuid         identifies the content (for Energon's caches)

Members carry no time, owner or PAX record (mtime 0, uid/gid 0, no names, mode 0644): a tar is a
function of its samples only.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import tarfile
import tokenize
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.core import parsing
from neva_pack.files import open_output, regular_output

__all__ = [
    "BLOCK", "ENERGON_VERSION", "META_DIR", "ShardIndex", "ShardSamples", "end_of_archive", "file_store_of", "member_header", "npy_array", "npy_bytes", "padded", "read_members", "sample_count", "shard_name",
    "write_nv_meta",
]  # fmt: skip

META_DIR = ".nv-meta"
ENERGON_VERSION = "7.4.1"
"""The Energon release whose ``prepare`` output these files reproduce."""
BLOCK, RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE


def shard_name(shard: int) -> str:
    return f"shard_{shard:06d}.tar"


def member_header(name: str, size: int) -> bytes:
    """A ustar member header that depends on the name and size only."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def padded(size: int) -> int:
    """Bytes a member's content takes in the tar (whole blocks)."""
    return -(-size // BLOCK) * BLOCK


def end_of_archive(size: int) -> bytes:
    """What ends a tar of ``size`` bytes so far: two zero blocks, padded to a whole record, as tarfile ends one."""
    return bytes(2 * BLOCK + (-(size + 2 * BLOCK) % RECORD))


def read_members(data: bytes) -> tuple[str, dict[str, bytes]]:
    """One sample's bytes (from its offset to the next) -> its key and ``{part: content}``; ValueError
    when they are not members of one key."""
    key, members, position = None, {}, 0
    while position < len(data):
        try:
            info = tarfile.TarInfo.frombuf(data[position : position + BLOCK], "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:  # not a ValueError: a damaged shard is one line like any other damage
            raise ValueError(f"a member header at byte {position} of the sample: {exc}") from None
        member_key, _, part = info.name.partition(".")
        if key not in (None, member_key):
            raise ValueError(f"member {info.name} inside sample {key}")
        key = member_key
        position += BLOCK
        members[part] = data[position : position + info.size]
        position += padded(info.size)
    if key is None:
        raise ValueError("an empty sample")
    return key, members


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as a ``.npy`` member."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def npy_array(value) -> np.ndarray:
    """A ``.npy`` member as Energon yields it: its bytes, or already decoded by Energon's default decoder."""
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.load(io.BytesIO(value), allow_pickle=False)
    except (SyntaxError, tokenize.TokenError, EOFError) as exc:  # an edited header: numpy parses it as a Python literal
        raise ValueError(f"a .npy member whose header does not parse ({type(exc).__name__}: {exc})") from None


class ShardSamples:
    """A dataset's samples by number, each read at the offset its shard's ``.tar.idx`` gives."""

    def __init__(self, dataset: Path):
        self.dataset = Path(dataset)
        info_file = self.dataset / META_DIR / ".info.json"
        with parsing(info_file):
            counts = json.loads(regular_output(info_file).read_text(encoding="utf-8"))["shard_counts"]
        self.shards = list(counts)
        self.starts = np.cumsum([0, *(int(n) for n in counts.values())])
        self.offsets = []
        for name in self.shards:
            index = self.dataset / (name + ".idx")
            with parsing(index):
                self.offsets.append(np.fromfile(regular_output(index), dtype="<i8"))
        self._files: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def path_of(self, n: int) -> Path:
        """The shard of sample n."""
        return self.dataset / self.shards[int(np.searchsorted(self.starts, n, side="right") - 1)]

    def read(self, n: int) -> tuple[str, dict[str, bytes]]:
        """Sample n's key and ``{part: content}``."""
        if not 0 <= n < len(self):
            raise IndexError(f"sample {n} of {len(self)}")
        shard = int(np.searchsorted(self.starts, n, side="right") - 1)
        local = n - int(self.starts[shard])
        with parsing(self.dataset / self.shards[shard]):
            if shard not in self._files:
                self._files[shard] = open_output(self.dataset / self.shards[shard])
            start, end = int(self.offsets[shard][local]), int(self.offsets[shard][local + 1])
            return read_members(os.pread(self._files[shard].fileno(), end - start, start))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardIndex:
    """Where every sample lies: what the tar indexes and ``index.sqlite`` are made of."""

    shard_counts: list[int]
    """Samples of each shard, in order."""
    sample_offsets: list[int]
    """Byte offset of each sample in its shard."""
    member_sizes: np.ndarray
    """int64 (samples, parts): content size of each member."""
    parts: tuple[str, ...]
    """The part names, in the order every sample's members are written."""
    keys: list[str]
    """Each sample's key."""

    def sample_bytes(self) -> np.ndarray:
        return (BLOCK + -(-self.member_sizes // BLOCK) * BLOCK).sum(axis=1)

    def write_tar_indexes(self, directory: Path) -> None:
        ends = np.cumsum([0, *self.shard_counts])
        offsets, sizes = np.asarray(self.sample_offsets, np.int64), self.sample_bytes()
        for s in range(len(self.shard_counts)):
            first, last = ends[s], ends[s + 1]
            values = np.append(offsets[first:last], offsets[last - 1] + sizes[last - 1]).astype("<i8")
            values.tofile(directory / (shard_name(s) + ".idx"))

    def rows(self) -> tuple[list, list]:
        """The rows of Energon's ``samples`` and ``sample_parts`` tables."""
        starts = np.cumsum([0, *self.shard_counts])
        samples, parts = [], []
        for p, (key, offset) in enumerate(zip(self.keys, self.sample_offsets)):
            shard = int(np.searchsorted(starts, p, side="right") - 1)
            local, position = p - int(starts[shard]), offset
            for name, size in zip(self.parts, self.member_sizes[p].tolist()):
                parts.append((shard, local, name, position + BLOCK, size))
                position += BLOCK + padded(size)
            samples.append((shard, key, local, offset, position - offset))
        return samples, parts


def write_nv_meta(directory: Path, index: ShardIndex, dataset_uuid: uuid.UUID, configs: dict[str, str]) -> None:
    """``.nv-meta/`` as ``energon prepare --split-parts train:<every shard>`` writes it, with ``configs``
    (file name -> text: the dataset.yaml and what it refers to)."""
    directory.mkdir()
    for name, text in configs.items():
        (directory / name).write_text(text)
    shards = [shard_name(s) for s in range(len(index.shard_counts))]
    train = "".join(f"  - {name}\n" for name in shards)
    if len(shards) > 1:
        train = "  - " + shard_name(0).replace(f"{0:06d}", f"{{{0:06d}..{len(shards) - 1:06d}}}") + "\n"
    (directory / "split.yaml").write_text(f"split_parts:\n  train:\n{train}exclude: []\n")
    info = {"energon_version": ENERGON_VERSION, "shard_counts": dict(zip(shards, index.shard_counts))}
    (directory / ".info.json").write_text(json.dumps(info, indent=2))
    (directory / "index.uuid").write_text(str(dataset_uuid))
    samples, parts = index.rows()
    db = sqlite3.connect(directory / "index.sqlite")
    try:
        db.execute("CREATE TABLE samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE, "
                   "sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER)")  # fmt: skip
        db.execute("CREATE TABLE sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT, "
                   "content_byte_offset INTEGER, content_byte_size INTEGER)")  # fmt: skip
        db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?)", samples)
        db.executemany("INSERT INTO sample_parts VALUES (?, ?, ?, ?, ?)", parts)
        db.execute("CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)")
        db.execute("CREATE INDEX idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)")
        db.execute("CREATE INDEX idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, "
                   "content_byte_offset, content_byte_size)")  # fmt: skip
        db.commit()
    finally:
        db.close()


def sample_count(path: Path) -> int | str:
    """Rows of ``index.sqlite``'s samples table (a string saying why, when unreadable)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
    except sqlite3.DatabaseError as error:
        return f"unreadable ({error})"
    finally:
        db.close()


_FILE_STORES: dict[tuple[str, int], object] = {}


def file_store_of(raw: dict):
    """Energon's ``WebdatasetFileStore`` of the dataset a raw sample comes from (its ``__sources__``):
    random access to any member by its full name. One per dataset and process (loader workers open their own)."""
    from megatron.energon.cache.file_store import WebdatasetFileStore

    dataset = raw["__sources__"][0].dataset_path
    key = (str(dataset), os.getpid())
    if key not in _FILE_STORES:
        _FILE_STORES[key] = WebdatasetFileStore(dataset)
    return _FILE_STORES[key]
