"""Where a sharded run stands (``neva-pack shards status OUTPUT``): each shard's part read from its
progress file and its lock, and the lines that resubmit exactly the shards left to do.

    done            the part is complete
    running         a live process holds the part's lock (its holder named)
    stale           started, and no live holder: killed or preempted; --resume continues it from its
                    last committed segment (or starts it, when nothing was committed)
    missing         never started (no part, or an empty one)
    other settings  made with other settings than the other parts (its content fingerprint differs):
                    redone with --overwrite, never resumed

A status reads only small files (progress files and locks), never the parts' data, so it answers at
once on a shared filesystem while the shards run. It cannot know the settings of the command that
will join the parts: "other settings" is against the fingerprint most parts share (the final step
then checks every part against its own settings, by content). The engines number shards alike: a
SLURM array task id, a Kubernetes Indexed Job's completion index (``records.resolve_shards``), the
index given to ``run_shard``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from neva_pack.core import ConfigError, NevaPackError
from neva_pack.files import paths
from neva_pack.pipeline.ownership import LOCK_FILE, lock_holder
from neva_pack.records import SHARD_LIST_VARIABLE, shard_range
from neva_pack.sample_store import PROGRESS_FILE, part_dir, part_of, read_progress

__all__ = ["DONE", "MISSING", "OTHER_SETTINGS", "RUNNING", "STALE", "ShardState", "ShardsStatus", "resubmit_lines",
           "shards_status"]  # fmt: skip

DONE, RUNNING, STALE, MISSING, OTHER_SETTINGS = "done", "running", "stale", "missing", "other settings"
RESUBMITTED = (STALE, MISSING)
"""The states a resubmission with --resume finishes: a running shard is left to run, and a part made with
other settings needs --overwrite (a resume of it is refused, naming the setting)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardState:
    """One shard's part, as its files and its lock show it."""

    index: int
    """The shard's index (--shard_index, SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX)."""
    state: str
    """DONE, RUNNING, STALE, MISSING or OTHER_SETTINGS."""
    first_record: int | None
    """First input record of the shard; None while no part says how many records the input holds."""
    end_record: int | None
    """One past its last record (None as ``first_record``)."""
    committed: int
    """Records committed so far (all of them when done)."""
    detail: str
    """The lock's holder (running), or the settings that differ (other settings); empty otherwise."""

    def to_json(self) -> dict:
        return {"index": self.index, "state": self.state, "first_record": self.first_record,
                "end_record": self.end_record, "committed": self.committed, "detail": self.detail}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardsStatus:
    """Every shard of a sharded run in one output directory."""

    output_dir: Path
    num_shards: int
    joined: bool
    """The final step joined the parts already (every shard done; the parts are gone)."""
    shards: tuple[ShardState, ...]

    @property
    def resubmit(self) -> tuple[int, ...]:
        """The shards to submit again, with --resume: the stale and the missing ones."""
        return tuple(s.index for s in self.shards if s.state in RESUBMITTED)

    @property
    def redo(self) -> tuple[int, ...]:
        """The shards made with other settings: to run again with --overwrite."""
        return tuple(s.index for s in self.shards if s.state == OTHER_SETTINGS)

    @property
    def done(self) -> bool:
        return all(s.state == DONE for s in self.shards)

    def lines(self) -> list[str]:
        """What ``neva-pack shards status`` prints: one line per shard, a count by state, and what next."""
        width = len(str(self.num_shards - 1))
        out = []
        for s in self.shards:
            records = "" if s.first_record is None else f"records {s.first_record}..{s.end_record - 1}"
            progress = f" ({s.committed} committed)" if s.state in (RUNNING, STALE) and s.first_record is not None else ""
            detail = f": {s.detail}" if s.detail else ""
            out.append(f"shard {s.index:>{width}}  {s.state:<14} {records}{progress}{detail}".rstrip())
        counts = Counter(s.state for s in self.shards)
        summary = ", ".join(f"{counts[state]} {state}" for state in (DONE, RUNNING, STALE, MISSING, OTHER_SETTINGS) if counts[state])
        out.append(f"{self.num_shards} shard(s) in {self.output_dir}: {summary}" + (" (joined)" if self.joined else ""))
        out.extend(self.next_lines())
        return out

    def next_lines(self) -> list[str]:
        """What to do next: the redo line for parts of other settings, then the resubmission lines
        (the last line of the status), or the final step once every shard is done."""
        if self.done:
            final = f"the same command with --num_shards {self.num_shards} and no --shard_index"
            return [f"every shard is done: run the final step ({final})"]
        out = []
        if self.redo:
            out.append(f"redo with this run's settings: {_redo(self.redo)} (made with other settings)")
        if self.resubmit:
            out.extend(resubmit_lines(self.resubmit, self.num_shards))
        elif not self.redo:
            out.append("nothing to resubmit: wait for the running shard(s)")
        return out

    def to_json(self) -> dict:
        return {
            "output_dir": str(self.output_dir), "num_shards": self.num_shards, "joined": self.joined, "done": self.done,
            "shards": [s.to_json() for s in self.shards], "resubmit": list(self.resubmit), "redo": list(self.redo),
            "next": self.next_lines(),
        }  # fmt: skip


