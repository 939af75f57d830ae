"""The sample store's files: their names and record types, defined here only.

    output_dir/packed_seq_dataset/
      progress.json                 committed segments (record range, counts), settings fingerprint,
                                    "complete" once every record is in; rewritten atomically
      shard_00000.rows              raw little-endian SAMPLE_ROW records, one per sample
      shard_00000.skipped.jsonl     the segment's skipped records
      shard_00000_text.bin/.idx     IndexedDataset int32, document i = sample i: [tokens + the label
                                    of the last token, trained bits (labels != ignore_index, packed
                                    8 a byte), image runs (start, length, elided) per image]; tokens and
                                    bits without each image run's first length - 1 positions (none
                                    left out of a run kept whole: a video clip's, elided 0)
      shard_00000.image_refs        16-byte content key of every image of the segment's samples, in order
      shard_00000.images            the segment's share of the image pool: each image not seen in an
      shard_00000.image_keys        earlier segment or earlier in this one, uint8 (3, H, W) after
                                    resize/crop/pad, before rescale/normalise (image_pool.py); absent if none
      shard_00000.image_shapes      dynamic-resolution stores only: one POOL_IMAGE_ROW per image of
                                    .images (its size, tokens, parts' shapes); its parts are back to back there
      shard_00000.entry_sizes       a compressed pool only (--frame_compression): int64 bytes of each image's
                                    compressed frame in .images (sample_store/frame_codec.py)
      part_<i>_of_<N>/              a sharded run's part: the store that shard i writes, joined by the
                                    final step (pipeline/parts.py)

A store is *fixed* (every image one (3, H, W) crop, every run the same ids: progress.json's
``image_shape`` and ``image_run`` as [id, repeats] pairs) or *dynamic* (each image at its own size:
``image_shape`` null, ``image_run`` as {"start", "patch", "end"} ids, ``image_processor`` the settings
that rebuild the processor, ``images.processor_record``). ``StoreRun`` reads and writes that spelling.

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
    "MAX_IMAGE_PARTS",
    "POOL_IMAGE_ROW",
    "PROGRESS_FILE",
    "RUN_VALUES",
    "SAMPLE_ROW",
    "SEGMENT_FILE",
    "STORE_FORMAT",
    "STORE_FORMAT_VERSION",
    "STORE_IMAGE_DTYPE",
    "STORE_TEXT_DTYPE",
    "TEXT_ITEMS",
    "SegmentInfo",
    "StoreRun",
    "is_store_file",
    "part_dir",
    "part_of",
    "run_from_pairs",
    "run_pairs",
    "pool_images_path",
    "pool_keys_path",
    "pool_shapes_path",
    "pool_sizes_path",
    "segment_files",
    "segment_image_refs_path",
    "segment_name",
    "segment_of",
    "segment_rows_path",
    "segment_skipped_path",
    "segment_text_prefix",
]

STORE_FORMAT = "neva_pack.sample_store"
STORE_FORMAT_VERSION = 8  # 5: image runs elided from the text, labels as trained bits; 6: image tokens, vision cost,
# each run's (start, length) in the text, dynamic-resolution pools; 7: runs kept whole (video clips), each run's
# elided positions in the text, frames and seconds per temporal patch in the pool's rows; 8: content keys BLAKE3-128
PROGRESS_FILE = "progress.json"
STORE_TEXT_DTYPE = np.int32
TEXT_ITEMS = 3
"""Items of a sample's text document: tokens + last label, trained bits, image runs."""
RUN_VALUES = 3
"""Values per image in the text document's third item: its run's start, its run's length and how many
of its first positions the store left out (length - 1 for a run of the store's pattern, 0 for a run
kept whole: a video clip's, whose ids -- other pad ids, timestamp text -- are not one repeated pattern)."""
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

