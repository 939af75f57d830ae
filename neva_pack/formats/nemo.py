"""NeMo's packed layout (NevaPackedSeqDatatset reads it as is)::

    output_dir/packed_seq_dataset.bin/.idx      Megatron-Core IndexedDataset, float32, multimodal
      document p (one per pack), 4 items:
        +0 cu_seqlens  [0, l1, l1+l2, ..., total]             mode 0
        +1 tokens      concatenated sample tokens             mode 0
        +2 labels      concatenated sample labels             mode 0
        +3 image       (num_images * 3 * H * W) normalised    mode 1  (one zero image if the pack has none)
    output_dir/packed_seq_dataset.plan.npz      which input records each pack holds (offsets,
                                                record_index, length, padded_length, num_images)
    output_dir/packed_seq_dataset.meta.json     written last: the mark of a complete output, with
                                                the checksum (xxh3-128) of every other output file

    pack with samples of length 5 and 3 (8 positions), one image in the first sample:
      cu_seqlens = [0, 5, 8]   tokens = [a a a a a | b b b]   image = [img_a]

Images are stored normalised, float32: 4 bytes per value, every instance of an image again.
With padding (pad_to_multiple_of 4 above) the samples take [0, 8, 12]: each sample's tokens
are followed by pad ids (labels: the ignore value) and cu_seqlens holds the padded boundaries.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.files import (
    BIN_SUFFIX, IDX_SUFFIX, IndexedWriter, META_SUFFIX, PLAN_SUFFIX, bin_path, data_extents, idx_path, is_index,
    meta_path, packed_prefix, plan_path, read_index, regular_output
)
from neva_pack.core import InputError
from neva_pack.formats.base import Checkpoint, Limits, PrefixFiles, WriteSpec, meta_is_of, prefix_files, publish, published_as
from neva_pack.formats.common import megatron as _megatron
from neva_pack.formats.meta import PackedMeta, ReadPack, read_meta
from neva_pack.packing import PlanTable, padded_view, read_plan_table, write_plan_table

__all__ = [
    "FORMAT", "NemoFormat", "PreparedPacks", "Reader", "Writer", "indexed_dataset", "prefix_without_meta",
    "read_packs_from_index",
]  # fmt: skip

NAME = "nemo"
PACKED_DTYPE = np.float32
"""NeMo's builder dtype for every item, ids included (exact below 2**24)."""
EXACT_FLOAT32 = 2**24
"""float32 holds every integer up to 2**24 in magnitude, not all beyond: the largest pack (its
cu_seqlens), token id and label this format stores."""
SUFFIXES = (BIN_SUFFIX, IDX_SUFFIX, PLAN_SUFFIX)
"""Its files beside the meta: the IndexedDataset (Megatron's names) and the plan table."""
ITEMS_PER_PACK = 4
ITEM_CU_SEQLENS, ITEM_TOKENS, ITEM_LABELS, ITEM_IMAGE = range(ITEMS_PER_PACK)
IMAGE_MODE = 1
"""Megatron-Core multimodal mode of the image item (text items are mode 0)."""
PACK_MODES = (0, 0, 0, IMAGE_MODE)
QUEUED_PACKS = 2
"""Hand-overs queued ahead of the writer thread (each holds at most one pack's uint8 pixels)."""
TEXT_PACKS_PER_HANDOFF = 32
"""Image-less packs handed to the writer thread together: one hand-over a pack cost more than
writing it (a thread switch through the GIL each, on cores the assembling workers keep busy)."""


