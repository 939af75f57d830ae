"""NeMo's packed layout (NevaPackedSeqDatatset reads it as is)::

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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.formats.common import megatron as _megatron
from neva_pack.formats.common import read_versioned as _read_versioned
from neva_pack.formats.common import torch_view as _torch_view
from neva_pack.store import (
    CHECKPOINT_SUFFIX,
    CHECKSUM,
    PLAN_SUFFIX,
    bin_path,
    file_checksum,
    idx_path,
    meta_path,
    plan_path,
    tmp_prefix,
    write_json_atomic,
)

PACKED_FORMAT = "neva_pack.packed_seq_dataset"
PACKED_FORMAT_VERSION = 1
PACKED_DTYPE = np.float32
"""NeMo's builder dtype for every item, ids included (exact below 2**24)."""
ITEMS_PER_PACK = 4
ITEM_CU_SEQLENS, ITEM_TOKENS, ITEM_LABELS, ITEM_IMAGE = range(ITEMS_PER_PACK)
IMAGE_MODE = 1
"""Megatron-Core multimodal mode of the image item (text items are mode 0)."""
PACK_MODES = (0, 0, 0, IMAGE_MODE)


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
        self._checkpoint = Path(str(self._tmp) + CHECKPOINT_SUFFIX)
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
