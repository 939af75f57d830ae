"""Who may write an output directory, and what --overwrite may delete in it: the first stage of a
run (``prepare_output_dir``, ``prepare_part_dir``), before anything is written.

- One run at a time: a run holds an OS lock (``flock``) on ``output_dir/.neva_pack.lock`` from
  before it touches anything until it ends (a crash or a kill releases it). The file names the
  holder (pid, host, start time) so that a second run can say who is in the way; it is removed
  when the run ends. A killed run leaves it behind, harmlessly: the lock, not the file, is what
  is held, and the kernel drops the lock with the process.
- ``--overwrite`` (and ``--resume``, which deletes uncommitted store segments) touch only paths this tool
  writes *and* whose content it recognises as its own: the sample store by its progress.json
  format (or segment file names), each format's files as the format recognises them (``owns``: its
  meta by the format field, ...), stats and skipped lines (``skipped[_<size>].jsonl``) by their keys. Anything else under one of our
  names (say, the user's image folder called ``packed_seq_dataset``) stops the run before a
  byte is deleted, as does an input (data, images, tokenizer) lying inside what would be deleted.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

from neva_pack.config import RunConfig
from neva_pack.files import LOCK_FILE, paths
from neva_pack.core import ConfigError, InputError
from neva_pack.formats import declared_files
from neva_pack.sample_store import PROGRESS_FILE, STORE_FORMAT, is_store_file, part_dir, part_of

__all__ = [
    "LOCK_FILE", "OutputLock", "entries", "is_part_file", "lock_holder", "output_paths", "owned_outputs",
    "prepare_output_dir", "prepare_part_dir", "remove",
]  # fmt: skip




class OutputLock:
    """An exclusive, non-blocking flock on output_dir/.neva_pack.lock, held until ``release``."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                raise ConfigError(
                    f"--output_dir {self.path.parent}: in use by another neva-pack run ({holder}); "
                    "wait for it to end or choose another directory"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the file was replaced between open and lock: lock the new one
                break
            os.close(fd)
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the file, then unlock. A run that opened the old file meanwhile finds it unlinked
        after locking it and starts over (see ``acquire``)."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s lock right now ("pid 12 on node3, started ..."), or None when no live
    process does (a lock file a killed run left behind is not held: the kernel dropped its lock).
    Asked with a shared, non-blocking flock taken and dropped at once, and never the file removed: a
    run starting in that instant is refused as if another run held the directory, and can start again."""
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing drops the shared lock when it was taken
    return None


def is_part_file(name: str) -> bool:
    """A file a sharded run's part holds: its store's files, its skipped lines, temporary names."""
    return is_store_file(name) or name in (paths.SKIPPED_FILE, paths.SKIPPED_FILE + paths.TMP_SUFFIX)


def entries(output_dir: Path) -> list[str]:
    """The directory's content, the lock file aside."""
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.name != LOCK_FILE)


def output_paths(output_dir: Path) -> dict[Path, list]:
    """Every path a run may create in output_dir (what --overwrite removes, and only that) -> the
    formats that declare it (none: a file of the run's own, ``paths.run_paths``)."""
    output_dir = Path(output_dir)
    found: dict[Path, list] = {path: [] for path in paths.run_paths(output_dir)}
    for size in paths.sized_names(output_dir):
        for path, formats in declared_files(paths.packed_prefix(output_dir, size)).items():
            found.setdefault(path, []).extend(formats)
    return found


def owned_outputs(output_dir: Path, inputs: dict[str, Path | None]) -> list[Path]:
    """The existing paths among those a run writes, once each is recognised as this tool's own;
    ConfigError (nothing deleted) for one that is not, or that holds one of ``inputs``."""
    declared = output_paths(output_dir)
    existing = [p for p in declared if p.exists() or p.is_symlink()]
    for flag, value in inputs.items():
        if value is None:
            continue
        target = Path(value).resolve()
        for path in existing:
            if target == path.resolve() or target.is_relative_to(path.resolve()):
                raise ConfigError(f"--{flag} {value} lies inside {path}, which --overwrite would delete; move it (nothing was deleted)")
    for path in existing:
        problem = _not_ours(path, declared[path])
        if problem:
            raise ConfigError(
                f"--output_dir {output_dir}: {path.name} {problem}, so it was not written by neva-pack; "
                "move it away (nothing was deleted)"
            )
    return existing


