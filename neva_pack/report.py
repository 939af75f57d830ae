"""The run report: what a run (or ``neva-pack stats``) says about one packed prefix; saved as stats.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordCounts:
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
    dataset: str | None
    """File name of the input records (None for a prefix read without meta)."""
    records: RecordCounts | None
    """What happened to the input records (None when unknown)."""
    packing: dict
    """stats.packing_stats(): packs, lower bound, efficiency, fill and length percentiles."""
    algorithm: str | None
    """Packing algorithm."""
    seed: int | None
    """Packing seed."""
    suggestion: dict | None
    """What the recommended algorithm would save, when worth saying."""
    balance: dict | None = None
    """--balance_data_parallel: N and the straggler overheads (attention, tokens, images) before/after."""
    max_seq_length: int
    """Pack capacity."""
    image_positions: int | None = None
    """Positions one image occupies."""
    output_format: str | None = None
    """The prefix's format (formats.FORMATS key)."""
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
    """Wall time of the run up to this prefix."""

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["records"] = None if self.records is None else dataclasses.asdict(self.records)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RunReport":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        records = data.get("records")
        values["records"] = None if records is None else RecordCounts(**records)
        return cls(**values)

    def replace(self, **changes) -> "RunReport":
        return dataclasses.replace(self, **changes)