class Writer:
    """Writes packs in NeMo's layout under temporary names; ``publish`` renames them into place.

    ``checkpoint()`` makes the packs written so far durable; a writer created with
    ``resume=True`` for the same plan continues after the last checkpoint, appending to the
    same file, so the result is byte-identical to an uninterrupted run.

    The same bytes as Megatron's builder fed each item as float32, written more cheaply:

    - a pack's cu_seqlens, tokens and labels are converted once into one float32 buffer and
      written with one call; its images are normalised into a reused buffer and written from it;
    - the zero image of an image-less pack is a hole in the file (a seek, no write, no disk blocks);
    - a thread normalises and writes pack k while the caller assembles pack k + 1 (the numba
      kernel, the write and the hash release the GIL); ``checkpoint`` and ``publish`` wait for it;
    - the .bin's checksum is computed as it is written, not by reading the file again at publish.
    """

    def __init__(self, prefix: Path, spec: WriteSpec, resume: bool = False):
        self.prefix = Path(prefix)
        self.spec = spec
        self._checkpoint = Checkpoint(self.prefix, spec.plan_digest)
        self._tmp = self._checkpoint.tmp
        state, _ = self._checkpoint.start([bin_path(self._tmp)], resume)
        if state is None:
            self._data = IndexedWriter(bin_path(self._tmp), PACKED_DTYPE, multimodal=True, checksum=True, write_behind=True)
            self.num_packs = 0
        else:  # continue the file cut back to the last checkpoint
            state = {**state, "bytes": state["bytes"][0]}
            self._data = IndexedWriter(
                bin_path(self._tmp), PACKED_DTYPE, multimodal=True, state=state, checksum=True, write_behind=True
            )
            self.num_packs = int(state["packs"])
        self._image_values = int(np.prod(spec.image_shape))
        self._values = np.empty(0, dtype=PACKED_DTYPE)  # the normalised images of the pack being written
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUED_PACKS)
        self._pending: list = []  # packs not yet handed to the writer thread
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def add(self, pack) -> None:
        """One assembled pack: padded tokens/labels, padded cu_seqlens, normalised float32 images."""
        self.add_prepared(prepare([pack], self.spec), [pack.pixels])

    def add_prepared(self, prepared: "PreparedPacks", pixels) -> None:
        """Packs as ``prepare`` gave them, and each pack's uint8 pixels (an iterable read pack by
        pack: a lazy one keeps one pack's pixels in memory at a time)."""
        self._raise_failure()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_packs, name="nemo-writer", daemon=True)
            self._thread.start()
        ends = np.cumsum(prepared.item_lengths.sum(axis=1)).tolist()
        for k, pack_pixels in zip(range(len(ends)), pixels, strict=True):
            text = prepared.text[ends[k - 1] if k else 0 : ends[k]]
            self._pending.append((text, tuple(prepared.item_lengths[k].tolist()), pack_pixels))
            self.num_packs += 1
            if len(self._pending) >= TEXT_PACKS_PER_HANDOFF or (pack_pixels is not None and len(pack_pixels)):
                self._hand_over()

    def _hand_over(self) -> None:
        if self._pending:
            self._queue.put(self._pending)
            self._pending = []

    def _write_packs(self) -> None:
        """The writer thread: lists of packs from the queue, in order, until None; the first failure is kept for the caller."""
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                for pack in job if self._failure is None else ():
                    self._write(*pack)
            except BaseException as exc:  # re-raised in the caller's thread by _raise_failure
                self._failure = exc
            finally:
                self._queue.task_done()

    def _write(self, text: np.ndarray, lengths: tuple[int, int, int], pixels: np.ndarray | None) -> None:
        data = self._data
        data.write_items(text, lengths, PACK_MODES[:3])
        if pixels is None or len(pixels) == 0:
            data.skip_item(self._image_values, IMAGE_MODE)  # one zero image, as a hole
        else:
            if pixels.shape[1:] != tuple(self.spec.image_shape):
                raise ValueError(f"pack images of shape {pixels.shape[1:]}, the output's are {tuple(self.spec.image_shape)}")
            if len(self._values) < pixels.size:
                self._values = np.empty(pixels.size, dtype=PACKED_DTYPE)
            values = self._values[: pixels.size]
            self.spec.normalisation.apply(pixels, out=values.reshape(pixels.shape))
            data.write_item(values, IMAGE_MODE)
        data.end_document()

    def _drain(self) -> None:
        """Wait until every pack added is written; raise what the writer thread raised."""
        if self._thread is not None:
            self._hand_over()
            self._queue.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def checkpoint(self) -> None:
        self._drain()
        self._data.flush()
        state = self._data.state()
        del state["bytes"]  # the checkpoint saves the file's size itself
        self._checkpoint.save([self._data.file], packs=np.int64(self.num_packs), **state)

    def publish(self, plan: PlanTable, extra_files: list[Path], meta: PackedMeta) -> PackedMeta:
        """Finalize; write the plan table; rename .bin/.idx into place; write the meta last."""
        self._drain()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._data.finalize(idx_path(self._tmp))
        tmp_plan = plan_path(self._tmp)
        write_plan_table(tmp_plan, plan)
        renames = {
            plan_path(self.prefix): tmp_plan,
            bin_path(self.prefix): bin_path(self._tmp),
            idx_path(self.prefix): idx_path(self._tmp),
        }
        meta = meta.replace(format=NAME, num_packs=self.num_packs, layout={})
        meta = publish(self.prefix, renames, extra_files, meta, known={bin_path(self._tmp): self._data.checksum()})
        self._checkpoint.remove()
        return meta


