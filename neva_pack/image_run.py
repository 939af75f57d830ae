"""The image run, the ids one image takes in a sequence (``[start] patch ... patch [end]``).

One type from the sample builder to the writers and the pack checks. On disk it is spelled twice,
and those spellings stay as they are: an output's meta records ``image_positions`` and
``image_token_ids`` ({patch, start, end}; ``PackedMeta.image_run`` reads them back as an
ImageRun), and the sample store's progress.json records the run's ids as [id, repeats] pairs
(``sample_store.files.run_pairs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ImageRun"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageRun:
    """How one image's positions are spelled as token ids."""

    positions: int
    """Sequence positions per image (what the encoder produces, plus start/end if added)."""
    patch_id: int
    """Id of every image-embedding position."""
    start_id: int | None = None
    """Id opening an image run (NeMo: <extra_id_4>), or None."""
    end_id: int | None = None
    """Id closing an image run (NeMo: <extra_id_5>), or None."""

    def ids(self) -> np.ndarray:
        """The int64 ids of the run, ``positions`` long: [start] patch ... patch [end]."""
        inner = self.positions - (self.start_id is not None) - (self.end_id is not None)
        ids = ([self.start_id] if self.start_id is not None else []) + [self.patch_id] * inner
        return np.asarray(ids + ([self.end_id] if self.end_id is not None else []), dtype=np.int64)
