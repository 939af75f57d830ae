"""``neva-pack plan`` straight from the input: every record laid out by the run's own sample builder
(``SampleBuilder.layout``) from its text and its images' headers, before any pixel is decoded.

The builder is made from the same settings as a preprocess run's (``pipeline.builder.sample_builder_for``),
cutting samples for the largest candidate size as a run with those ``--pack_sizes`` would; each smaller
size cuts them further as the run's assembly does (before the first image run that does not fit whole;
a sample left without a trained label skipped at that size). So the lengths, images, image tokens and
vision costs planned are those a run would store. Records the run would skip for a reason known before
decoding are counted by reason; those only a decode finds (a corrupt body, a decode over its time budget,
a size that disagrees with the header) are not predicted.

Records are laid out in DataLoader workers (``workers.worker_messages``), dealt in blocks of consecutive
records, arriving in input order whatever the number of workers.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from neva_pack.config import PackConfig, SampleConfig
from neva_pack.commands import CUT_ROW, SampleLengths
from neva_pack.records import iter_raw_records
from neva_pack.samples import SampleBuilder, SampleLayout, Skipped, truncation
from neva_pack.core import worker_messages

__all__ = ["DECODE_SKIPS_NOTE", "LaidOutSamples", "LayoutStream", "laid_out_lengths", "lengths_from_input"]

RECORDS_PER_MESSAGE = 256
"""Records a worker lays out and sends as one message (a layout costs far less than a round trip)."""

DECODE_SKIPS_NOTE = (
    "planned from the records' text and image headers, no pixel decoded: records a run skips only when it "
    "decodes an image (corrupt data, too slow, a size other than its header's) are not predicted"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaidOutSamples:
    """The kept samples' layouts as columns (input order), enough to cut them for any pack size."""

    lengths: np.ndarray
    """int64 positions of every sample, cut for the largest size."""
    first_trained: np.ndarray
    """int64 position of every sample's first trained label."""
    image_offsets: np.ndarray
    """int64 (samples + 1): sample i's images are [image_offsets[i], image_offsets[i + 1]) of the columns below."""
    image_starts: np.ndarray
    """int64 position of each image's run in its sample."""
    image_tokens: np.ndarray
    """int64 positions of each image's run."""
    image_costs: np.ndarray
    """int64 vision encoder cost of each image."""

    @classmethod
    def of(cls, layouts: list[SampleLayout]) -> LaidOutSamples:
        counts = np.array([layout.num_images for layout in layouts], dtype=np.int64)

        def column(name: str) -> np.ndarray:
            parts = [getattr(layout, name) for layout in layouts]
            return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

        return cls(
            lengths=np.array([layout.length for layout in layouts], dtype=np.int64),
            first_trained=np.array([layout.first_trained for layout in layouts], dtype=np.int64),
            image_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            image_starts=column("image_starts"),
            image_tokens=column("image_tokens"),
            image_costs=column("image_costs"),
        )

    def per_sample(self, column: np.ndarray) -> np.ndarray:
        """A per-image column summed per sample."""
        return np.add.reduceat(np.append(column, 0), self.image_offsets[:-1]) * (np.diff(self.image_offsets) > 0)

    def rows_at(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples as a run at this capacity packs them (``plan.CUT_ROW``), and which it skips:
        a sample longer than the capacity is cut as the builder cuts (``samples.truncation``: never
        inside an image run), and skipped when the cut leaves it no trained label."""
        offsets = self.image_offsets
        rows = np.empty(len(self.lengths), dtype=CUT_ROW)
        rows["length"] = self.lengths
        rows["num_images"] = np.diff(offsets)
        rows["image_tokens"] = self.per_sample(self.image_tokens)
        skip = np.zeros(len(rows), dtype=bool)
        for i in np.flatnonzero(self.lengths > capacity).tolist():
            images = slice(offsets[i], offsets[i + 1])
            cut, kept = truncation(self.image_starts[images], self.image_tokens[images], capacity)
            rows[i] = (cut - 1, kept, int(self.image_tokens[images][:kept].sum()))
            skip[i] = self.first_trained[i] >= cut - 1
        return rows, skip


class LayoutStream(IterableDataset):
    """Records of ``data_path`` -> lists of SampleLayout | Skipped, ``RECORDS_PER_MESSAGE`` consecutive
    records per message, message k laid out by worker k mod W (the DataLoader takes them in turn, so
    they arrive in input order)."""

    def __init__(self, data_path, builder: SampleBuilder):
        self.data_path = data_path
        self.builder = builder

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        ranges = ((k * RECORDS_PER_MESSAGE, (k + 1) * RECORDS_PER_MESSAGE) for k in itertools.count(worker, workers))
        message = []
        for raw in iter_raw_records(self.data_path, self.builder.record_limits, ranges=ranges):
            message.append(self.builder.layout(raw))
            if len(message) == RECORDS_PER_MESSAGE:
                yield message
                message = []
        if message:
            yield message


def lengths_from_input(sample: SampleConfig, pack: PackConfig, workers: int = 0) -> SampleLengths:
    """Every record of ``sample.data_path`` laid out as a preprocess run with these settings (its
    ``pack.sizes`` the candidate sizes) would build it, no pixel decoded; ``workers`` DataLoader
    workers (0: in this process)."""
    from neva_pack.pipeline.builder import sample_builder_for

    builder = sample_builder_for(sample, pack)
    return laid_out_lengths(builder, sample.data_path, alignment=pack.alignment, workers=workers)


def laid_out_lengths(builder: SampleBuilder, data_path, *, alignment: int = 1, workers: int = 0) -> SampleLengths:
    """Every record of ``data_path`` laid out by ``builder`` (cut at its max_seq_length), no pixel
    decoded, with the records it would skip counted by reason; ``alignment``: the multiple samples
    are padded to (the run's)."""
    layouts: list[SampleLayout] = []
    skipped: Counter[str] = Counter()
    for message in worker_messages(LayoutStream(data_path, builder), workers, in_flight=4):
        for item in message:
            if isinstance(item, Skipped):
                skipped[item.reason] += 1
            else:
                layouts.append(item)
    laid_out = LaidOutSamples.of(layouts)
    return SampleLengths(
        lengths=laid_out.lengths,
        truncated=sum(layout.truncated for layout in layouts),
        cut_at=builder.max_seq_length,
        source=str(data_path),
        pad_to_multiple_of=alignment,
        num_images=np.diff(laid_out.image_offsets),
        image_tokens=laid_out.per_sample(laid_out.image_tokens),
        vision_cost=laid_out.per_sample(laid_out.image_costs),
        laid_out=laid_out,
        skipped_records=dict(skipped),
        note=DECODE_SKIPS_NOTE,
    )
