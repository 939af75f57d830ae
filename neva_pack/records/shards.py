"""The records' split of a sharded run: --num_shards / --shard_index (or the index an engine hands each
task: a SLURM job array's SLURM_ARRAY_TASK_ID, a Kubernetes Indexed Job's JOB_COMPLETION_INDEX), and
the contiguous record range of each shard. Each shard writes its own part of the sample store and a
final step joins them (pipeline/parts.py); this module is what the command line and the config
need to know about it.
"""

from __future__ import annotations

import os

from neva_pack.core import ConfigError

__all__ = ["SHARD_LIST_VARIABLE", "resolve_shards", "shard_range"]

SHARD_LIST_VARIABLE = "NEVA_PACK_SHARD_INDEXES"
"""With JOB_COMPLETION_INDEX: the shards a resubmitted Kubernetes Indexed Job redoes ("3,7": its pod k
runs the k-th), since an Indexed Job can only number its pods 0..completions-1."""


def shard_range(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """Records [first, end) of shard ``index``: contiguous, sizes differing by at most one."""
    return total * index // num_shards, total * (index + 1) // num_shards


def resolve_shards(num_shards: int | None, shard_index: int | None, environ=os.environ) -> tuple[int | None, int | None]:
    """--num_shards / --shard_index; explicit flags win, then the engine's variables:

    - a SLURM job array (--array=0-(N-1)): SLURM_ARRAY_TASK_COUNT is the default --num_shards and the
      task id the shard index, so a resubmitted subset (--array=3,7 with --num_shards N) redoes those;
    - a Kubernetes Indexed Job: JOB_COMPLETION_INDEX is the shard index. It needs --num_shards, since
      nothing in the pod says how many there are (a resubmitted subset runs completions: 2 with
      NEVA_PACK_SHARD_INDEXES=3,7, pod k doing the k-th of them).
    """
    if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in environ:
        num_shards = _env_number(environ, "SLURM_ARRAY_TASK_COUNT", "--num_shards")
    if num_shards is not None and shard_index is None and "SLURM_ARRAY_TASK_ID" in environ:
        shard_index = _env_number(environ, "SLURM_ARRAY_TASK_ID", "--shard_index")
    if shard_index is None and "JOB_COMPLETION_INDEX" in environ:
        if num_shards is None:
            raise ConfigError(f"JOB_COMPLETION_INDEX={environ['JOB_COMPLETION_INDEX']!r} (a Kubernetes Indexed Job) "
                              "needs --num_shards: pass the number of shards (the Job's completions)")  # fmt: skip
        shard_index = _job_index(environ)
    if num_shards is None and shard_index is not None:
        raise ConfigError("--shard_index needs --num_shards")
    if num_shards is not None and num_shards < 1:
        raise ConfigError(f"--num_shards {num_shards}: must be >= 1")
    if shard_index is not None and not 0 <= shard_index < num_shards:
        raise ConfigError(f"--shard_index {shard_index}: must be between 0 and --num_shards - 1 ({num_shards - 1})")
    return num_shards, shard_index


def _job_index(environ) -> int:
    """The shard of a Kubernetes Indexed Job's pod: its completion index, or the entry it picks of
    NEVA_PACK_SHARD_INDEXES (a resubmitted subset)."""
    index = _env_number(environ, "JOB_COMPLETION_INDEX", "--shard_index")
    listed = environ.get(SHARD_LIST_VARIABLE)
    if listed is None:
        return index
    try:
        shards = [int(item) for item in listed.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"{SHARD_LIST_VARIABLE}={listed!r}: not a list of shard indexes such as 3,7") from None
    if not 0 <= index < len(shards):
        raise ConfigError(f"JOB_COMPLETION_INDEX={index}: {SHARD_LIST_VARIABLE}={listed!r} lists {len(shards)} shard(s); "
                          f"the Job's completions must be {len(shards)}")  # fmt: skip
    return shards[index]


def _env_number(environ, name: str, flag: str) -> int:
    value = environ[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number (it stands for {flag}); "
                          f"pass {flag} explicitly or unset {name}") from None
