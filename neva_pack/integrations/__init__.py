"""Trainers that read our packs with no glue: one module per trainer, each what a user hands it.

    hf_trainer.py  transformers' Trainer: the TrainingArguments packs need, the dataset and hf_collate
    trl.py         TRL's SFTTrainer: the SFTConfig packs need, an index dataset and a collate reading packs
    automodel.py   NeMo Automodel's VLM recipe: a dataset its YAML builds, items for its neat_packed_vlm_collater
    megatron_bridge.py  Megatron Bridge's vlm_step: a DatasetProvider whose dataset collates its packed THD rows

The modules depend on the readers (``reading``, ``training``) and never the other way; the trainers
themselves (``transformers.Trainer`` with ``accelerate``, ``trl``) are imported only when a function is
called, so that importing neva_pack never needs them (``pip install 'neva-pack[hf]'`` or ``[trl]``).
"""

from neva_pack.integrations.automodel import AUTOMODEL_IGNORE_INDEX, AutomodelPacks, packed_dataset
from neva_pack.integrations.megatron_bridge import BRIDGE_IGNORE_INDEX, BRIDGE_IMAGE_REFERENCE, BridgeVLMPacks, bridge_vlm_batch, bridge_vlm_packs, check_seq_length
from neva_pack.integrations.hf_trainer import NoCacheRows, check_training_arguments, trainer_data, training_arguments
from neva_pack.integrations.trl import PackRows, check_sft_config, sft_config, sft_data

__all__ = [
    "AUTOMODEL_IGNORE_INDEX",
    "AutomodelPacks",
    "BRIDGE_IGNORE_INDEX",
    "BRIDGE_IMAGE_REFERENCE",
    "BridgeVLMPacks",
    "NoCacheRows",
    "PackRows",
    "bridge_vlm_batch",
    "bridge_vlm_packs",
    "check_sft_config",
    "check_seq_length",
    "check_training_arguments",
    "packed_dataset",
    "sft_config",
    "sft_data",
    "trainer_data",
    "training_arguments",
]