@dataclass(frozen=True, slots=True)
class PreparedPacks:
    """Packs' text items as float32, what ``Writer.add_prepared`` writes with their images.
    ``prepare`` is pure, so that the processes that assemble the packs can run it."""

    text: np.ndarray
    """float32: each pack's cu_seqlens, tokens and labels, pack after pack."""
    item_lengths: np.ndarray
    """int64 (packs, 3): the lengths of those three items of each pack."""


def prepare(packs, spec: WriteSpec) -> PreparedPacks:
    """The packs' padded cu_seqlens, tokens and labels, converted once into one float32 array."""
    parts, lengths = [], []
    for pack in packs:
        boundaries = len(pack.padded_lengths) + 1
        total = int(np.sum(pack.padded_lengths))
        text = np.empty(boundaries + 2 * total, dtype=PACKED_DTYPE)
        text[0] = 0
        text[1:boundaries] = np.cumsum(pack.padded_lengths)
        tokens, labels = padded_view(pack, spec.pad_id, spec.ignore_index)
        text[boundaries : boundaries + total] = tokens
        text[boundaries + total :] = labels
        parts.append(text)
        lengths.append((boundaries, total, total))
    return PreparedPacks(
        text=np.concatenate(parts) if parts else np.zeros(0, dtype=PACKED_DTYPE),
        item_lengths=np.array(lengths, dtype=np.int64).reshape(-1, 3),
    )


