"""The sample store's files: their names and record types, defined here only.

    output_dir/packed_seq_dataset/
      progress.json                 committed segments (record range, counts), settings fingerprint,
                                    "complete" once every record is in; rewritten atomically
      shard_00000.rows              raw little-endian SAMPLE_ROW records, one per sample
      shard_00000.skipped.jsonl     the segment's skipped records
      shard_00000_text.bin/.idx     IndexedDataset int32, document i = sample i: [tokens + the label
                                    of the last token, trained bits (labels != ignore_index, packed
                                    8 a byte), image_starts (where each image run begins)]; tokens
                                    and bits without each image run's first N - 1 positions
      shard_00000.image_refs        16-byte content key of every image of the segment's samples, in order
      shard_00000.images            the segment's share of the image pool: each image not seen in an
      shard_00000.image_keys        earlier segment or earlier in this one, uint8 (3, H, W) after
                                    resize/crop/pad, before rescale/normalise (image_pool.py); absent if none
      part_<i>_of_<N>/              a sharded run's part: the store that shard i writes, joined by the
                                    final step (pipeline/parts.py)

A *segment* is what the writer commits at each checkpoint. On disk its files are named
``shard_<n>`` and progress.json lists segments under ``"shards"``: the names the first stores were
written with, kept so that every existing store resumes (in the code, "shard" means only a sharded
run's share of the records, --num_shards / --shard_index).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "PROGRESS_FILE",
    "SAMPLE_ROW",
    "SEGMENT_FILE",
    "STORE_FORMAT",
    "STORE_FORMAT_VERSION",
    "STORE_IMAGE_DTYPE",
    "STORE_TEXT_DTYPE",
    "TEXT_ITEMS",
    "SegmentInfo",
    "is_store_file",
    "part_dir",
    "part_of",
    "run_from_pairs",
    "run_pairs",
    "pool_images_path",
    "pool_keys_path",
    "segment_files",
    "segment_image_refs_path",
    "segment_name",
    "segment_of",
    "segment_rows_path",
    "segment_skipped_path",
    "segment_text_prefix",
]

STORE_FORMAT = "neva_pack.sample_store"
STORE_FORMAT_VERSION = 6  # 5: image runs elided from the text, labels as trained bits; 6: image tokens, vision cost
PROGRESS_FILE = "progress.json"
STORE_TEXT_DTYPE = np.int32
TEXT_ITEMS = 3
"""Items of a sample's text document: tokens + last label, trained bits, image_starts."""
STORE_IMAGE_DTYPE = np.uint8
"""Images are stored after resize/crop/pad, before rescale/normalise (image_pool.py)."""
SAMPLE_ROW = np.dtype(
    [
        ("record_index", "<i8"),  # position of the source record in the input file
        ("length", "<i4"),  # len(tokens): text + image positions; what is packed
        ("num_images", "<i4"),  # images of the sample in the image store
        ("truncated", "u1"),  # 1 when the sample was cut to max_seq_length
        ("image_tokens", "<i4"),  # positions of its image runs, summed
        ("vision_cost", "<i8"),  # the vision encoder's attention cost of its images (samples.Sample.vision_cost)
    ]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentInfo:
    """One committed segment, as progress.json records it (one entry of its "shards" list)."""

    name: str
    """File stem of the segment (shard_00000)."""
    first_record: int
    """Index of the first input record the segment covers."""
    end_record: int
    """One past the last input record the segment covers."""
    samples: int
    """Samples stored in the segment."""
    images: int
    """Image instances of the segment's samples."""
    pool_images: int
    """Distinct images the segment added to the pool (its .images file)."""
    truncated: int
    """Truncated samples in the segment."""
    skipped_by_reason: dict
    """Skipped records of the segment, by reason."""
    pool_checksums: dict | None = None
    """Checksums of the segment's pool files, computed as they were written (``PoolSegment.checksums``)."""
    checksums: dict | None = None
    """xxh3-128 of the segment's other files once committed, by file name (``segment_files``): what a
    resume checks them against (None in a store written before they were recorded)."""

    def to_json(self) -> dict:
        return {field: getattr(self, field) for field in SegmentInfo.__dataclass_fields__}


def segment_name(number: int) -> str:
    """The file stem of the store's ``number``-th segment (its on-disk spelling: shard_00000)."""
    return f"shard_{number:05d}"


def segment_files(directory: Path, name: str) -> list[Path]:
    """The files of segment ``name`` besides its pool's, in a fixed order (those it has: a segment of
    skipped records has no text files)."""
    text = segment_text_prefix(directory, name)
    files = [segment_rows_path(directory, name), segment_image_refs_path(directory, name),
             segment_skipped_path(directory, name), Path(f"{text}.bin"), Path(f"{text}.idx")]  # fmt: skip
    return [path for path in files if path.is_file()]


def segment_skipped_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}.skipped.jsonl"


def segment_rows_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}.rows"


def segment_text_prefix(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}_text"


def segment_image_refs_path(directory: Path, name: str) -> Path:
    """16-byte content key of every image instance of the segment's samples, in sample order."""
    return Path(directory) / f"{name}.image_refs"


def pool_images_path(directory: Path, name: str) -> Path:
    """Raw uint8 images of one segment of the image pool (image_pool.py)."""
    return Path(directory) / f"{name}.images"


def pool_keys_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}.image_keys"


SEGMENT_FILE = re.compile(
    r"(shard|pool)_\d+(\.rows|\.skipped\.jsonl|_text\.bin|_text\.idx|\.image_refs|\.images|\.image_keys)(\.tmp)?"
)
"""Every file name of a store segment (the writer, the image pool, convert's pool), temporary names
included: what --overwrite and --resume may delete inside a store directory."""
_SEGMENT_STEM = re.compile(r"shard_\d+")


def segment_of(name: str) -> str | None:
    """The segment stem a file of the store belongs to (shard_00003.rows -> shard_00003), or None."""
    match = _SEGMENT_STEM.match(name)
    return match.group() if match else None


def is_store_file(name: str) -> bool:
    """A file a store (or a part) may hold: its segments' files and its progress file."""
    return bool(SEGMENT_FILE.fullmatch(name)) or name in (PROGRESS_FILE, PROGRESS_FILE + ".tmp")


PART_NAME = "part_{index:05d}_of_{count:05d}"
_PART = re.compile(r"part_(\d+)_of_(\d+)")


def part_dir(store_directory: Path, num_shards: int, shard_index: int) -> Path:
    """packed_seq_dataset/part_<index>_of_<num_shards>: the part shard ``shard_index`` writes."""
    return Path(store_directory) / PART_NAME.format(index=shard_index, count=num_shards)


def part_of(name: str) -> tuple[int, int] | None:
    """(shard index, number of shards) of a part directory's name, None for any other name."""
    match = _PART.fullmatch(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def run_pairs(run: np.ndarray) -> list[list[int]]:
    """An image run as progress.json keeps it, [id, repeats] pairs: [start, patch x 576, end] is 3
    pairs, not 578 lines."""
    run = np.asarray(run)
    breaks = np.flatnonzero(np.diff(run)) + 1
    return [[int(ids[0]), len(ids)] for ids in np.split(run, breaks)]


def run_from_pairs(pairs) -> np.ndarray:
    """The image run's ids back from ``run_pairs``."""
    return np.repeat(*np.array(pairs, dtype=np.int64).reshape(-1, 2).T).astype(STORE_TEXT_DTYPE)
