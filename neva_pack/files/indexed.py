"""Megatron-Core's IndexedDataset file format (.bin/.idx), written and read with NumPy alone.

Why: importing ``megatron.core`` costs seconds of CPU (it imports torch's and its own
submodules), taken from the encoding workers on a small machine or spent on the critical path
before the first pack is written. The format itself is a few arrays, so preprocessing writes it
here and never imports Megatron. Training, ``verify`` and ``PackedSeqDataset`` still read the output
with Megatron's own ``IndexedDataset`` (``formats/nemo.py`` Reader): the real consumer stays the
judge, and tests/files/test_indexed_format.py checks this module byte for byte against Megatron's
builder and reader.

    prefix.bin    the items' values back to back, in the dataset's dtype, nothing else
    prefix.idx    little-endian:
      b"MMIDIDX\\x00\\x00"           9 bytes, the magic
      u64 1                          format version
      u8  dtype code                 DTYPE_CODES below
      u64 S                          number of items ("sequences")
      u64 D                          number of document boundaries (documents + 1)
      i32 sequence_lengths[S]        values in each item
      i64 sequence_pointers[S]       byte offset of each item in .bin (running sum of the lengths)
      i64 document_indices[D]        item index where each document starts, then S: [0, ..., S]
      i8  sequence_modes[S]          multimodal files only: each item's mode (0 text, 1 image, ...)

    two documents, items of 3 and 2 values, then 4 values, int32:
      .bin = v0 v1 v2 | v3 v4 | v5 v6 v7 v8          sequence_lengths  = [3, 2, 4]
                                                      sequence_pointers = [0, 12, 20]
                                                      document_indices  = [0, 2, 3]
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from neva_pack.core import InputError
from neva_pack.files.output_file import OutputFile
from neva_pack.files.untrusted import regular_output

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
"""Megatron-Core's numeric code of each dtype in the .idx header."""
_HEADER = np.dtype([("magic", "S9"), ("version", "<u8"), ("code", "u1"), ("items", "<u8"), ("boundaries", "<u8")])
"""The fixed 34 bytes that open an .idx file."""
_COPY_CHUNK = 16 << 20


BIN_SUFFIX, IDX_SUFFIX = ".bin", ".idx"
"""Megatron's names of an indexed dataset's two files: ``prefix.bin``, ``prefix.idx``."""


def bin_path(prefix: Path) -> Path:
    """The values file of an indexed dataset ``prefix``."""
    return Path(str(prefix) + BIN_SUFFIX)


def idx_path(prefix: Path) -> Path:
    """The index file of an indexed dataset ``prefix``."""
    return Path(str(prefix) + IDX_SUFFIX)


def is_index(path: Path) -> bool:
    """Whether ``path`` is a file that starts as a Megatron index does (its magic)."""
    if not os.path.isfile(path):  # a FIFO would block the open
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(INDEX_MAGIC)) == INDEX_MAGIC
    except OSError:
        return False