class Reader:
    """Reads a packed prefix through Megatron-Core's IndexedDataset, as NeMo's training does.

    With its file reader (``mmap=False``), not the memory map: a fault on a page not cached reads
    ahead up to megabytes, and after an image-less pack's text comes its zero image, a hole, which
    readahead fills the page cache with (a text-only output is mostly such holes, so a read of an
    output no longer cached would read many times its data). The bytes read are the same."""

    def __init__(self, prefix: Path, meta: PackedMeta | None = None):
        self.prefix = Path(prefix)
        self.meta = meta if meta is not None else read_meta(meta_path(self.prefix))
        self.image_shape = tuple(self.meta.image_shape)
        self.dataset = indexed_dataset(self.prefix)
        self._plan = None
        self._multimodal = None
        self._holes: _Holes | None = None

    def plan_table(self) -> PlanTable:
        if self._plan is None:
            self._plan = read_plan_table(plan_path(self.prefix))
        return self._plan

    def item_modes(self) -> np.ndarray:
        """The multimodal mode of every item (NeMo's reader ignores them; verify checks them)."""
        if self._multimodal is None:  # kept open: its memory map backs the returned array
            self._multimodal = indexed_dataset(self.prefix, multimodal=True)
        return self._multimodal.index.sequence_modes

    def __len__(self) -> int:
        return len(self.dataset.document_indices) - 1

    def items_of(self, p: int) -> tuple[int, int]:
        """(first item, one past the last item) of pack p."""
        return int(self.dataset.document_indices[p]), int(self.dataset.document_indices[p + 1])

    def pack(self, p: int, images: bool = True) -> ReadPack:
        start = int(self.dataset.document_indices[p])
        plan = self.plan_table()
        first, last = plan.offsets[p], plan.offsets[p + 1]
        values = int(self.dataset.index.sequence_lengths[start + ITEM_IMAGE])
        stored = values // int(np.prod(self.image_shape))
        real = int(plan.num_images[first:last].sum())
        with np.errstate(invalid="ignore"):  # a damaged value (NaN, inf) becomes an id verify reports, without a warning
            cu_seqlens, tokens, labels = (self.dataset[start + item].astype(np.int64) for item in range(ITEM_IMAGE))
        return ReadPack(
            cu_seqlens=cu_seqlens,
            cu_seqlens_unpadded=np.concatenate([[0], np.cumsum(plan.length[first:last])]).astype(np.int64),
            tokens=tokens,
            labels=labels,
            pixels=None,
            images=self.dataset[start + ITEM_IMAGE].astype(np.float32).reshape(-1, *self.image_shape) if images else None,
            num_images=stored if real or stored != 1 else 0,
        )

    def images(self, p: int, device=None, dtype=None):
        """The pack's image item as a (N, 3, H, W) tensor (stored normalised, float32)."""
        import torch

        start = int(self.dataset.document_indices[p])
        values = torch.from_numpy(self.dataset[start + ITEM_IMAGE].astype(np.float32).reshape(-1, *self.image_shape))
        return values if device is None and dtype is None else values.to(device=device, dtype=dtype)

    def zero_item(self, i: int) -> bool:
        """Whether item i is all zeros. What of it lies in a hole of the .bin is zeros without
        reading it (the writer leaves the zero image of an image-less pack as a hole); the rest
        is read through the IndexedDataset."""
        if self._holes is None:
            self._holes = _Holes(bin_path(self.prefix))
        return self._holes.zero_item(self.dataset, i)

    def close(self) -> None:
        self.dataset = self._multimodal = None


def check(reader: Reader, result) -> None:
    """NeMo's layout: 4 items with modes (0, 0, 0, 1) per pack, whole images, the zero image of an image-less pack."""
    image_size = int(np.prod(reader.image_shape))
    modes = reader.item_modes()
    sizes = reader.dataset.index.sequence_lengths
    plan = reader.plan_table()
    for p in range(len(reader)):
        first, last = reader.items_of(p)
        if last - first != ITEMS_PER_PACK:
            result.add(f"pack {p}: {last - first} items, expected {ITEMS_PER_PACK}")
            continue
        if tuple(int(m) for m in modes[first:last]) != PACK_MODES:
            result.add(f"pack {p}: item modes {list(modes[first:last])}, expected {list(PACK_MODES)}")
        values = int(sizes[first + ITEM_IMAGE])
        if values % image_size or values == 0:
            result.add(f"pack {p}: image item of {values} values is not whole (3, H, W) images")
        elif p + 1 < len(plan.offsets) and plan.num_images[plan.offsets[p] : plan.offsets[p + 1]].sum() == 0:
            if values != image_size or not reader.zero_item(first + ITEM_IMAGE):
                result.add(f"pack {p}: no image, so one zero image was expected")


