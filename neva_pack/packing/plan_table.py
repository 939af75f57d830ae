"""The plan table: which input records each pack holds, in pack order.

Every format keeps it (nemo in ``<prefix>.plan.npz``, compact inside its index) and every reader
returns it (``plan_table()``): verify checks the packs against it, stats summarises it, convert
rewrites it. Built from the packing plan over the sample store's rows (``PlanTable.of``)::

    plan bins [[s7, s2], [s4]]     offsets [0, 2, 3]   record_index [7, 2, 4]   length [5, 3, 6] ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from neva_pack.core import parsing
from neva_pack.packing.alignment import padded_lengths

if TYPE_CHECKING:
    from neva_pack.packing.plan import PackingPlan

__all__ = ["PlanTable", "read_plan_table", "write_plan_table"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTable:
    """Which input records each pack holds, in pack order (what verify and stats trace back)."""

    offsets: np.ndarray
    """int64 (packs + 1): pack p holds rows offsets[p]:offsets[p + 1]."""
    record_index: np.ndarray
    """int64: input record of each sample."""
    length: np.ndarray
    """int64: real positions of each sample."""
    padded_length: np.ndarray
    """int64: positions the sample occupies in its pack (length rounded up to pad_to_multiple_of)."""
    num_images: np.ndarray
    """int64: images of each sample."""
    image_tokens: np.ndarray | None = None
    """int64: positions of each sample's image runs; None in an output written before it was kept."""
    vision_cost: np.ndarray | None = None
    """int64: the vision encoder's cost of each sample's images (sum of patches squared per encoder
    pass); None in an output written before it was kept."""

    @classmethod
    def of(cls, rows: np.ndarray, plan: PackingPlan, pad_to_multiple_of: int = 1) -> "PlanTable":
        """The plan over the sample store's rows (as cut for this pack size), in pack order."""
        packed = rows[plan.indices]
        return cls(
            offsets=np.asarray(plan.offsets, dtype=np.int64),
            record_index=packed["record_index"].astype(np.int64),
            length=packed["length"].astype(np.int64),
            padded_length=padded_lengths(packed["length"], pad_to_multiple_of),
            num_images=packed["num_images"].astype(np.int64),
            image_tokens=packed["image_tokens"].astype(np.int64),
            vision_cost=packed["vision_cost"].astype(np.int64),
        )

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The arrays it has (an older table's unknown columns are left out, never made up)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_arrays(cls, arrays: dict) -> "PlanTable":
        """The table of these arrays; ValueError if they do not describe packs (stats and convert
        index with them: a damaged table must be refused, not read out of range or summed wrong)."""
        length = np.asarray(arrays["length"], dtype=np.int64)
        padded = arrays.get("padded_length")
        optional = {name: None if arrays.get(name) is None else np.asarray(arrays[name], dtype=np.int64)
                    for name in ("image_tokens", "vision_cost")}  # fmt: skip
        table = cls(
            offsets=np.asarray(arrays["offsets"], dtype=np.int64),
            record_index=np.asarray(arrays["record_index"], dtype=np.int64),
            length=length,
            padded_length=length if padded is None else np.asarray(padded, dtype=np.int64),
            num_images=np.asarray(arrays["num_images"], dtype=np.int64),
            **optional,
        )
        table._check()
        return table

    def _check(self) -> None:
        """Consistent with itself (whether it agrees with the packs is verify's question)."""
        offsets, samples = self.offsets, len(self.length)
        if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or np.any(np.diff(offsets) <= 0) or offsets[-1] != samples:
            raise ValueError(f"offsets are not increasing from 0 to its {samples} samples")
        optional = [values for values in (self.image_tokens, self.vision_cost) if values is not None]
        if any(len(values) != samples for values in (self.record_index, self.padded_length, self.num_images, *optional)):
            raise ValueError(f"arrays of different lengths for {samples} samples")
        if np.any(self.length <= 0) or np.any(self.padded_length < self.length) or np.any(self.num_images < 0):
            raise ValueError("a sample length, padded length or image count out of range")
        if any(np.any(values < 0) for values in optional):
            raise ValueError("a sample's image tokens or vision cost is negative")
        if self.image_tokens is not None and np.any(self.image_tokens > self.length):
            raise ValueError("a sample has more image tokens than positions")


def read_plan_table(path: Path) -> PlanTable:
    """``<prefix>.plan.npz``; InputError naming it if damaged."""
    from neva_pack.core import InputError
    from neva_pack.files import MAX_OUTPUT_TABLE_BYTES, open_file

    with open_file(path, what="", max_bytes=MAX_OUTPUT_TABLE_BYTES, error=InputError) as f:
        with parsing(path), np.load(f) as table:
            return PlanTable.from_arrays({key: table[key] for key in table.files})


def write_plan_table(path: Path, table: PlanTable) -> None:
    """``<prefix>.plan.npz``: the table's arrays in a numpy archive."""
    np.savez(path, **table.to_arrays())
