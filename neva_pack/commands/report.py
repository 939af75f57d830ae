"""The run report: what a run (or ``neva-pack stats``) says about one packed prefix; saved as stats.json.

Every part is typed; ``RunReport.to_json`` writes stats.json (keys in field order) and
``RunReport.from_json`` reads it back, so ``to_json(from_json(x)) == x`` for any stats.json we write.
Fields added after the first release have defaults, so an older stats.json still loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "NO_PADDING",
    "AlgorithmSuggestion",
    "BalanceReport",
    "CountSummary",
    "PackingStats",
    "PaddingStats",
    "Percentiles",
    "RecordCounts",
    "RunReport",
    "VisualStats",
    "read_report",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CountSummary:
    """Mean and range of a per-pack count (samples per pack)."""

    mean: float
    """Mean over the packs (0.0 without packs)."""
    min: int
    """Smallest value (0 without packs)."""
    max: int
    """Largest value (0 without packs)."""

    @classmethod
    def from_json(cls, data: dict) -> CountSummary:
        return cls(mean=float(data["mean"]), min=int(data["min"]), max=int(data["max"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Percentiles:
    """Percentiles, range and mean of a distribution (all 0.0 when it is empty)."""

    p50: float
    """Median."""
    p90: float
    """90th percentile."""
    p99: float
    """99th percentile."""
    min: float
    """Smallest value."""
    max: float
    """Largest value."""
    mean: float
    """Mean value."""

    @classmethod
    def from_json(cls, data: dict) -> Percentiles:
        return cls(**{f.name: float(data[f.name]) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, slots=True, kw_only=True)
class PaddingStats:
    """Alignment padding (--pad_to_multiple_of): what it costs in positions."""

    pad_to_multiple_of: int = 1
    """M the samples were padded to a multiple of (1: no padding)."""
    positions: int = 0
    """Pad positions added over all packed samples."""
    overhead: float = 0.0
    """Pad positions over real positions (0.0 without padding)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VisualStats:
    """Per pack: images, image tokens and the vision encoder's cost, and the visual budgets the packs
    were made under (how close they come: the maximum over the budget)."""

    images_per_pack: CountSummary
    """Images of each pack."""
    image_tokens_per_pack: CountSummary | None
    """Image positions of each pack; None: unknown (an output written before the plan kept them)."""
    vision_cost_per_pack: CountSummary | None
    """Sum over each pack's images of patches squared per encoder pass; None: unknown."""
    max_images_per_pack: int | None = None
    """--max_images_per_pack the packs were made under (None: none)."""
    max_image_tokens_per_pack: int | None = None
    """--max_image_tokens_per_pack the packs were made under (None: none)."""
    video_tokens_per_pack: CountSummary | None = None
    """Video positions (its clips' runs, in its image positions too) of each pack; None: not known
    (only a run under --max_video_tokens_per_pack counts them)."""
    max_video_tokens_per_pack: int | None = None
    """--max_video_tokens_per_pack the packs were made under (None: none)."""

    @classmethod
    def from_json(cls, data: dict) -> VisualStats:
        def summary(value):
            return None if value is None else CountSummary.from_json(value)

        return cls(
            images_per_pack=CountSummary.from_json(data["images_per_pack"]),
            image_tokens_per_pack=summary(data.get("image_tokens_per_pack")),
            vision_cost_per_pack=summary(data.get("vision_cost_per_pack")),
            max_images_per_pack=data.get("max_images_per_pack"),
            max_image_tokens_per_pack=data.get("max_image_tokens_per_pack"),
            video_tokens_per_pack=summary(data.get("video_tokens_per_pack")),
            max_video_tokens_per_pack=data.get("max_video_tokens_per_pack"),
        )