MAX_IMAGE_PARTS = 2
"""Parts of a dynamic image (images.StoredImage): Qwen one, LLaVA-NeXT / OneVision two (or one)."""
POOL_IMAGE_ROW = np.dtype(
    [
        ("width", "<i4"),  # the decoded image's size (StoredImage.size)
        ("height", "<i4"),
        ("tokens", "<i4"),  # its language-model positions (StoredImage.tokens)
        ("parts", "<i4"),  # parts stored, 1..MAX_IMAGE_PARTS
        ("shapes", "<i4", (MAX_IMAGE_PARTS, 2)),  # (H, W) of each part (3, H, W); zeros past ``parts``
        ("frames", "<i4"),  # 0 for a still image; a video clip's frames, stacked in its one part (StoredImage.frames)
        ("grid_seconds", "<f8"),  # a clip's seconds per temporal patch (StoredImage.grid_seconds); 0 for an image
    ]
)
"""One image of a dynamic pool's .image_shapes file; its parts lie back to back in .images."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreRun:
    """How a store spells its image runs, fixed or dynamic (module docstring).

    The store keeps only the last position of each run; the first ``length - 1`` ids are put back
    from here. Fixed: the run's ids (every run ``len(ids)`` long). Dynamic: ``[start] patch ... [end]``
    of each image's own length (``image_run.ImageRun`` with ``positions`` None)."""

    ids: np.ndarray | None = None
    """Fixed: int32 ids of every run. None for a dynamic store."""
    start_id: int | None = None
    """Dynamic: the id opening each run, or None."""
    patch_id: int | None = None
    """Dynamic: the id of every image-feature position."""
    end_id: int | None = None
    """Dynamic: the id closing each run, or None."""

    @classmethod
    def of(cls, image_run) -> "StoreRun":
        """From an ImageRun (dynamic when its ``positions`` is None) or a fixed run's ids."""
        if isinstance(image_run, StoreRun):
            return image_run
        if hasattr(image_run, "patch_id"):
            if image_run.positions is None:
                return cls(start_id=image_run.start_id, patch_id=int(image_run.patch_id), end_id=image_run.end_id)
            image_run = image_run.ids()
        return cls(ids=np.asarray(image_run, dtype=STORE_TEXT_DTYPE))

    @property
    def dynamic(self) -> bool:
        return self.ids is None

    @property
    def fixed_length(self) -> int | None:
        """Positions of every run of a fixed store; None for a dynamic one."""
        return None if self.ids is None else len(self.ids)

    @property
    def delimiters(self) -> int:
        """Positions of a dynamic run besides its features (start and end ids): run length = tokens + this."""
        return (self.start_id is not None) + (self.end_id is not None)

    def elided(self, longest: int) -> np.ndarray:
        """int32 ids such that a run of length L begins with ``elided(longest)[:L - 1]``, for every
        L <= ``longest`` (fixed: the run's ids but the last)."""
        if self.ids is not None:
            return self.ids[:-1]
        ids = np.full(max(longest - 1, 0), self.patch_id, dtype=STORE_TEXT_DTYPE)
        if self.start_id is not None and len(ids):
            ids[0] = self.start_id
        return ids

    def last_id(self) -> int:
        """The id of a run's last position (dynamic)."""
        return int(self.patch_id if self.end_id is None else self.end_id)

    def to_json(self):
        """progress.json's ``image_run``: [id, repeats] pairs (fixed) or the ids by role (dynamic)."""
        if self.ids is not None:
            return run_pairs(self.ids)
        return {"start": self.start_id, "patch": self.patch_id, "end": self.end_id}

    @classmethod
    def from_json(cls, value) -> "StoreRun":
        if isinstance(value, dict):
            return cls(start_id=value["start"], patch_id=int(value["patch"]), end_id=value["end"])
        return cls(ids=run_from_pairs(value))


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


def pool_sizes_path(directory: Path, name: str) -> Path:
    """int64 bytes of each compressed entry of a compressed pool segment's .images file (frame_codec.py)."""
    return Path(directory) / f"{name}.entry_sizes"


def pool_shapes_path(directory: Path, name: str) -> Path:
    """POOL_IMAGE_ROW of every image of a dynamic pool segment's .images file."""
    return Path(directory) / f"{name}.image_shapes"


SEGMENT_FILE = re.compile(
    r"(shard|pool)_\d+(\.rows|\.skipped\.jsonl|_text\.bin|_text\.idx|\.image_refs|\.images|\.image_keys|\.image_shapes|\.entry_sizes)(\.tmp)?"
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
