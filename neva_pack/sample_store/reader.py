"""The store's read side: lengths for the packer, samples by index for assembly.

Samples are read with file reads, not memory maps, so reading a large store does not grow the
process's resident memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.core import InputError
from neva_pack.files import IndexedReader
from neva_pack.sample_store.batches import elided_positions
from neva_pack.sample_store.checks import pool_codec, read_progress
from neva_pack.sample_store.files import (
    RUN_VALUES,
    SAMPLE_ROW,
    STORE_TEXT_DTYPE,
    TEXT_ITEMS,
    SegmentInfo,
    StoreRun,
    segment_image_refs_path,
    segment_rows_path,
    segment_skipped_path,
    segment_text_prefix,
)
from neva_pack.sample_store.image_pool import KEY_BYTES, ImagePool, image_bytes, load_keys, pool_segment, read_shapes, stored_offsets

__all__ = ["SampleStore", "StoredTexts"]


VIDEO_TOKENS_CHUNK = 4096
"""Samples whose stored text ``SampleStore.video_tokens`` reads at a time."""


def _kept_whole(runs: np.ndarray) -> np.ndarray:
    """bool per stored run (start, length, elided): kept whole, none of it elided (a video clip's)."""
    return (runs[:, 2] == 0) & (runs[:, 1] > 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredTexts:
    """Samples' text as read back from the store (``SampleStore.texts``)."""

    tokens: np.ndarray
    """int32 tokens of the samples, concatenated."""
    labels: np.ndarray
    """int32 labels, aligned with the tokens."""
    lengths: np.ndarray
    """int64 positions of each sample (after its cut)."""
    image_starts: list[np.ndarray]
    """Per sample, int64 where each of its image runs starts (in the sample, before any cut)."""
    image_lengths: list[np.ndarray]
    """Per sample, int64 length of each of its image runs."""
    image_whole: list[np.ndarray]
    """Per sample, bool per image run: kept whole (a video clip's ids), not the store's pattern."""


class SampleStore:
    """Read side of the sample store: lengths for the packer, samples by index for the writer.

    Samples are read with file reads, not memory maps, so reading a large store does not grow
    the process's resident memory.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        progress = read_progress(self.directory)
        if not progress["complete"]:
            raise InputError(f"{self.directory}: the sample store is incomplete (resume the run with --resume)")
        self.fingerprint = progress["fingerprint"]
        self.image_shape = None if progress["image_shape"] is None else tuple(progress["image_shape"])
        self.run = StoreRun.from_json(progress["image_run"])
        self.image_run = self.run.ids
        """Fixed store: int32 ids of every image run; None for a dynamic store (``run``)."""
        self.image_processor = progress.get("image_processor")
        """Dynamic store: the settings that rebuild its processor (``images.processor_from_record``); None when fixed."""
        self.ignore_index = int(progress["ignore_index"])
        self.frame_compression = pool_codec(progress)
        """The codec the pool's entries are compressed with (--frame_compression); None: raw uint8."""
        self.segments = [SegmentInfo(**segment) for segment in progress["shards"]]
        rows = [np.fromfile(segment_rows_path(self.directory, s.name), dtype=SAMPLE_ROW) for s in self.segments]
        self.rows = np.concatenate(rows) if rows else np.zeros(0, dtype=SAMPLE_ROW)
        self._first_sample = np.cumsum([0] + [s.samples for s in self.segments])
        self._first_image = np.cumsum([0] + [s.images for s in self.segments])
        self._sample_first_image = np.concatenate([[0], np.cumsum(self.rows["num_images"].astype(np.int64))])
        self.pool_segments = [pool_segment(self.directory, s.name, s.pool_images, s.pool_checksums, dynamic=self.dynamic,
                                           codec=self.frame_compression) for s in self.segments]  # fmt: skip
        self.pool = ImagePool(self.pool_segments, self.image_shape, mmap=False)
        self._known = None
        self._text = {}
        self._refs = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def dynamic(self) -> bool:
        """Whether each image has its own size and run length (module docstring of files.py)."""
        return self.run.dynamic

    @property
    def lengths(self) -> np.ndarray:
        return self.rows["length"].astype(np.int64)

    @property
    def num_images(self) -> np.ndarray:
        """int64 images of each sample, in sample order."""
        return self.rows["num_images"].astype(np.int64)

    @property
    def image_tokens(self) -> np.ndarray:
        """int64 positions of each sample's image runs, summed, in sample order."""
        return self.rows["image_tokens"].astype(np.int64)

    def video_tokens(self) -> np.ndarray:
        """int64 positions of each sample's video clips' runs (a run kept whole: what ``texts`` calls
        ``image_whole``), summed, in sample order: what --max_video_tokens_per_pack counts (a clip's
        run counts in ``image_tokens`` too). Zeros, no text read, when the pool holds no clip."""
        out = np.zeros(len(self.rows), dtype=np.int64)
        if len(self.rows) == 0 or self.clip_totals()[0] == 0:
            return out
        for first in range(0, len(self.rows), VIDEO_TOKENS_CHUNK):
            indices = np.arange(first, min(first + VIDEO_TOKENS_CHUNK, len(self.rows)), dtype=np.int64)
            raw, items = self._raw_texts(indices)
            ends = np.cumsum(items.sum(axis=1))
            for k, (end, n) in enumerate(zip(ends.tolist(), items[:, 2].tolist())):
                if n:
                    runs = raw[end - n : end].astype(np.int64).reshape(-1, RUN_VALUES)
                    out[first + k] = int(runs[_kept_whole(runs), 1].sum())
        return out

    def video_runs(self, i: int) -> np.ndarray:
        """bool per image run of sample i: a video clip's (kept whole), in placeholder order."""
        segment, local = self._locate(i)
        runs = np.asarray(self._text_reader(segment)[TEXT_ITEMS * local + 2], dtype=np.int64).reshape(-1, RUN_VALUES)
        return _kept_whole(runs)

    @property
    def vision_cost(self) -> np.ndarray:
        """int64 vision encoder's attention cost of each sample's images, in sample order."""
        return self.rows["vision_cost"].astype(np.int64)

    @property
    def skipped_by_reason(self) -> dict:
        total: dict[str, int] = {}
        for segment in self.segments:
            for reason, count in segment.skipped_by_reason.items():
                total[reason] = total.get(reason, 0) + count
        return total

    def clip_totals(self) -> tuple[int, int, int, int]:
        """(clips, frames, uint8 bytes, bytes stored) of the video clips in the pool (each distinct clip
        once): stored = uint8 but in a compressed pool (--frame_compression), whose entries' sizes it
        reads. Zeros for a fixed store. Reads the pool's rows (and sizes), never its pixels."""
        if not self.dynamic:
            return 0, 0, 0, 0
        clips = frames = size = stored = 0
        for segment in self.pool.segments:
            rows = read_shapes(segment)
            videos = rows["frames"] > 0
            clips, frames = clips + int(videos.sum()), frames + int(rows["frames"][videos].sum())
            size += int(image_bytes(rows[videos]).sum())
            stored += int(np.diff(stored_offsets(segment, rows))[videos].sum())
        return clips, frames, size, stored

    def skipped_files(self) -> list[Path]:
        return [segment_skipped_path(self.directory, s.name) for s in self.segments]

    def _locate(self, i: int) -> tuple[int, int]:
        segment = int(np.searchsorted(self._first_sample, i, side="right")) - 1
        return segment, i - int(self._first_sample[segment])

    def _text_reader(self, segment: int) -> IndexedReader:
        """The segment's text file, opened on first use."""
        if segment not in self._text:
            self._text[segment] = IndexedReader(segment_text_prefix(self.directory, self.segments[segment].name))
        return self._text[segment]

    def tokens_labels(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        text = self.texts([i])
        return text.tokens, text.labels

    def image_starts(self, i: int) -> np.ndarray:
        """int64 where each image run of sample i starts."""
        return self.image_runs(i)[0]

    def image_runs(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """int64 (starts, lengths) of sample i's image runs (``texts`` says which are kept whole)."""
        segment, local = self._locate(i)
        values = np.asarray(self._text_reader(segment)[TEXT_ITEMS * local + 2], dtype=np.int64).reshape(-1, RUN_VALUES)
        return values[:, 0].copy(), values[:, 1].copy()

    def texts(self, indices, keep=None) -> "StoredTexts":
        """Tokens and labels of samples ``indices``, concatenated, each cut to ``keep[k]`` positions
        when given (None: whole), with one file read per sample and one compiled pass over them all
        (``store_kernels.decode_texts``): what assembly needs for a group of packs.

            stored (per sample)   [t0 t2 t3 | last label]  bits [1 0 1]  runs [1 2 1]   (run S P at 1, 1 elided)
            ids (per sample)      [t0 S  t2 t3 | last label]        S filled in from the image run
            tokens                [t0 S  t2 t3]       labels  = next id where trained, else ignore
        """
        from neva_pack.sample_store.kernels import SOUND, decode_texts  # numba: imported on first read

        indices = np.asarray(indices, dtype=np.int64)
        lengths = self.rows["length"][indices].astype(np.int64)
        keep = lengths if keep is None else np.minimum(np.asarray(keep, dtype=np.int64), lengths)
        raw, items = self._raw_texts(indices)  # per sample: stored ids + last label | trained bits | image starts
        total = int(keep.sum())
        tokens = np.empty(total, dtype=STORE_TEXT_DTYPE)
        labels = np.empty(total, dtype=STORE_TEXT_DTYPE)
        sizes = items.sum(axis=1)
        starts_at = (np.cumsum(sizes) - items[:, 2]).tolist()
        if np.any(items[:, 2] % RUN_VALUES):
            k = int(np.flatnonzero(items[:, 2] % RUN_VALUES)[0])
            raise ValueError(f"sample {int(indices[k])}: its stored image runs are not (start, length) pairs (a bug)")
        runs = [raw[at : at + n].astype(np.int64).reshape(-1, RUN_VALUES) if n else _NO_RUNS for at, n in zip(starts_at, items[:, 2].tolist())]
        longest = max((int(r[:, 2].max()) + 1 for r in runs if len(r)), default=1)
        run_prefix = np.ascontiguousarray(self.run.elided(longest), dtype=STORE_TEXT_DTYPE)
        bad = decode_texts(raw, items, lengths, keep, run_prefix, STORE_TEXT_DTYPE(self.ignore_index), tokens, labels)
        if bad != SOUND:
            k = int(bad)
            elided_positions(runs[k][:, 0], runs[k][:, 1], int(lengths[k]))  # raises when the runs are at fault
            raise ValueError(f"sample {int(indices[k])}: its stored text does not fit its {int(lengths[k])} positions (a bug)")
        return StoredTexts(
            tokens=tokens,
            labels=labels,
            lengths=keep,
            image_starts=[r[:, 0] for r in runs],
            image_lengths=[r[:, 1] for r in runs],
            image_whole=[_kept_whole(r) for r in runs],
        )

    def _raw_texts(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples' stored text values, concatenated in the order asked (one read per sample),
        and the lengths of their three items."""
        segments = np.searchsorted(self._first_sample, indices, side="right") - 1
        present = np.unique(segments)
        if len(present) == 1:  # the usual case: read in order, nothing to reorder
            segment = int(present[0])
            return self._text_reader(segment).raw_documents(indices - self._first_sample[segment], TEXT_ITEMS)
        items = np.zeros((len(indices), TEXT_ITEMS), dtype=np.int64)
        pieces = []
        for segment in present.tolist():
            chosen = np.flatnonzero(segments == segment)
            values, items[chosen] = self._text_reader(segment).raw_documents(indices[chosen] - self._first_sample[segment], TEXT_ITEMS)
            pieces.append((chosen, values))
        sizes = items.sum(axis=1)
        block = np.cumsum(sizes) - sizes
        raw = np.empty(int(sizes.sum()), dtype=STORE_TEXT_DTYPE)
        for chosen, values in pieces:  # each segment's samples to their places in the order asked
            raw[np.repeat(block[chosen] - (np.cumsum(sizes[chosen]) - sizes[chosen]), sizes[chosen]) + np.arange(len(values))] = values
        return raw, items

    def image_indices(self, i: int) -> np.ndarray:
        """Pool index of each image of sample i, in placeholder order."""
        count = int(self.rows["num_images"][i])
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        segment, _ = self._locate(i)
        if segment not in self._refs:
            self._refs[segment] = segment_image_refs_path(self.directory, self.segments[segment].name).read_bytes()
        if self._known is None:
            self._known = load_keys(self.pool_segments)
        first = int(self._sample_first_image[i] - self._first_image[segment])
        refs = self._refs[segment]
        return np.array([self._known[refs[k * KEY_BYTES : (k + 1) * KEY_BYTES]] for k in range(first, first + count)])

    def images(self, i: int):
        """Sample i's images: uint8 (num_images, 3, H, W) from a fixed store, a list of StoredImages from a dynamic one."""
        indices = self.image_indices(i)
        return self.pool.read_stored(indices) if self.dynamic else self.pool.read(indices)


_NO_RUNS = np.zeros((0, RUN_VALUES), dtype=np.int64)