NO_PADDING = PaddingStats()
"""What a run without --pad_to_multiple_of (or one older than the option) reports."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingStats:
    """stats.packing_stats(): how well the samples filled the packs."""

    packs: int
    """Packs written."""
    lower_bound_packs: int
    """ceil(positions packed, padding included / capacity): no packing can use fewer packs."""
    packs_over_lower_bound: float
    """packs / lower_bound_packs (1.0 is optimal)."""
    efficiency: float
    """Real positions over packs * capacity."""
    capacity: int
    """Positions per pack (max_seq_length)."""
    samples: int
    """Samples packed."""
    images: int
    """Images carried by the packs (the zero image of an image-less pack not counted)."""
    positions: int
    """Real positions packed (padding excluded)."""
    samples_per_pack: CountSummary
    """n, samples per pack: what the packed global batch size is divided by."""
    pack_fill: Percentiles
    """Fraction of each pack's capacity used (padding included)."""
    sample_length: Percentiles
    """Positions of each sample (text + image)."""
    samples_with_images: int | None
    """Samples with at least one image; None when per-sample image counts are unknown."""
    text_positions: Percentiles | None
    """Text positions of each sample; None when unknown."""
    image_positions_per_sample: Percentiles | None
    """Image positions of each sample; None when unknown."""
    padding: PaddingStats = NO_PADDING
    """Alignment padding (absent from stats.json files older than --pad_to_multiple_of)."""
    visual: VisualStats | None = None
    """Images, image tokens and vision cost per pack (None in a stats.json from before them)."""

    @classmethod
    def from_json(cls, data: dict) -> PackingStats:
        def percentiles(value):
            return None if value is None else Percentiles.from_json(value)

        return cls(
            packs=int(data["packs"]),
            lower_bound_packs=int(data["lower_bound_packs"]),
            packs_over_lower_bound=float(data["packs_over_lower_bound"]),
            efficiency=float(data["efficiency"]),
            capacity=int(data["capacity"]),
            samples=int(data["samples"]),
            images=int(data["images"]),
            positions=int(data["positions"]),
            samples_per_pack=CountSummary.from_json(data["samples_per_pack"]),
            pack_fill=Percentiles.from_json(data["pack_fill"]),
            sample_length=Percentiles.from_json(data["sample_length"]),
            samples_with_images=data.get("samples_with_images"),
            text_positions=percentiles(data.get("text_positions")),
            image_positions_per_sample=percentiles(data.get("image_positions_per_sample")),
            padding=PaddingStats(**data["padding"]) if "padding" in data else NO_PADDING,
            visual=VisualStats.from_json(data["visual"]) if data.get("visual") is not None else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmSuggestion:
    """What the recommended packing algorithm would have given instead (said only when worth it)."""

    algorithm: str
    """The recommended algorithm (packing.RECOMMENDED_ALGORITHM)."""
    packs: int
    """Packs it would need."""
    saving: float
    """Fraction of the packs it would save."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BalanceReport:
    """--balance_data_parallel N: straggler overhead (sum over steps of max - mean, over the sum of
    means) of N consecutive packs, in the packer's order (before) and the balanced one (after)."""

    data_parallel: int
    """N, the data-parallel ranks one step's packs are spread over."""
    attention_overhead_before: float
    """Attention cost (sum of squared sample lengths), packer's order."""
    attention_overhead_after: float
    """Attention cost, balanced order."""
    tokens_overhead_before: float
    """Positions, packer's order."""
    tokens_overhead_after: float
    """Positions, balanced order."""
    images_overhead_before: float
    """Images, packer's order."""
    images_overhead_after: float
    """Images, balanced order."""
    vision_overhead_before: float | None = None
    """The vision encoder's cost (sum over images of patches squared), packer's order; None in a
    report from before it was balanced."""
    vision_overhead_after: float | None = None
    """The vision encoder's cost, balanced order."""
    step_cost_model: str | None = None
    """--step_cost_model as set (auto, a preset, a JSON file, attention); None in a report from before it."""
    step_model: str | None = None
    """The model the order was balanced by (the preset auto chose, or the file); None: attention (no model)."""
    step_overhead_random: float | None = None
    """Modelled step time (``packing.step_cost``): a random order of the packs."""
    step_overhead_today: float | None = None
    """Modelled step time: the order by attention + vision cost, unweighted (before the model)."""
    step_overhead_after: float | None = None
    """Modelled step time: the order written (balanced by the model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClipStats:
    """The video clips a run stored: each distinct clip once, its kept frames as uint8 (sample store's pool)."""

    clips: int
    """Distinct clips stored."""
    frames: int
    """Frames they keep, summed."""
    bytes: int
    """uint8 bytes of those frames."""
    stored_bytes: int | None = None
    """Bytes they take in the pool: ``bytes`` when raw, less when compressed (None: a report from before)."""
    compression: str | None = None
    """The codec of a compressed pool (--frame_compression), None when raw."""

    @property
    def bytes_per_clip(self) -> float:
        return self.bytes / max(self.clips, 1)

    @property
    def stored_bytes_per_clip(self) -> float:
        return (self.bytes if self.stored_bytes is None else self.stored_bytes) / max(self.clips, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordCounts:
    """What happened to the input records."""

    total: int
    """Input records read."""
    packed: int
    """Records that became a packed sample."""
    skipped: int
    """Records skipped (listed in skipped.jsonl)."""
    truncated: int
    """Samples cut to the pack size."""
    skipped_by_reason: dict[str, int]
    """Skipped records by reason (records.SKIP_REASONS)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunReport:
    """Everything stats.json holds about one packed prefix."""

    dataset: str | None = None
    """File name of the input records (None for a prefix read without meta)."""
    records: RecordCounts | None
    """What happened to the input records (None when unknown)."""
    packing: PackingStats
    """How well the samples filled the packs."""
    algorithm: str | None
    """Packing algorithm (None when unknown)."""
    seed: int | None
    """Packing seed (None when unknown)."""
    suggestion: AlgorithmSuggestion | None
    """What the recommended algorithm would save, when worth saying."""
    balance: BalanceReport | None = None
    """--balance_data_parallel: N and the straggler overheads before/after; None without it."""
    max_seq_length: int
    """Pack capacity."""
    image_positions: int | None = None
    """Positions one image occupies (None when unknown)."""
    output_format: str | None = None
    """The prefix's format (formats.FORMATS key); None: a prefix in NeMo's layout without meta."""
    data_prefix: str
    """The packed prefix."""
    crop_size: list[int]
    """(H, W) of the images."""
    global_batch_size: int | None = None
    """Unpacked global batch size asked for."""
    packed_global_batch_size: int | None = None
    """The equivalent packed GBS (GBS / mean samples per pack)."""
    training_overrides: list[str]
    """NeMo config lines to train on the prefix."""
    seconds: float | None = None
    """Wall time of the run up to this prefix (None when not a run's report)."""
    input_digest: str | None = None
    """xxh3-128 of the input records file's bytes as packed: --resume and ``verify --data_path`` tell
    by it whether the input changed since (None in a report written before it was recorded)."""
    clips: ClipStats | None = None
    """Video clips stored (their count, frames and bytes); None: none, or a report from before clips."""

    def to_json(self) -> dict:
        """The stats.json layout: keys in field order, nested parts as objects."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunReport:
        """A report from stats.json (keys it does not know are ignored; newer optional ones may be absent)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        records, suggestion, balance = data.get("records"), data.get("suggestion"), data.get("balance")
        values["records"] = None if records is None else RecordCounts(**records)
        values["packing"] = PackingStats.from_json(data["packing"])
        values["suggestion"] = None if suggestion is None else AlgorithmSuggestion(**suggestion)
        values["balance"] = None if balance is None else BalanceReport(**balance)
        values["clips"] = None if data.get("clips") is None else ClipStats(**data["clips"])
        values["crop_size"] = list(data["crop_size"])
        values["training_overrides"] = list(data["training_overrides"])
        return cls(**values)

    def replace(self, **changes) -> RunReport:
        return dataclasses.replace(self, **changes)


def read_report(path) -> RunReport:
    """A stats file (stats.json, stats_<size>.json); InputError naming it if damaged."""
    from neva_pack.core import InputError, parsing
    from neva_pack.files import MAX_OUTPUT_JSON_BYTES, read_json

    data = read_json(path, what="", max_bytes=MAX_OUTPUT_JSON_BYTES, error=InputError)
    with parsing(path):
        return RunReport.from_json(data)
