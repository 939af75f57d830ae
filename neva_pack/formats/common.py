"""Helpers shared by the format modules: Megatron-Core's lazy import, versioned JSON."""

from __future__ import annotations

import functools
import json
import logging
import os
import warnings
from pathlib import Path


@functools.cache
def megatron():
    """Megatron-Core's indexed dataset module, for reading an output as training reads it (nemo.Reader,
    verify); imported lazily (seconds, and noisy warnings). Preprocessing writes and reads the same
    file format with formats/indexed.py and never imports it."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on CPU hosts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex / Transformer Engine
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def fsync_close(file) -> None:
    file.flush()
    os.fsync(file.fileno())
    file.close()


def read_versioned(path: Path, expected_format: str, supported_version: int) -> dict:
    from neva_pack.errors import InputError

    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing (the output is incomplete or not a neva_pack output)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from None
    if meta.get("format") != expected_format:
        raise InputError(f"{path}: format {meta.get('format')!r}, expected {expected_format!r}")
    if not isinstance(meta.get("version"), int) or meta["version"] > supported_version:
        raise InputError(f"{path}: version {meta.get('version')!r} is newer than this neva_pack reads ({supported_version})")
    return meta