def indexed_dataset(prefix: Path, multimodal: bool = False):
    """Megatron-Core's IndexedDataset of the prefix (file reads: no readahead into holes, see Reader),
    once the .idx parses and the .bin holds every item it lists: built on a missing or cut file,
    Megatron's fails in many ways (and complains again from ``__del__``); this names the file."""
    bin_file, idx_file = bin_path(prefix), idx_path(prefix)
    for path in (bin_file, idx_file):
        if not path.is_file():
            raise InputError(f"{path}: missing")
    index = read_index(idx_file, multimodal=multimodal)
    lengths, pointers, documents = index.sequence_lengths, index.sequence_pointers, index.document_indices
    ends = pointers + lengths.astype(np.int64) * np.dtype(index.dtype).itemsize
    if np.any(lengths < 0) or np.any(pointers < 0) or np.any(ends > bin_file.stat().st_size):
        size = bin_file.stat().st_size
        raise InputError(f"{idx_file}: lists items beyond the {size} bytes of {bin_file.name} (one is cut or damaged)")
    if len(documents) == 0 or documents[0] != 0 or np.any(np.diff(documents) < 0) or documents[-1] != len(lengths):
        raise InputError(f"{idx_file}: damaged (its documents are not increasing item numbers)")
    return _megatron().IndexedDataset(str(prefix), multimodal=multimodal, mmap=False)


def read_packs_from_index(prefix: Path, image_values: int) -> dict:
    """Per-pack sample lengths and image counts of any NeMo-layout prefix, meta or not.

    Reads only the small cu_seqlens items (and the image item of packs that carry exactly one
    image, to tell the zero image of an image-less pack from a real one). Nothing vouches for a
    prefix without meta (no checksums): what is read is checked to be NeMo's layout (4 items per
    pack, cu_seqlens whole numbers rising from 0 to at most the pack's tokens, whole images), so
    that a damaged one is refused rather than summarised into impossible figures.
    """
    dataset = indexed_dataset(prefix)
    holes = _Holes(bin_path(prefix))
    documents = dataset.document_indices
    sizes = dataset.index.sequence_lengths
    if np.any(np.diff(documents) != ITEMS_PER_PACK):
        raise InputError(f"{idx_path(prefix)}: not NeMo's packed layout (packs of {ITEMS_PER_PACK} items)")
    offsets, lengths, pack_images = [0], [], []
    for p in range(len(documents) - 1):
        first = int(documents[p])
        values = dataset[first + ITEM_CU_SEQLENS]
        tokens = int(sizes[first + ITEM_TOKENS])
        if not (len(values) and np.all(np.isfinite(values)) and np.all(values == np.round(values)) and values[0] == 0
                and np.all(np.diff(values) >= 0) and values[-1] <= tokens):  # fmt: skip
            raise InputError(f"{bin_path(prefix)}: pack {p}'s cu_seqlens are not whole numbers rising from 0 to at most "
                             f"its {tokens} tokens (damaged, or not NeMo's packed layout)")  # fmt: skip
        cu = values.astype(np.int64)
        lengths.append(np.diff(cu))
        offsets.append(offsets[-1] + len(cu) - 1)
        if int(sizes[first + ITEM_IMAGE]) % image_values:
            raise InputError(f"{idx_path(prefix)}: pack {p}'s image item of {int(sizes[first + ITEM_IMAGE])} values is not "
                             f"whole images of {image_values} values (another --crop_size?)")  # fmt: skip
        images = int(sizes[first + ITEM_IMAGE]) // image_values
        if images == 1 and holes.zero_item(dataset, first + ITEM_IMAGE):
            images = 0
        pack_images.append(images)
    return {
        "offsets": np.asarray(offsets, dtype=np.int64),
        "length": np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        "pack_images": np.asarray(pack_images, dtype=np.int64),
    }


