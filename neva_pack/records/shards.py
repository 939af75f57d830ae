"""The records' split of a sharded run: --num_shards / --shard_index (or a SLURM job array), and the
contiguous record range of each shard. Each shard writes its own part of the sample store and a
final step joins them (pipeline/parts.py); this module is what the command line and the config
need to know about it.
"""

from __future__ import annotations

import os

from neva_pack.core import ConfigError

__all__ = ["resolve_shards", "shard_range"]


def shard_range(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """Records [first, end) of shard ``index``: contiguous, sizes differing by at most one."""
    return total * index // num_shards, total * (index + 1) // num_shards


def resolve_shards(num_shards: int | None, shard_index: int | None, environ=os.environ) -> tuple[int | None, int | None]:
    """--num_shards / --shard_index, defaulting from a SLURM job array (--array=0-(N-1)): the task id is
    the shard index, so a resubmitted subset (--array=3,7 with --num_shards N) redoes those shards."""
    if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in environ:
        num_shards = _slurm_number(environ, "SLURM_ARRAY_TASK_COUNT", "--num_shards")
    if num_shards is not None and shard_index is None and "SLURM_ARRAY_TASK_ID" in environ:
        shard_index = _slurm_number(environ, "SLURM_ARRAY_TASK_ID", "--shard_index")
    if num_shards is None and shard_index is not None:
        raise ConfigError("--shard_index needs --num_shards")
    if num_shards is not None and num_shards < 1:
        raise ConfigError(f"--num_shards {num_shards}: must be >= 1")
    if shard_index is not None and not 0 <= shard_index < num_shards:
        raise ConfigError(f"--shard_index {shard_index}: must be between 0 and --num_shards - 1 ({num_shards - 1})")
    return num_shards, shard_index


def _slurm_number(environ, name: str, flag: str) -> int:
    value = environ[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number (it stands for {flag}); "
                          f"pass {flag} explicitly or unset {name}") from None
