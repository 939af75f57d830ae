"""Training side: batches for the trainers that read our packs.

    thd.py   Megatron-Core THD batches (one row, samples told apart by cu_seqlens) and PackedSeqParams
"""

from neva_pack.training.thd import packed_seq_params, thd_batch, thd_collate

__all__ = ["packed_seq_params", "thd_batch", "thd_collate"]