class IndexedWriter:
    """Appends items to a .bin file and writes the matching .idx at ``finalize``.

    The same bytes as Megatron-Core's ``IndexedDatasetBuilder`` for the same calls (``add_item``,
    ``add_document``, ``end_document``, ``add_index``), without a torch tensor or a copy per
    item. ``write_item`` takes an item's values already in the dataset's dtype (written as is)
    and ``skip_item`` an all-zero item, left as a hole in the file (no disk blocks, no write).
    ``state()``, saved at a checkpoint, and the ``state=`` argument let a writer continue the file
    cut back to that checkpoint; ``checksum=True`` hashes the bytes as they are written.
    """

    def __init__(
        self, path: Path, dtype, multimodal: bool = False, *, state: dict | None = None, checksum: bool = False,
        buffered: bool = False, write_behind: bool = False,
    ):  # fmt: skip
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} is not one the IndexedDataset format stores")
        self.multimodal = multimodal
        if state is None:
            self.sequence_lengths: list[int] = []
            self.document_indices: list[int] = [0]
            self.sequence_modes: list[int] | None = [] if multimodal else None
        else:
            self.sequence_lengths = state["sequence_lengths"].tolist()
            self.document_indices = state["document_indices"].tolist()
            self.sequence_modes = state["sequence_modes"].tolist() if multimodal else None
        # the .bin: unbuffered unless ``buffered`` (many small items); a large output (write_behind,
        # unbuffered) streamed to disk past the page cache; hashed as written with ``checksum``
        try:
            self.file = OutputFile(
                self.path, resume_at=None if state is None else int(state["bytes"]), buffered=buffered,
                write_behind=write_behind and not buffered, checksum=checksum,
            )  # fmt: skip
        except ValueError as exc:
            raise InputError(str(exc)) from None

    @property
    def position(self) -> int:
        """Bytes of the .bin written (holes included)."""
        return self.file.position

    def _record(self, length: int, mode: int) -> None:
        self.sequence_lengths.append(length)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def _write(self, data) -> None:
        self.file.write(data)

    def add_item(self, values, mode: int = 0) -> None:
        """One item: ``values`` converted to the dataset's dtype (as Megatron's ``add_item``)."""
        self.write_item(np.ascontiguousarray(values, dtype=self.dtype), mode)

    def write_item(self, values: np.ndarray, mode: int = 0) -> None:
        """One item whose values are already a contiguous array of the dataset's dtype: written once, not copied."""
        if values.dtype != self.dtype or not values.flags.c_contiguous:
            raise ValueError(f"write_item takes a contiguous {self.dtype} array, not {values.dtype}")
        if values.size:
            self._write(values.data)
        self._record(values.size, mode)

    def write_items(self, values: np.ndarray, lengths, modes=None) -> None:
        """Consecutive items of one contiguous array of the dataset's dtype (one write), in the current document."""
        if values.dtype != self.dtype or not values.flags.c_contiguous or int(np.sum(lengths)) != values.size:
            raise ValueError(f"write_items takes a contiguous {self.dtype} array of sum(lengths) values")
        if values.size:
            self._write(values.data)
        for k, length in enumerate(lengths):
            self._record(int(length), 0 if modes is None else int(modes[k]))

    def add_document_bytes(self, data: bytes, lengths) -> None:
        """A whole document given as the raw bytes of its items' values (non-multimodal: mode 0)."""
        if len(data) != sum(lengths) * self.dtype.itemsize:
            raise ValueError(f"{len(data)} bytes for items of {list(lengths)} {self.dtype} values")
        if data:
            self._write(data)
        for length in lengths:
            self._record(length, 0)
        self.end_document()

    def add_documents_bytes(self, data, lengths: np.ndarray) -> None:
        """Whole documents given as the raw bytes of their items' values, concatenated, and an
        (documents, items per document) array of item lengths: one write and a few list extends
        for many small documents (the sample store's batches), not a call per document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(data) != int(lengths.sum()) * self.dtype.itemsize or lengths.ndim != 2:
            raise ValueError(f"{len(data)} bytes for documents of {lengths.shape} item lengths")
        if len(data):
            self._write(data)
        first = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.ravel().tolist())
        if self.multimodal:
            self.sequence_modes.extend([0] * lengths.size)
        self.document_indices.extend(range(first + lengths.shape[1], first + lengths.size + 1, lengths.shape[1]))

    def skip_item(self, count: int, mode: int = 0) -> None:
        """An item of ``count`` zeros, left as a hole: the file reads the same, nothing is written."""
        self.file.skip(count * self.dtype.itemsize)
        self._record(count, mode)

    def add_document(self, values, lengths, modes=None) -> None:
        """A whole document: its items' values concatenated, and each item's length."""
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.write_items(values, lengths, modes)
        self.end_document()

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, prefix: Path) -> None:
        """Append a whole dataset (its .bin copied, its index extended), as Megatron's ``add_index``."""
        index = read_index(idx_path(prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {index.dtype}, this dataset's is {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths += index.sequence_lengths.tolist()
        self.document_indices += (index.document_indices[1:] + offset).tolist()
        if self.multimodal:
            self.sequence_modes += index.sequence_modes.tolist()
        self.flush()
        with open(bin_path(prefix), "rb") as source:
            while chunk := source.read(_COPY_CHUNK):
                self._write(chunk)

    def flush(self) -> None:
        """Write out what is buffered and materialise a trailing hole: the file's size is ``position``."""
        self.file.flush()

    def sync(self) -> None:
        """Make the bytes written so far durable (a checkpoint or a publish depends on them)."""
        self.file.sync()

    def state(self) -> dict[str, np.ndarray]:
        """What ``IndexedWriter(..., state=)`` needs to continue after this point (call ``sync`` first)."""
        state = {
            "bytes": np.int64(self.position),
            "sequence_lengths": np.asarray(self.sequence_lengths, dtype=np.int64),
            "document_indices": np.asarray(self.document_indices, dtype=np.int64),
        }
        if self.multimodal:
            state["sequence_modes"] = np.asarray(self.sequence_modes, dtype=np.int64)
        return state

    def finalize(self, path: Path, sync: bool = True) -> None:
        """Close the .bin (durable when ``sync``) and write the .idx at ``path``."""
        self.file.close(sync=sync)
        write_index(path, self.dtype, self.sequence_lengths, self.document_indices, self.sequence_modes, sync=sync)

    def checksum(self) -> str:
        """xxh3-128 hex digest of the .bin (a writer created with ``checksum=True``): store.file_checksum's value."""
        return self.file.checksum()

    def close(self) -> None:
        """Abandon the writer (the files stay as they are)."""
        self.file.abandon()


def write_index(path: Path, dtype, sequence_lengths, document_indices, sequence_modes=None, sync: bool = True) -> None:
    """The .idx file of items of these lengths (and modes, for a multimodal dataset)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    header = np.array([(INDEX_MAGIC, INDEX_VERSION, DTYPE_CODES[dtype], len(lengths), len(document_indices))], dtype=_HEADER)
    parts = [header, lengths.astype("<i4"), pointers.astype("<i8"), np.asarray(document_indices, dtype="<i8")]
    if sequence_modes is not None:
        parts.append(np.asarray(sequence_modes, dtype=np.int8))
    with open(path, "wb") as f:
        for part in parts:
            f.write(part.tobytes())
        if sync:
            f.flush()
            os.fsync(f.fileno())


class Index:
    """The arrays of an .idx file (read-only views of one read of the file)."""

    def __init__(self, dtype, sequence_lengths, sequence_pointers, document_indices, sequence_modes):
        self.dtype = dtype
        """dtype of the values in .bin."""
        self.sequence_lengths = sequence_lengths
        """int32 values in each item."""
        self.sequence_pointers = sequence_pointers
        """int64 byte offset of each item in .bin."""
        self.document_indices = document_indices
        """int64 first item of each document, then the number of items."""
        self.sequence_modes = sequence_modes
        """int8 mode of each item (multimodal), or None."""


def read_index(path: Path, multimodal: bool = False) -> Index:
    """The arrays of an .idx file; InputError naming the file if it is not one."""
    path = Path(path)
    data = regular_output(path).read_bytes()
    if len(data) < _HEADER.itemsize:
        raise InputError(f"{path}: {len(data)} bytes, too short for an IndexedDataset index")
    header = np.frombuffer(data, dtype=_HEADER, count=1)[0]
    if data[:9] != INDEX_MAGIC or int(header["version"]) != INDEX_VERSION:
        raise InputError(f"{path}: not an IndexedDataset index (magic {data[:9]!r}, version {int(header['version'])})")
    dtypes = {code: dtype for dtype, code in DTYPE_CODES.items()}
    if int(header["code"]) not in dtypes:
        raise InputError(f"{path}: unknown dtype code {int(header['code'])}")
    items, boundaries = int(header["items"]), int(header["boundaries"])
    need = _HEADER.itemsize + 12 * items + 8 * boundaries + (items if multimodal else 0)
    if len(data) < need:
        raise InputError(f"{path}: {len(data)} bytes, its header announces {need}")
    offset = _HEADER.itemsize
    lengths = np.frombuffer(data, dtype="<i4", count=items, offset=offset)
    offset += 4 * items
    pointers = np.frombuffer(data, dtype="<i8", count=items, offset=offset)
    offset += 8 * items
    documents = np.frombuffer(data, dtype="<i8", count=boundaries, offset=offset)
    offset += 8 * boundaries
    modes = np.frombuffer(data, dtype=np.int8, count=items, offset=offset) if multimodal else None
    return Index(dtypes[int(header["code"])], lengths, pointers, documents, modes)


class IndexedReader:
    """Reads items of a .bin/.idx pair: memory-mapped (``mmap=True``) or with one file read per call.

    Used where the pipeline reads its own files (the sample store); what a trainer reads is read
    with Megatron's ``IndexedDataset`` (formats/nemo.py).
    """

    def __init__(self, prefix: Path, multimodal: bool = False, mmap: bool = False):
        self.prefix = Path(prefix)
        self.index = read_index(idx_path(prefix), multimodal=multimodal)
        self.dtype = self.index.dtype
        self.sequence_lengths = self.index.sequence_lengths
        self.sequence_pointers = self.index.sequence_pointers
        self.document_indices = self.index.document_indices
        self.sequence_modes = self.index.sequence_modes
        self._map = None
        self._fd = None
        regular_output(bin_path(prefix))
        if mmap:
            size = os.path.getsize(bin_path(prefix))
            self._map = np.memmap(bin_path(prefix), dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        else:
            self._fd = os.open(bin_path(prefix), os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def _read(self, offset: int, count: int) -> np.ndarray:
        size = count * self.dtype.itemsize
        if self._map is not None:
            return self._map[offset : offset + size].view(self.dtype)
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise InputError(f"{bin_path(self.prefix)}: ends at byte {offset + len(data)}, its index needs {offset + size}")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, i: int) -> np.ndarray:
        """The values of item i."""
        return self._read(int(self.sequence_pointers[i]), int(self.sequence_lengths[i]))

    def items(self, first: int, count: int) -> list[np.ndarray]:
        """Items first .. first + count - 1 (consecutive in .bin), read at once."""
        if count == 0:
            return []
        lengths = self.sequence_lengths[first : first + count]
        values = self._read(int(self.sequence_pointers[first]), int(lengths.sum()))
        return np.split(values, np.cumsum(lengths[:-1]))

    def raw_document(self, d: int) -> tuple[np.ndarray, list[int]]:
        """Document d's values in one array (one read), and the length of each of its items."""
        first, end = int(self.document_indices[d]), int(self.document_indices[d + 1])
        lengths = self.sequence_lengths[first:end].tolist()
        if not lengths:
            return np.zeros(0, dtype=self.dtype), lengths
        return self._read(int(self.sequence_pointers[first]), sum(lengths)), lengths

    def raw_documents(self, documents: np.ndarray, items: int) -> tuple[np.ndarray, np.ndarray]:
        """Documents of ``items`` items each, one read per document: their values concatenated in
        the order asked, and an int64 (len(documents), items) table of their items' lengths."""
        documents = np.asarray(documents, dtype=np.int64)
        first = self.document_indices[documents].astype(np.int64)
        if np.any(self.document_indices[documents + 1] - first != items):
            bad = int(documents[np.flatnonzero(self.document_indices[documents + 1] - first != items)[0]])
            raise InputError(f"{idx_path(self.prefix)}: document {bad} does not have {items} items")
        lengths = self.sequence_lengths[first[:, None] + np.arange(items)].astype(np.int64)
        counts = lengths.sum(axis=1)
        if self._map is not None or len(documents) == 0:
            parts = [self._read(int(p), int(c)) for p, c in zip(self.sequence_pointers[first].tolist(), counts.tolist())]
            return (np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)), lengths
        size = self.dtype.itemsize
        pointers, sizes = self.sequence_pointers[first].tolist(), (counts * size).tolist()
        reads = [os.pread(self._fd, n, offset) for offset, n in zip(pointers, sizes)]
        data = b"".join(reads)
        if len(data) != sum(sizes):
            short = next(k for k, (read, n) in enumerate(zip(reads, sizes)) if len(read) != n)
            self._read(pointers[short], sizes[short] // size)  # raises: the file ends before this document
        return np.frombuffer(data, dtype=self.dtype), lengths

    def document(self, d: int) -> list[np.ndarray]:
        """The items of document d."""
        first, end = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return self.items(first, end - first)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._map = None

    def __del__(self):
        self.close()
