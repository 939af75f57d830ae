"""The one place that knows the on-disk layouts: file names, item order, dtypes, modes, meta.

Packed output (NeMo's NevaPackedSeqDatatset reads it as is)::

    output_dir/packed_seq_dataset.bin/.idx      Megatron-Core IndexedDataset, float32, multimodal
      document p (one per pack), 4 items:
        +0 cu_seqlens  [0, l1, l1+l2, ..., total]             mode 0
        +1 tokens      concatenated sample tokens             mode 0
        +2 labels      concatenated sample labels             mode 0
        +3 image       (num_images * 3 * H * W) normalised    mode 1  (one zero image if the pack has none)
    output_dir/packed_seq_dataset.meta.json     written last: the mark of a complete output

    pack with samples of length 5 and 3 (8 positions), one image in the first sample:
      cu_seqlens = [0, 5, 8]   tokens = [a a a a a | b b b]   image = [img_a]

Sample store (intermediate, ours)::

    output_dir/packed_seq_dataset/
      samples_text.bin/.idx     IndexedDataset int32, document i = sample i: [tokens, labels]
      samples_images.bin/.idx   IndexedDataset uint8, document i = sample i: one item per image,
                                (3, H, W) after resize/crop/pad, before rescale/normalise
      samples.rows              raw little-endian SAMPLE_ROW records, one per sample, in store order
      store.json                written last: the mark of a complete store
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PACKED_NAME = "packed_seq_dataset"
"""Prefix name of the packed output (NeMo's)."""
META_SUFFIX = ".meta.json"
PACKED_FORMAT = "neva_pack.packed_seq_dataset"
PACKED_FORMAT_VERSION = 1
PACKED_DTYPE = np.float32
"""NeMo's builder dtype for every item, ids included (exact below 2**24)."""
ITEMS_PER_PACK = 4
ITEM_CU_SEQLENS, ITEM_TOKENS, ITEM_LABELS, ITEM_IMAGE = range(ITEMS_PER_PACK)
IMAGE_MODE = 1
"""Megatron-Core multimodal mode of the image item (text items are mode 0)."""

STORE_DIR = PACKED_NAME
STORE_FORMAT = "neva_pack.sample_store"
STORE_FORMAT_VERSION = 1
STORE_TEXT = "samples_text"
STORE_IMAGES = "samples_images"
STORE_ROWS = "samples.rows"
STORE_META = "store.json"
STORE_TEXT_DTYPE = np.int32
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


def packed_prefix(output_dir: Path) -> Path:
    return Path(output_dir) / PACKED_NAME


def meta_path(prefix: Path) -> Path:
    return Path(str(prefix) + META_SUFFIX)


def store_dir(output_dir: Path) -> Path:
    return Path(output_dir) / STORE_DIR


def _megatron():
    """Megatron-Core's indexed dataset module; imported lazily (seconds, and noisy warnings)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on CPU hosts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex / Transformer Engine
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _bin(prefix: Path) -> str:
    return str(prefix) + ".bin"


def _idx(prefix: Path) -> str:
    return str(prefix) + ".idx"


def _torch_view(array: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


# ---------------------------------------------------------------------------------------------
# Sample store


class SampleStoreWriter:
    """Appends samples as they stream in; nothing accumulates in memory."""

    def __init__(self, directory: Path, image_shape: tuple[int, int, int]):
        mi = _megatron()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.image_shape = tuple(image_shape)
        self._text = mi.IndexedDatasetBuilder(_bin(self.directory / STORE_TEXT), dtype=STORE_TEXT_DTYPE)
        self._images = mi.IndexedDatasetBuilder(_bin(self.directory / STORE_IMAGES), dtype=STORE_IMAGE_DTYPE)
        self._rows = open(self.directory / STORE_ROWS, "wb")
        self.num_samples = 0

    def append(self, sample) -> None:
        if sample.images.shape[1:] != self.image_shape:
            raise ValueError(f"image shape {sample.images.shape[1:]} != store's {self.image_shape}")
        self._text.add_item(_torch_view(sample.tokens))
        self._text.add_item(_torch_view(sample.labels))
        self._text.end_document()
        for image in sample.images:
            self._images.add_item(_torch_view(image.reshape(-1)))
        self._images.end_document()
        row = np.array([(sample.index, sample.length, len(sample.images), sample.truncated)], dtype=SAMPLE_ROW)
        self._rows.write(row.tobytes())
        self.num_samples += 1

    def close(self, info: dict) -> None:
        """Finalize both datasets, then write store.json (the mark of a complete store)."""
        self._text.finalize(_idx(self.directory / STORE_TEXT))
        self._images.finalize(_idx(self.directory / STORE_IMAGES))
        self._rows.close()
        meta = {
            "format": STORE_FORMAT,
            "version": STORE_FORMAT_VERSION,
            "num_samples": self.num_samples,
            "image_shape": list(self.image_shape),
            **info,
        }
        write_json_atomic(self.directory / STORE_META, meta)


class SampleStore:
    """Read side of the sample store: lengths for the packer, samples by index for the writer."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.meta = _read_versioned(self.directory / STORE_META, STORE_FORMAT, STORE_FORMAT_VERSION)
        mi = _megatron()
        self.rows = np.fromfile(self.directory / STORE_ROWS, dtype=SAMPLE_ROW)
        if len(self.rows) != self.meta["num_samples"]:
            raise ValueError(f"{self.directory}: {len(self.rows)} rows for {self.meta['num_samples']} samples")
        self.image_shape = tuple(self.meta["image_shape"])
        # Megatron cannot map an empty .bin: a store of text-only samples has no image dataset to open
        self._text = mi.IndexedDataset(str(self.directory / STORE_TEXT)) if len(self.rows) else None
        has_images = bool(self.rows["num_images"].any())
        self._images = mi.IndexedDataset(str(self.directory / STORE_IMAGES)) if has_images else None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        return self.rows["length"].astype(np.int64)

    def tokens_labels(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._text[2 * i], self._text[2 * i + 1]

    def images(self, i: int) -> np.ndarray:
        if self._images is None:
            return np.zeros((0, *self.image_shape), dtype=STORE_IMAGE_DTYPE)
        first, last = self._images.document_indices[i], self._images.document_indices[i + 1]
        if first == last:
            return np.zeros((0, *self.image_shape), dtype=STORE_IMAGE_DTYPE)
        return np.stack([self._images[k] for k in range(first, last)]).reshape(-1, *self.image_shape)


# ---------------------------------------------------------------------------------------------
# Packed output


class PackedWriter:
    """Writes packs in NeMo's layout under temporary names; ``publish`` renames them into place."""

    def __init__(self, prefix: Path, image_shape: tuple[int, int, int]):
        mi = _megatron()
        self.prefix = Path(prefix)
        self._tmp = Path(str(prefix) + ".tmp")
        self.image_shape = tuple(image_shape)
        self._builder = mi.IndexedDatasetBuilder(_bin(self._tmp), dtype=PACKED_DTYPE, multimodal=True)
        self.num_packs = 0

    def add_pack(self, lengths: np.ndarray, tokens: np.ndarray, labels: np.ndarray, images: np.ndarray) -> None:
        """One pack: per-sample lengths, concatenated tokens/labels, float32 (N, 3, H, W) images."""
        if len(images) == 0:
            images = np.zeros((1, *self.image_shape), dtype=PACKED_DTYPE)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        items = {
            ITEM_CU_SEQLENS: cu_seqlens,
            ITEM_TOKENS: tokens,
            ITEM_LABELS: labels,
            ITEM_IMAGE: images.reshape(-1),
        }
        for item in range(ITEMS_PER_PACK):
            array = np.asarray(items[item], dtype=PACKED_DTYPE)
            self._builder.add_item(_torch_view(array), IMAGE_MODE if item == ITEM_IMAGE else 0)
        self._builder.end_document()
        self.num_packs += 1

    def publish(self, meta: dict) -> None:
        """Finalize, rename .bin/.idx into place, then write the meta file last."""
        self._builder.finalize(_idx(self._tmp))
        os.replace(_bin(self._tmp), _bin(self.prefix))
        os.replace(_idx(self._tmp), _idx(self.prefix))
        full = {
            "format": PACKED_FORMAT,
            "version": PACKED_FORMAT_VERSION,
            "num_packs": self.num_packs,
            "image_shape": list(self.image_shape),
            "crop_size": list(self.image_shape[1:]),
            **meta,
        }
        write_json_atomic(meta_path(self.prefix), full)


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
        self._ds = _megatron().IndexedDataset(str(self.prefix))

    def __len__(self) -> int:
        return len(self._ds.document_indices) - 1

    def __getitem__(self, p: int) -> Pack:
        start = self._ds.document_indices[p]
        return Pack(
            cu_seqlens=self._ds[start + ITEM_CU_SEQLENS].astype(np.int64),
            tokens=self._ds[start + ITEM_TOKENS].astype(np.int64),
            labels=self._ds[start + ITEM_LABELS].astype(np.int64),
            images=self._ds[start + ITEM_IMAGE].astype(np.float32).reshape(-1, *self.image_shape),
        )


def read_packed_meta(prefix: Path) -> dict:
    return _read_versioned(meta_path(prefix), PACKED_FORMAT, PACKED_FORMAT_VERSION)


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


def write_json_atomic(path: Path, data) -> None:
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


