"""Samples as the store writes them, built where the samples are built (a DataLoader worker), so
that the main process only writes bytes.

An image run is ``[start] patch ... [end]`` (the same N ids every time in a fixed store; each image's
own length in a dynamic one) with ignored labels except at its last position, so, as in the compact
format, only its last position is stored (with each run's start and length); ``store_document``
refuses a sample that breaks this and the reader puts the runs back. A video clip's run is kept
whole (its ids are its family's: other pad ids, timestamp text), its labels ignored all the same. A label is the next id where
trained (samples.py), so only which positions are trained is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neva_pack.sample_store.files import RUN_VALUES, SAMPLE_ROW, STORE_IMAGE_DTYPE, STORE_TEXT_DTYPE, TEXT_ITEMS, StoreRun
from neva_pack.sample_store.frame_codec import compress_entry
from neva_pack.sample_store.image_pool import image_key, pool_row
from neva_pack.core import StoredImage

__all__ = ["StoreDocument", "StoredBatch", "elided_ids", "elided_positions", "image_run_lengths", "store_document", "stored_batch", "whole_runs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreDocument:
    """One sample as the store writes it. Bytes, not arrays: they pickle as one copy each."""

    text: bytes
    """int32 items of the sample's text document: stored tokens + the last label, trained bits, (start,
    length, elided) per image run."""
    lengths: tuple[int, int, int]
    """Values in each of the three items."""
    image_keys: bytes
    """16-byte content key of each image (image_pool.py), in placeholder order."""
    row: bytes
    """The sample's SAMPLE_ROW record."""


def store_document(sample, image_run, ignore_index: int, image_shape) -> StoreDocument:
    """The checks every stored sample passes, and its bytes in the store (pure: a worker runs it).

    ``image_run``: the store's run (files.StoreRun, an ImageRun, or a fixed run's ids); ``image_shape``:
    (3, H, W) of a fixed store's images, None for a dynamic store (``sample.images`` StoredImages,
    each run ``image.tokens`` + its delimiters long). The store leaves out the first length - 1
    positions of each image run and keeps only which positions are trained, so a sample that
    breaks either assumption is refused (a bug). A video clip's run (``StoredImage.frames``) is not
    the store's pattern (its own pad ids, timestamp text between its temporal patches): it is kept
    whole, as the family spelled it, with its labels ignored."""
    run = StoreRun.of(image_run)
    tokens, labels, starts = sample.tokens, sample.labels, np.asarray(sample.image_starts, dtype=np.int64)
    run_lengths = image_run_lengths(sample, run, image_shape)
    if len(starts) != len(run_lengths):
        raise ValueError(f"record {sample.index}: {len(starts)} image runs for {len(run_lengths)} images (a bug)")
    trained = labels != ignore_index
    if not np.array_equal(labels[:-1][trained[:-1]], tokens[1:][trained[:-1]]):
        raise ValueError(f"record {sample.index}: a trained label is not the next token (a bug)")
    whole = whole_runs(sample.images, run)
    elided_counts = np.where(whole, 0, run_lengths - 1)
    if len(starts):
        if trained[elided_positions(starts, run_lengths, len(tokens))].any():  # every run's first L - 1 positions
            raise ValueError(f"record {sample.index}: an image run is not the image run's ids with ignored labels (a bug)")
        patterned = ~whole
        elided = elided_positions(starts[patterned], run_lengths[patterned], len(tokens))
        ok = np.array_equal(tokens[elided], elided_ids(run, run_lengths[patterned]))
        if ok and run.dynamic:
            ok = bool(np.all(tokens[starts[patterned] + run_lengths[patterned] - 1] == run.last_id()))
        if not ok:
            raise ValueError(f"record {sample.index}: an image run is not the image run's ids with ignored labels (a bug)")
        kept = np.ones(len(tokens), dtype=bool)
        kept[elided] = False
        tokens, trained = tokens[kept], trained[kept]
    bits = _pack_bits(trained)
    sizes = (len(tokens) + len(labels[-1:]), len(bits), RUN_VALUES * len(starts))
    values = np.empty(sum(sizes), dtype=STORE_TEXT_DTYPE)
    values[: len(tokens)] = tokens
    values[len(tokens) : sizes[0]] = labels[-1:]
    values[sizes[0] : sizes[0] + sizes[1]] = bits
    values[sizes[0] + sizes[1] :] = np.stack([starts, run_lengths, elided_counts], axis=1).ravel()
    row = np.array(
        [(sample.index, len(sample.tokens), len(sample.images), sample.truncated, int(run_lengths.sum()), sample.vision_cost)],
        dtype=SAMPLE_ROW,
    )
    return StoreDocument(
        text=values.tobytes(),
        lengths=sizes,
        image_keys=b"".join(image_key(image) for image in sample.images),
        row=row.tobytes(),
    )


def whole_runs(images, run: StoreRun) -> np.ndarray:
    """bool per image: its run is kept whole (a video clip's, in a dynamic store), not elided to its last position."""
    if not run.dynamic:
        return np.zeros(len(images), dtype=bool)
    return np.array([bool(image.frames) for image in images], dtype=bool)


