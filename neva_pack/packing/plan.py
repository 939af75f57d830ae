"""The packing plan: which sample indices go into which pack (bin).

A plan is stored in CSR form so that 10^7 samples cost two int64 arrays, not
10^6 Python lists::

    lengths  = [5, 3, 4, 2]          capacity = 8
    offsets  = [0, 2, 4]             bin b = indices[offsets[b]:offsets[b+1]]
    indices  = [0, 1, 2, 3]          bin 0 = samples 0, 1 (5+3=8); bin 1 = samples 2, 3 (4+2=6)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingPlan:
    offsets: np.ndarray
    """int64, num_bins + 1 entries, offsets[0] == 0, offsets[-1] == number of samples."""
    indices: np.ndarray
    """int64, every sample index exactly once, grouped by bin; order inside a bin = insertion order."""
    bin_loads: np.ndarray
    """int64, sum of the sample lengths of each bin (never above capacity)."""
    capacity: int
    """The bin size (max_seq_length) the plan was made for."""
    algorithm: str
    """Registry name of the algorithm that produced the plan."""
    seed: int
    """Seed of the np.random.Generator the algorithm used (ignored by deterministic ones)."""

    @property
    def num_bins(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    @property
    def total_length(self) -> int:
        return int(self.bin_loads.sum())

    @property
    def efficiency(self) -> float:
        """sum(lengths) / (num_bins * capacity): the fraction of pack positions that hold data."""
        if self.num_bins == 0:
            return 1.0
        return self.total_length / (self.num_bins * self.capacity)

    @property
    def lower_bound(self) -> int:
        """ceil(sum(lengths) / capacity): no plan can use fewer bins."""
        return -(-self.total_length // self.capacity)

    @property
    def samples_per_bin(self) -> np.ndarray:
        return np.diff(self.offsets)

    def bin(self, b: int) -> np.ndarray:
        """Sample indices of bin ``b`` in pack order."""
        return self.indices[self.offsets[b] : self.offsets[b + 1]]

    def bins(self) -> list[list[int]]:
        """The plan as nested lists (for tests and small inputs only)."""
        return [self.bin(b).tolist() for b in range(self.num_bins)]
