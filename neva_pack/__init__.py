"""neva_pack: sequence-packing preprocessing for multimodal (NeVA / LLaVA) fine-tuning.

The public face. Each name is imported from its layer on first use (PEP 562), so that importing a
low layer (``neva_pack.core``, ``neva_pack.packing``) never drags in torch or the whole pipeline::

    from neva_pack import PreprocessConfig, preprocess      # the run (pipeline/)
    from neva_pack import run_shard, finish_shards, shards_status   # a sharded run (SLURM, Kubernetes, Ray)
    from neva_pack import pack, PackingPlan                 # lengths -> bins (packing/)
    from neva_pack import open_packed, PackedSeqDataset     # reading any format back (formats/, reading/)
    from neva_pack import hf_collate, thd_collate, PackedBatchSampler, cp_slice   # training/
    from neva_pack import verify, convert, read_report      # the tools (commands/)
"""

from importlib import import_module

from neva_pack.core import VERSION as __version__

_HOMES = {
    "PreprocessConfig": "neva_pack.config",
    "preprocess": "neva_pack.pipeline",
    "run_shard": "neva_pack.pipeline",
    "finish_shards": "neva_pack.pipeline",
    "shards_status": "neva_pack.pipeline",
    "pack": "neva_pack.packing",
    "PackingPlan": "neva_pack.packing",
    "ALGORITHMS": "neva_pack.packing",
    "open_packed": "neva_pack.formats",
    "FORMATS": "neva_pack.formats",
    "PackedSeqDataset": "neva_pack.reading",
    "hf_batch": "neva_pack.training",
    "hf_collate": "neva_pack.training",
    "thd_batch": "neva_pack.training",
    "thd_collate": "neva_pack.training",
    "cp_slice": "neva_pack.training",
    "PackedBatchSampler": "neva_pack.training",
    "verify": "neva_pack.commands",
    "convert": "neva_pack.commands",
    "read_report": "neva_pack.commands",
    "NevaPackError": "neva_pack.core",
    "ConfigError": "neva_pack.core",
    "InputError": "neva_pack.core",
}

__all__ = ["__version__", *_HOMES]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'neva_pack' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