def resubmit_lines(indexes, num_shards: int) -> list[str]:
    """The commands that run exactly ``indexes`` again, with --resume, on each engine: a SLURM array of
    those task ids, a Kubernetes Indexed Job of that many completions whose pods pick their shard from
    NEVA_PACK_SHARD_INDEXES (``records.resolve_shards``), and Ray tasks."""
    listed = ",".join(str(i) for i in indexes)
    command = f"(the shards' command, with --num_shards {num_shards} --resume)"
    kubernetes = f"an Indexed Job of completions {len(indexes)} with env {SHARD_LIST_VARIABLE}={listed}"
    ray = f"run_shard(config, index, {num_shards}) for index in [{', '.join(str(i) for i in indexes)}]"
    return [
        f"resubmit with SLURM: sbatch --array={listed} ... {command}",
        f"resubmit with Kubernetes: {kubernetes} {command}",
        f"resubmit with Ray: {ray} (config with resume=True)",
    ]


def _redo(indexes) -> str:
    return ", ".join(f"--shard_index {i} --overwrite" for i in indexes)


def shards_status(output_dir: Path, num_shards: int | None = None, holder=lock_holder) -> ShardsStatus:
    """The status of every shard in ``output_dir`` (``num_shards``: the run's --num_shards, or None to
    take it from the parts' names; ConfigError when they disagree or there is none to read it from).
    ``holder``: who holds a part's lock (part directory -> "pid 12 on node3, ..." or None); a local
    copy of an ``s3://`` output asks the bucket's lock objects (``files.remote_lock_holder``)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise ConfigError(f"{output_dir}: not a directory (the --output_dir of a sharded run)")
    store = paths.store_dir(output_dir)
    found = [part_of(p.name) for p in sorted(store.iterdir()) if p.is_dir()] if store.is_dir() else []
    joined = _joined_from(store)
    counts = sorted({part[1] for part in found if part})
    if num_shards is None:
        if len(counts) > 1:
            raise ConfigError(f"{store}: parts of {' and '.join(map(str, counts))} shards; pass --num_shards")
        num_shards = counts[0] if counts else joined
        if num_shards is None:
            raise ConfigError(f"{output_dir}: holds no part of a sharded run; pass --num_shards to list its shards as missing")
    if num_shards < 1:
        raise ConfigError(f"--num_shards {num_shards}: must be >= 1")
    if joined == num_shards and not counts:  # the final step joined them (and removed the parts)
        total = read_progress(store).get("joined_from", {}).get("total_records")
        shards = tuple(_joined_state(i, num_shards, total) for i in range(num_shards))
        return ShardsStatus(output_dir=output_dir, num_shards=num_shards, joined=True, shards=shards)
    progress = {i: _progress(part_dir(store, num_shards, i)) for i in range(num_shards)}
    partitions = {i: p.get("partition") or {} for i, p in progress.items() if p is not None}
    reference = _common_fingerprint([partitions[i].get("fingerprint") for i in sorted(partitions)])
    totals = [p.get("total_records") for p in partitions.values() if isinstance(p.get("total_records"), int)]
    total = Counter(totals).most_common(1)[0][0] if totals else None
    shards = tuple(_state(store, num_shards, i, progress[i], reference, total, holder) for i in range(num_shards))
    return ShardsStatus(output_dir=output_dir, num_shards=num_shards, joined=False, shards=shards)


def _joined_from(store: Path) -> int | None:
    """The --num_shards of the run whose parts the store was joined from (None: not joined)."""
    try:
        progress = read_progress(store) if (store / PROGRESS_FILE).is_file() else {}
    except NevaPackError:
        return None
    marker = progress.get("joined_from") if progress.get("complete") else None
    return marker.get("num_shards") if isinstance(marker, dict) else None


def _joined_state(index: int, num_shards: int, total: int | None) -> ShardState:
    first, end = shard_range(total, num_shards, index) if isinstance(total, int) else (None, None)
    return ShardState(index=index, state=DONE, first_record=first, end_record=end,
                      committed=0 if first is None else end - first, detail="joined")  # fmt: skip


def _progress(part: Path) -> dict | None:
    """A part's progress file; None when it has none yet (or one this version cannot read: a stale part,
    which --overwrite redoes)."""
    try:
        return read_progress(part) if (part / PROGRESS_FILE).is_file() else None
    except NevaPackError:
        return {}


def _common_fingerprint(fingerprints: list) -> dict | None:
    """The fingerprint most parts share (ties: the lowest shard's), by value."""
    keyed = [json.dumps(f, sort_keys=True) for f in fingerprints if isinstance(f, dict)]
    return json.loads(Counter(keyed).most_common(1)[0][0]) if keyed else None


def _state(store: Path, num_shards: int, index: int, progress: dict | None, reference: dict | None, total,
           holder=lock_holder) -> ShardState:  # fmt: skip
    part = part_dir(store, num_shards, index)
    first, end = shard_range(total, num_shards, index) if total is not None else (None, None)
    fingerprint = ((progress or {}).get("partition") or {}).get("fingerprint")
    segments = (progress or {}).get("shards") or []
    committed = segments[-1]["end_record"] - first if segments and first is not None else 0
    state, detail = _classify(part, progress, fingerprint, reference, holder)
    if state == DONE and first is not None:
        committed = end - first
    return ShardState(index=index, state=state, first_record=first, end_record=end, committed=committed, detail=detail)


def _classify(part: Path, progress: dict | None, fingerprint, reference, holder_of=lock_holder) -> tuple[str, str]:
    if not part.is_dir():
        return MISSING, ""
    holder = holder_of(part)
    if holder is not None:
        return RUNNING, holder
    if progress == {}:
        return OTHER_SETTINGS, "its progress file is not one this version reads"
    if progress is None:  # nothing committed: stale when it was started (files left), missing when empty
        started = any(p.name != LOCK_FILE for p in part.iterdir())
        return (STALE, "nothing committed") if started else (MISSING, "")
    if reference is not None and fingerprint != reference:
        differing = sorted(k for k in set(reference) | set(fingerprint or {}) if (fingerprint or {}).get(k) != reference.get(k))
        return OTHER_SETTINGS, f"{', '.join(differing)} differ{'s' if len(differing) == 1 else ''} from the other parts"
    if progress.get("complete"):
        return DONE, ""
    return STALE, ""
