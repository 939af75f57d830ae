"""The image run, the ids one image takes in a sequence (``[start] patch ... patch [end]``).

One type from the sample builder to the writers and the pack checks. A fixed-crop encoder's run
has one length for every image (``positions``); a dynamic-resolution family's (Qwen2-VL, LLaVA-NeXT)
has ``positions=None``: each image's patch count is its own (``ids(features)``), decided by its size.

On disk it is spelled twice, and those spellings stay as they are: an output's meta records
``image_positions`` and ``image_token_ids`` ({patch, start, end}; ``PackedMeta.image_run`` reads them
back as an ImageRun), and the sample store's progress.json records the run's ids as [id, repeats]
pairs (``sample_store.files.run_pairs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ImageRun"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageRun:
    """How one image's positions are spelled as token ids."""

    positions: int | None
    """Sequence positions per image (what the encoder produces, plus start/end if added); None for a
    dynamic-resolution family, where each image has its own."""
    patch_id: int
    """Id of every image-embedding position."""
    start_id: int | None = None
    """Id opening an image run (NeMo: <extra_id_4>; Qwen2-VL: <|vision_start|>), or None."""
    end_id: int | None = None
    """Id closing an image run (NeMo: <extra_id_5>; Qwen2-VL: <|vision_end|>), or None."""

    @property
    def dynamic(self) -> bool:
        """Each image's run has its own length (``ids(features)``)."""
        return self.positions is None

    @property
    def delimiters(self) -> int:
        """Positions of the start and end ids (0, 1 or 2)."""
        return (self.start_id is not None) + (self.end_id is not None)

    def length(self, features: int | None = None) -> int:
        """Positions of a run of ``features`` image features (fixed runs: ``positions`` without one)."""
        if features is None:
            return self._fixed_positions()
        return features + self.delimiters

    def ids(self, features: int | None = None) -> np.ndarray:
        """The int64 ids of the run, ``length(features)`` long: [start] patch ... patch [end]."""
        inner = self._fixed_positions() - self.delimiters if features is None else features
        ids = ([self.start_id] if self.start_id is not None else []) + [self.patch_id] * inner
        return np.asarray(ids + ([self.end_id] if self.end_id is not None else []), dtype=np.int64)

    def _fixed_positions(self) -> int:
        if self.positions is None:
            raise ValueError("a dynamic image run has no length of its own: give the image's features")
        return self.positions
