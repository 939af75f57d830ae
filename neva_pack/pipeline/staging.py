"""A run on object storage: an ``s3://`` --data_path copied in, an ``s3://`` --output_dir staged on a
local disk and mirrored to the bucket, so that every stage stays the POSIX one (locks, renames,
checksums, resume) and the bucket only ever holds what a POSIX output directory could.

    s3://bucket/out/  --pull-->  $NEVA_PACK_STAGING_DIR/outputs/<hash of the URL>/run-<pid>-*/
                                   the run, as on a local disk (its own directory, removed when it ends)
                      <--mirror--  at each store commit: the committed segment's files, then progress.json
                      <--mirror--  at the end (or a failure): every file, stale ones deleted, metas last

- The bucket is the truth: a restarted pod (any node) pulls what the bucket holds and continues from
  its last committed segment, proved by content as any resume (its checksums, the input's digest).
- Complete only when complete: a prefix's meta and a store's progress file are sent after the files
  they vouch for, and an old one is deleted before a file it vouched for is replaced
  (``files.remote.mirror``); ``verify``, ``stats`` and the readers see a missing meta as incomplete.
- A shard pulls and mirrors only its own part (``packed_seq_dataset/part_<i>_of_<N>/``): the shards
  run on any nodes at once; the final step pulls the whole output, joins, and mirrors it back (the
  parts are deleted from the bucket once the joined store is there).
- --image_folder is not staged: images are read from the bucket by range (``families.ImageSource``).

Each run stages in a directory of its own, removed when it ends (a killed run's is removed by the
next run of that output on the machine): nothing on a local disk outlives a run, so nothing there is
ever trusted over the bucket. Two runs given the same output (or two pods the same shard) at once are
kept apart by a lock object in the bucket (``files.RemoteLock``: the output's, or the part's), taken
before anything is pulled, refreshed while the run lives, checked before each mirror, and released at
the end: the second is refused in one line naming the holder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from neva_pack.config import PreprocessConfig
from neva_pack.core import ConfigError
from neva_pack.files import (
    LOCK_FILE,
    META_SUFFIX,
    Mirrored,
    RemoteLock,
    is_remote,
    local_copy,
    mirror,
    paths,
    pull,
    remote_listing,
    staging_root,
    store_dir,
    url_join,
)
from neva_pack.sample_store import PROGRESS_FILE, commits_reported_to, part_dir

__all__ = ["is_marker", "needs_staging", "staged", "staged_output"]


def needs_staging(config: PreprocessConfig) -> bool:
    """Whether the run's input file or output is remote (an image folder is read where it is)."""
    return is_remote(config.sample.data_path) or is_remote(config.run.output_dir)


def is_marker(name: str) -> bool:
    """A file that marks what beside it is complete: a prefix's meta, a store's (or part's) progress file."""
    base = name.rsplit("/", 1)[-1]
    return base.endswith(META_SUFFIX) or base == PROGRESS_FILE


def _the_lock(name: str) -> bool:
    """The lock is the staging disk's own: never pulled nor mirrored."""
    return name.rsplit("/", 1)[-1] == LOCK_FILE


def _not_sent(name: str) -> bool:
    """Names of an output (relative to it) never pulled nor mirrored: the lock, and anything a run does
    not write (a user's object beside the output is neither copied, nor counted, nor deleted)."""
    return _the_lock(name) or not _written_by_a_run(name)


def _written_by_a_run(name: str) -> bool:
    """A name a run writes at the output's top (``files.paths``): the store and every prefix's files
    (``packed_seq_dataset*``), the stats files and the skipped lists (and their temporary names)."""
    top = name.split("/", 1)[0].removesuffix(paths.TMP_SUFFIX)
    return (top.startswith(paths.PACKED_NAME) or paths.is_skipped_list(top)
            or re.fullmatch(r"stats(_\d+)?\.json", top) is not None)  # fmt: skip


def _refuse_if_not_empty(url: str, run) -> None:
    """A prefix holding objects a run does not write is refused unless --resume or --overwrite, as a
    non-empty local directory is (they are left where they are either way); the final step of a
    sharded run expects its parts in the store."""
    if run.resume or run.overwrite:
        return
    final_step = run.num_shards is not None  # its parts are in the store, as a local final step expects
    held = sorted(name for name in remote_listing(url)
                  if not (_the_lock(name) or (final_step and name.startswith(paths.STORE_DIR + "/"))))
    if held:
        raise ConfigError(f"--output_dir {url}: not empty ({held[0]}{', ...' if len(held) > 1 else ''}); "
                          "pass --resume to continue an interrupted run or --overwrite to replace it")  # fmt: skip


def staged_output(url: str) -> Path:
    """Where the runs of the output at ``url`` stage on this machine (each in a ``run-<pid>-*`` directory)."""
    import xxhash

    return staging_root() / "outputs" / xxhash.xxh3_64_hexdigest(url.encode("utf-8"))


def _run_directory(base: Path) -> Path:
    """A new staging directory of this process under ``base``, once those of dead processes are removed."""
    base.mkdir(parents=True, exist_ok=True)
    for entry in base.iterdir():
        match = re.fullmatch(r"run-(\d+)-.*", entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@contextlib.contextmanager
def staged(config: PreprocessConfig) -> Iterator[PreprocessConfig]:
    """The config of the same run on local paths, for the duration of the run: the input copied in,
    the output (or a shard's part of it) pulled into its staging directory and mirrored back at each
    store commit and at the end."""
    sample, run = config.sample, config.run
    if is_remote(sample.data_path):
        sample = dataclasses.replace(sample, data_path=local_copy(sample.data_path, "--data_path"))
    if not is_remote(run.output_dir):
        yield PreprocessConfig(sample=sample, pack=config.pack, run=run)
        return
    url, local = run.output_dir, _run_directory(staged_output(run.output_dir))
    try:
        yield from _mirrored(config, sample, url, local)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _mirrored(config: PreprocessConfig, sample, url: str, local: Path) -> Iterator[PreprocessConfig]:
    """``staged`` once the output has a staging directory: pull, run, mirror."""
    run = config.run
    sharded = run.num_shards is not None and run.shard_index is not None
    part = part_dir(store_dir(local), run.num_shards, run.shard_index) if sharded else None
    locked = url_join(url, part.relative_to(local).as_posix()) if sharded else url
    with RemoteLock(locked, f"--output_dir {url}" + (f" (shard {run.shard_index})" if sharded else "")) as lock:
        if sharded:  # its part only: every file there is a part's
            skip = _the_lock
            state = pull(locked, part, skip=skip)
        else:
            _refuse_if_not_empty(url, run)
            skip = _not_sent
            state = pull(url, local, skip=skip)
        local_config = PreprocessConfig(sample=sample, pack=config.pack, run=dataclasses.replace(run, output_dir=local))
        try:
            with commits_reported_to(lambda directory: _committed(state, Path(directory), skip, lock)):
                yield local_config
        except BaseException:
            with contextlib.suppress(Exception):  # what the run committed or reported is kept, as on a local disk
                lock.check()
                mirror(state, is_marker, skip=skip)
            raise
        lock.check()
        mirror(state, is_marker, skip=skip)


def _committed(state: Mirrored, directory: Path, skip, lock: RemoteLock) -> None:
    """A store (or part) committed a segment in ``directory``: send its files, then its progress file
    (unless another run took this one's lock over: then it stops)."""
    lock.check()
    under = directory.relative_to(state.local).as_posix() if directory != state.local else ""
    mirror(state, is_marker, under="" if under == "." else under, skip=skip)
