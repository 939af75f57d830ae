"""Megatron-Core's indexed dataset module, imported lazily, for the readers that read as training does."""

from __future__ import annotations

import functools
import logging
import warnings


@functools.cache
def megatron():
    """Megatron-Core's indexed dataset module, for reading an output as training reads it (nemo.Reader,
    verify); imported lazily (seconds, and noisy warnings). Preprocessing writes and reads the same
    file format with files/indexed.py and never imports it."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on CPU hosts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex / Transformer Engine
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset
