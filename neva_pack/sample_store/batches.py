"""Samples as the store writes them, built where the samples are built (a DataLoader worker), so
that the main process only writes bytes.

An image run is the same N ids every time (progress.json's image_run) with ignored labels except at
its last position, so, as in the compact format, only its last position is stored; ``store_document``
refuses a sample that breaks this and the reader puts the runs back. A label is the next id where
trained (samples.py), so only which positions are trained is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neva_pack.sample_store.files import SAMPLE_ROW, STORE_IMAGE_DTYPE, STORE_TEXT_DTYPE, TEXT_ITEMS
from neva_pack.sample_store.image_pool import image_key

__all__ = ["StoreDocument", "StoredBatch", "elided_positions", "store_document", "stored_batch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreDocument:
    """One sample as the store writes it. Bytes, not arrays: they pickle as one copy each."""

    text: bytes
    """int32 items of the sample's text document: stored tokens + the last label, trained bits, image starts."""
    lengths: tuple[int, int, int]
    """Values in each of the three items."""
    image_keys: bytes
    """16-byte content key of each image (image_pool.py), in placeholder order."""
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
        elided = elided_positions(starts, len(image_run), len(tokens))
        if not (np.array_equal(tokens[elided], np.tile(image_run[:-1], len(starts))) and not trained[elided].any()):
            raise ValueError(f"record {sample.index}: an image run is not the image run's ids with ignored labels (a bug)")
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
    row = np.array(
        [(sample.index, len(sample.tokens), len(sample.images), sample.truncated, int(sample.image_tokens.sum()), sample.vision_cost)],
        dtype=SAMPLE_ROW,
    )
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
    """The samples' SAMPLE_ROW records (record index, length, images, truncated, image tokens, vision cost)."""
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
        lengths=np.array([document.lengths for document in documents], dtype=np.int64).reshape(-1, TEXT_ITEMS).tobytes(),
        rows=b"".join(document.row for document in documents),
        image_keys=b"".join(document.image_keys for document in documents),
        images=np.concatenate(images) if images else np.zeros((0, *image_shape), dtype=STORE_IMAGE_DTYPE),
        skipped=tuple(item for item in items if not hasattr(item, "tokens")),
    )


def elided_positions(image_starts, run_length: int, length: int) -> np.ndarray:
    """Positions of the first run_length - 1 ids of each image run: what the store leaves out."""
    starts = np.asarray(image_starts, dtype=np.int64)
    if len(starts) and (starts[0] < 0 or np.any(np.diff(starts) < run_length) or starts[-1] + run_length > length):
        raise ValueError(f"image runs at {starts.tolist()} overlap or leave the sample of {length} positions (a bug)")
    return (starts[:, None] + np.arange(max(run_length - 1, 0))).ravel()


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """A bool mask as int32 words, 8 positions a byte (the text file holds int32 items)."""
    packed = np.packbits(mask)
    words = np.zeros(-(-len(packed) // 4) * 4, dtype=np.uint8)
    words[: len(packed)] = packed
    return words.view(STORE_TEXT_DTYPE)
