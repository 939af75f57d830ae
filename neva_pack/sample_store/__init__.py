"""The sample store: the intermediate, resumable store of encoded samples that packs are assembled
from (not a packed output format: formats/ holds those). Written in segments, one committed at each
checkpoint, so that a killed run resumes; its files are described in ``files.py``.

    files.py        file names, the sample row, a segment's record in progress.json: the on-disk format
    batches.py      StoredBatch / store_document: a sample's store bytes, built in the DataLoader workers
    writer.py       SampleStoreWriter: appends batches, commits a segment at each checkpoint
    reader.py       SampleStore: lengths for the packer, samples by index for assembly (StoredTexts)
    join.py         join_part: a sharded run's part appended as one segment, decoding nothing
    checks.py       the progress file read and checked, a store's files checked against it, resume settings
    image_pool.py   every distinct image once, keyed by content: also the compact format's image pool
    frame_codec.py  --frame_compression: each entry of a dynamic pool one zstd frame, decoded within its row's size
    kernels.py      numba: stored text -> tokens and labels

The pool segments are also the compact format's image pool: re-packing at another size or with
another algorithm reads them, re-encodes nothing, and a compact output adds no pixel of its own.
"""

from __future__ import annotations

from neva_pack.sample_store.batches import StoreDocument, StoredBatch, store_document, stored_batch
from neva_pack.sample_store.checks import (
    StoreDamage,
    check_input,
    check_settings,
    pool_codec,
    read_progress,
    store_checksums_problem,
    store_files_problem,
)
from neva_pack.sample_store.files import (
    POOL_IMAGE_ROW, PROGRESS_FILE, RUN_VALUES, SAMPLE_ROW, STORE_FORMAT, STORE_TEXT_DTYPE, SegmentInfo, is_store_file,
    part_dir, part_of, pool_images_path, pool_keys_path, segment_image_refs_path, segment_name, segment_rows_path,
    segment_skipped_path, segment_text_prefix
)
from neva_pack.sample_store.join import join_part
from neva_pack.sample_store.reader import SampleStore, StoredTexts
from neva_pack.sample_store.writer import SampleStoreWriter, commits_reported_to

from neva_pack.sample_store.image_pool import ImagePool, PoolSegment, PoolWriter, image_key, pool_segment
from neva_pack.sample_store.frame_codec import FRAME_CODECS

__all__ = [
    "FRAME_CODECS",
    "ImagePool",
    "POOL_IMAGE_ROW",
    "PROGRESS_FILE",
    "PoolSegment",
    "PoolWriter",
    "RUN_VALUES",
    "SAMPLE_ROW",
    "STORE_FORMAT",
    "STORE_TEXT_DTYPE",
    "SampleStore",
    "SampleStoreWriter",
    "SegmentInfo",
    "StoreDamage",
    "StoreDocument",
    "StoredBatch",
    "StoredTexts",
    "check_input",
    "check_settings",
    "commits_reported_to",
    "image_key",
    "is_store_file",
    "join_part",
    "part_dir",
    "part_of",
    "pool_codec",
    "pool_images_path",
    "pool_keys_path",
    "pool_segment",
    "read_progress",
    "segment_image_refs_path",
    "segment_name",
    "segment_rows_path",
    "segment_skipped_path",
    "segment_text_prefix",
    "store_checksums_problem",
    "store_document",
    "store_files_problem",
    "stored_batch",
]
