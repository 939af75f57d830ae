"""Packs assembled from a plan and the sample store, checked, and prepared for their format: in one place
(``assemble``), and in DataLoader workers (``parallel``).
"""

from neva_pack.assembly.assemble import AssembledPack, assemble_packs, rows_at
from neva_pack.assembly.parallel import PackJob, pack_batches

__all__ = [
    "AssembledPack",
    "PackJob",
    "assemble_packs",
    "pack_batches",
    "rows_at",
]