class _Holes:
    """Where a .bin's holes are (read once), to tell an all-zero item without reading its holes."""

    def __init__(self, path: Path):
        with open(regular_output(path), "rb", buffering=0) as f:
            self.size = os.fstat(f.fileno()).st_size
            extents = data_extents(f.fileno(), self.size)
        self.known = extents is not None  # else: every item is read
        self.starts = np.asarray([start for start, _ in extents or ()], dtype=np.int64)
        self.ends = np.asarray([end for _, end in extents or ()], dtype=np.int64)

    def zero_item(self, dataset, i: int) -> bool:
        """Whether item i of ``dataset`` (an IndexedDataset of this .bin) is all zeros; its parts in data extents are read."""
        itemsize = np.dtype(dataset.index.dtype).itemsize
        start = int(dataset.index.sequence_pointers[i])
        end = start + int(dataset.index.sequence_lengths[i]) * itemsize
        if not self.known or end > self.size:  # past the end: the dataset's read fails, as it should
            return not np.any(dataset[i])
        k = int(np.searchsorted(self.ends, start, side="right"))  # the first extent ending after start
        while k < len(self.starts) and self.starts[k] < end:
            first = (max(int(self.starts[k]), start) - start) // itemsize
            last = -(-(min(int(self.ends[k]), end) - start) // itemsize)
            if np.any(dataset.get(i, offset=first, length=last - first)):
                return False
            k += 1
        return True


def prefix_without_meta(path: Path) -> Path:
    """A prefix in NeMo's layout that another tool wrote (no meta): ``path`` itself, or the
    directory's packed_seq_dataset; InputError when neither has a .bin."""
    path = Path(path)
    prefix = path if bin_path(path).is_file() else packed_prefix(path)
    if not bin_path(prefix).is_file():
        raise InputError(f"{path}: no {prefix.name}{BIN_SUFFIX}/{IDX_SUFFIX} nor {prefix.name}{META_SUFFIX} here")
    return prefix


class NemoFormat:
    """NeMo's float32 layout (``PackedFormat``): what NeMo 1's NevaPackedSeqDatatset reads as is."""

    name = NAME
    description = "NeMo's float32 packed_seq_dataset .bin/.idx (NeMo 1.x NeVA's data_prefix reads it)"
    needs_pixels = True
    """The writer stores every image instance's values: assembly reads the pixels."""
    uses_image_pool = False
    holds_images = True
    holds_dynamic_images = False
    """NeMo's reader reshapes one float32 item to (-1, 3, crop_h, crop_w): one crop size for every image."""
    holds_videos = False
    limits = Limits(
        max_pack=EXACT_FLOAT32,
        max_integer=EXACT_FLOAT32,
        why="2**24: NeMo's format stores ids, labels and cu_seqlens as float32, exact only up to there",
    )

    def check_settings(self, **settings) -> None:
        self.limits.check(**settings)

    def files(self, prefix: Path) -> PrefixFiles:
        return prefix_files(prefix, SUFFIXES, plan_table_suffix=PLAN_SUFFIX)

    def trusted_files(self, prefix: Path, meta: PackedMeta) -> tuple[Path, ...]:
        """The index (every item's size and offset in the .bin) and the plan table, not the .bin."""
        return idx_path(prefix), plan_path(prefix)

    def owns(self, path: Path) -> bool:
        path = Path(path)
        if path.is_symlink() or not path.is_file():
            return False
        name = path.name
        prefix = path.with_name(name.split(".", 1)[0])
        files = self.files(prefix)
        if path in files.temporary:
            return True  # its temporary names
        if path == meta_path(prefix):
            return meta_is_of(path, NAME)
        if path == idx_path(prefix):
            return is_index(path)
        if path == bin_path(prefix):  # its index beside it, or (killed between the renames) the meta being published
            return is_index(idx_path(prefix)) or published_as(prefix, NAME)
        if path == plan_path(prefix):
            return _is_zip(path)
        return False

    # the contract's writer(prefix, spec, resume), reader(prefix, meta), prepare(packs, spec) and
    # check(reader, result) are this module's own
    writer = staticmethod(Writer)
    reader = staticmethod(Reader)
    prepare = staticmethod(prepare)
    check = staticmethod(check)

    def summary_line(self, data_prefix: str) -> str:
        return f"{data_prefix}.{{{BIN_SUFFIX[1:]},{IDX_SUFFIX[1:]}}}"


def _is_zip(path: Path) -> bool:
    if not path.is_file():  # a FIFO would block the open
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


FORMAT = NemoFormat()