def image_run_lengths(sample, run: StoreRun, image_shape) -> np.ndarray:
    """int64 run length of each of the sample's images, checked against what the sample says
    (``sample.image_tokens``) and against the store (a fixed store's shape, a dynamic store's images;
    a video clip's run, spelled by its family, at least its feature positions long)."""
    images = sample.images
    said = np.asarray(sample.image_tokens, dtype=np.int64)
    if run.dynamic:
        if image_shape is not None or not all(isinstance(image, StoredImage) for image in images):
            raise ValueError(f"record {sample.index}: a dynamic store holds StoredImages only (a bug)")
        lengths = np.array([image.tokens + run.delimiters for image in images], dtype=np.int64)
        clips = whole_runs(images, run)
        if len(said) == len(lengths) and np.all(said[clips] >= lengths[clips]):
            lengths[clips] = said[clips]
    else:
        if not isinstance(images, np.ndarray) or images.shape[1:] != tuple(image_shape):
            raise ValueError(f"image shape {getattr(images, 'shape', None)} != store's {tuple(image_shape)}")
        lengths = np.full(len(images), run.fixed_length, dtype=np.int64)
    if not np.array_equal(said, lengths):
        raise ValueError(f"record {sample.index}: image_tokens {said.tolist()} are not its "
                         f"images' run lengths {lengths.tolist()} (a bug)")  # fmt: skip
    return lengths


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
    images: np.ndarray | tuple
    """Fixed store: uint8 (images, 3, H, W), the samples' images in order (none for text-only samples);
    dynamic store: a tuple of their StoredImages (empty when ``entries`` holds them)."""
    skipped: tuple
    """The batch's samples.Skipped records."""
    entries: tuple = ()
    """A compressed dynamic store (--frame_compression): (POOL_IMAGE_ROW bytes, compressed frame) of each
    image, in order, compressed by the worker that built them (the main process only writes the bytes);
    empty otherwise."""


def stored_batch(items, image_run, ignore_index: int, image_shape, frame_compression: str | None = None) -> StoredBatch:
    """Consecutive records' Sample | Skipped items as one StoredBatch (pure: a worker runs it);
    ``image_run`` and ``image_shape`` as ``store_document`` takes them; ``frame_compression``: a dynamic
    store's codec, its images sent as their rows and compressed frames (``StoredBatch.entries``)."""
    samples = [item for item in items if hasattr(item, "tokens")]
    run = StoreRun.of(image_run)
    documents = [store_document(item, run, ignore_index, image_shape) for item in samples]
    entries = ()
    if run.dynamic:
        images = tuple(image for item in samples for image in item.images)
        if frame_compression is not None:
            entries = tuple((pool_row(image).tobytes(), compress_entry(frame_compression, b"".join(
                np.ascontiguousarray(part, dtype=STORE_IMAGE_DTYPE).data for part in image.parts))) for image in images)  # fmt: skip
            images = ()
    else:
        images = [item.images for item in samples if len(item.images)]
        images = np.concatenate(images) if images else np.zeros((0, *image_shape), dtype=STORE_IMAGE_DTYPE)
    return StoredBatch(
        first_record=items[0].index if items else 0,
        records=len(items),
        text=b"".join(document.text for document in documents),
        lengths=np.array([document.lengths for document in documents], dtype=np.int64).reshape(-1, TEXT_ITEMS).tobytes(),
        rows=b"".join(document.row for document in documents),
        image_keys=b"".join(document.image_keys for document in documents),
        images=images,
        skipped=tuple(item for item in items if not hasattr(item, "tokens")),
        entries=entries,
    )


def elided_positions(image_starts, run_lengths, length: int) -> np.ndarray:
    """Positions of the first L - 1 ids of each image run (L: its length, ``run_lengths`` one per
    run or one for all): what the store leaves out."""
    starts = np.asarray(image_starts, dtype=np.int64)
    lengths = np.broadcast_to(np.asarray(run_lengths, dtype=np.int64), starts.shape)
    ends = starts + lengths
    if len(starts) and (starts[0] < 0 or np.any(lengths < 1) or np.any(starts[1:] < ends[:-1]) or ends[-1] > length):
        raise ValueError(f"image runs at {starts.tolist()} overlap or leave the sample of {length} positions (a bug)")
    return starts.repeat(lengths - 1) + _ranges(lengths - 1)


def elided_ids(run: StoreRun, run_lengths) -> np.ndarray:
    """The ids at ``elided_positions``: each run's first L - 1 ids, concatenated."""
    lengths = np.asarray(run_lengths, dtype=np.int64)
    prefix = run.elided(int(lengths.max(initial=1)))
    return prefix[_ranges(lengths - 1)]


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[0 .. c0 - 1, 0 .. c1 - 1, ...] for counts [c0, c1, ...]."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) - np.repeat(ends - counts, counts)


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """A bool mask as int32 words, 8 positions a byte (the text file holds int32 items)."""
    packed = np.packbits(mask)
    words = np.zeros(-(-len(packed) // 4) * 4, dtype=np.uint8)
    words[: len(packed)] = packed
    return words.view(STORE_TEXT_DTYPE)
