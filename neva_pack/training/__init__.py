"""Training side: batches for the trainers that read our packs.

    thd.py      Megatron-Core THD batches (one row, samples told apart by cu_seqlens) and PackedSeqParams
    hf.py       Hugging Face flattened batches (position_ids restarting, cu_seq_lens_q/k, shift_labels)
    sampler.py  PackedBatchSampler: packs planned per epoch over sample lengths, balanced across ranks
"""

from neva_pack.training.hf import hf_batch, hf_collate
from neva_pack.training.sampler import EpochPlan, PackedBatchSampler
from neva_pack.training.thd import packed_seq_params, thd_batch, thd_collate

__all__ = ["EpochPlan", "PackedBatchSampler", "hf_batch", "hf_collate", "packed_seq_params", "thd_batch", "thd_collate"]