def remove(existing: list[Path]) -> None:
    for path in existing:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _not_ours(path: Path, formats: list) -> str | None:
    """Why a path is not recognisably ours (None when it is); ``formats``: those that declare it."""
    if path.is_symlink():
        return "is a symbolic link"
    name = path.name
    if path == paths.store_dir(path.parent):
        if not path.is_dir():
            return "is not a directory"
        return _store_problem(path)
    if formats:  # a format's file or directory: the format knows its own
        if any(fmt.owns(path) for fmt in formats):
            return None
        return f"is not one of the {' or '.join(fmt.name for fmt in formats)} format's files"
    if not path.is_file():
        return "is not a file"
    if name.endswith(paths.TMP_SUFFIX):
        return None  # the temporary name of a stats file or skipped list
    if paths.is_skipped_list(name):
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
        if not first.strip():
            return None
        try:
            line = json.loads(first)
        except ValueError:
            return "is not a skipped-records list"
        return None if isinstance(line, dict) and {"index", "reason"} <= line.keys() else "is not a skipped-records list"
    if name.endswith(".json"):
        report = _json_field(path, None)
        if report is None:
            return "is not a neva_pack report"
        return None if isinstance(report, dict) and {"records", "packing"} <= report.keys() else "is not a neva_pack report"
    return "is not a file neva_pack writes"


def _store_problem(directory: Path) -> str | None:
    """Why a sample store directory is not recognisably ours: a progress.json of another format, or any
    file a store does not write (every file is checked, so a user's file is never deleted with it)."""
    progress = directory / PROGRESS_FILE
    if progress.is_file() and _json_field(progress, "format") != STORE_FORMAT:
        return "has a progress.json of another format"
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink():
            return f"holds a symbolic link ({entry.name})"
        if entry.is_dir() and part_of(entry.name):  # a sharded run's part: a store of its own
            strangers = [p.name for p in sorted(entry.iterdir()) if not (p.is_file() and not p.is_symlink() and
                         (is_part_file(p.name) or p.name == LOCK_FILE))]  # fmt: skip
            if strangers:
                return f"holds files a sample store does not ({entry.name}/{strangers[0]})"
        elif not (entry.is_file() and is_store_file(entry.name)):
            return f"holds files a sample store does not ({entry.name})"
    return None


def _json_field(path: Path, field: str | None):
    """The value of ``field`` in a JSON object file (the object itself for None); None when the file
    is not one (read as untrusted: a regular file within a budget)."""
    from neva_pack.files import MAX_OUTPUT_JSON_BYTES, read_json

    try:
        value = read_json(path, what="", max_bytes=MAX_OUTPUT_JSON_BYTES, error=InputError)
    except InputError:
        return None
    if not isinstance(value, dict):
        return None
    return value if field is None else value.get(field)


def prepare_output_dir(run: RunConfig, inputs: dict[str, Path | None], keep_store: bool = False) -> OutputLock:
    """Lock the output directory for this run (returned, held) after checking what is in it:
    a non-empty directory is refused (untouched) unless --resume or --overwrite, and these touch
    only what neva-pack recognises as its own output, never one of the run's ``inputs`` (flag ->
    path: ``owned_outputs``). With ``keep_store`` (the final step of a sharded run) the sample
    store, where the parts are, is expected and never removed."""
    output_dir = Path(run.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    store = paths.store_dir(output_dir)

    def refuse_if_not_empty():
        names = [name for name in entries(output_dir) if not (keep_store and name == store.name)]
        if names and not (run.resume or run.overwrite):
            raise ConfigError(
                f"--output_dir {output_dir}: not empty ({names[0]}{', ...' if len(names) > 1 else ''}); "
                "pass --resume to continue an interrupted run or --overwrite to replace it"
            )

    refuse_if_not_empty()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = OutputLock(output_dir).acquire()
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write ({exc.strerror or exc})") from None
    try:
        refuse_if_not_empty()  # another run may have written here before this one got the lock
        owned = owned_outputs(output_dir, inputs if run.overwrite else {})
        if keep_store:
            owned = [path for path in owned if path != store]
        if run.overwrite:
            remove(owned)
    except BaseException:
        lock.release()
        raise
    return lock


def prepare_part_dir(run: RunConfig) -> OutputLock:
    """--num_shards N --shard_index i: lock shard i's part directory (returned, held) after checking it.
    The parts of a run are written at the same time by several nodes, so each locks only its own
    part, which is its own output: non-empty needs --resume, or --overwrite (which removes what a
    part holds, and refuses anything else)."""
    output_dir = Path(run.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    part = part_dir(paths.store_dir(output_dir), run.num_shards, run.shard_index)
    try:
        part.mkdir(parents=True, exist_ok=True)
        lock = OutputLock(part).acquire()
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write ({exc.strerror or exc})") from None
    try:
        names = entries(part)
        if names and not (run.resume or run.overwrite):
            raise ConfigError(f"{part}: this shard was started before; pass --resume to continue it or --overwrite to redo it")
        if names and run.overwrite:
            strangers = [name for name in names if not is_part_file(name)]
            if strangers:
                raise ConfigError(f"{part}: holds {strangers[0]}, which a store part does not; move it away (nothing was deleted)")
            remove([part / name for name in names])
    except BaseException:
        lock.release()
        raise
    return lock
