"""Training side: batches for the trainers that read our packs.

    thd.py   Megatron-Core / Megatron Bridge THD batches (one row, samples told apart by cu_seqlens),
             PackedSeqParams, the NaN-safe loss recipe
    cp.py    each context-parallel rank's share of a THD batch, as Transformer Engine partitions it
"""

from neva_pack.training.cp import cp_partition_index, cp_slice
from neva_pack.training.thd import packed_seq_params, thd_batch, thd_collate

__all__ = ["cp_partition_index", "cp_slice", "packed_seq_params", "thd_batch", "thd_collate"]
