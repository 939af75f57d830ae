"""Training side: batches for the trainers that read our packs.

    thd.py      Megatron-Core / Megatron Bridge THD batches (one row, samples told apart by cu_seqlens),
                PackedSeqParams, the NaN-safe loss recipe
    cp.py       each context-parallel rank's share of a THD batch, as Transformer Engine partitions it
    hf.py       Hugging Face flattened batches (position_ids restarting, cu_seq_lens_q/k, shift_labels)
    sampler.py  PackedBatchSampler: packs planned per epoch over sample lengths, balanced across ranks
"""

from neva_pack.training.cp import cp_partition_index, cp_slice
from neva_pack.training.hf import HF_IGNORE_INDEX, MaskSettings, hf_batch, hf_collate, packed_attention_masks
from neva_pack.training.sampler import EpochPlan, PackedBatchSampler
from neva_pack.training.thd import image_embedding_index, packed_seq_params, thd_batch, thd_collate


__all__ = [
    "EpochPlan",
    "HF_IGNORE_INDEX",
    "MaskSettings",
    "PackedBatchSampler",
    "cp_partition_index",
    "cp_slice",
    "hf_batch",
    "hf_collate",
    "image_embedding_index",
    "packed_attention_masks",
    "packed_seq_params",
    "thd_batch",
    "thd_collate",
]
