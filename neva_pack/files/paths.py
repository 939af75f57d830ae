"""The names of a run's output directory: where each file of a run lives.

    output_dir/
      packed_seq_dataset[_<size>]      a packed prefix: <prefix>.meta.json (every format's, written
                                       last) and the files its format declares (formats/, ``files``)
      packed_seq_dataset/              the sample store (its files: neva_pack/sample_store/files.py)
      stats[_<size>].json              the run report of each prefix
      skipped.jsonl                    one line per record skipped while encoding
      skipped_<size>.jsonl             in a multi-size run: those lines plus the samples the size's cut
                                       leaves without a trained label (what accounts for that prefix)

A format's own file names are declared in its module; the names shared by every format (the
prefix, its meta, its temporary prefix and the writer's checkpoint) are here. Nothing else spells
a file name. This module imports nothing of neva_pack's but errors: every layer may use it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = [
    "LOCK_FILE", "META_SUFFIX", "PACKED_NAME", "PLAN_SUFFIX", "SKIPPED_FILE", "STATS_FILE", "STORE_DIR", "TMP_SUFFIX",
    "checkpoint_paths", "is_skipped_list", "meta_path", "pack_size_of", "packed_prefix",
    "packed_prefixes", "plan_path", "prefix_file", "read_skipped_indices", "relative_name", "run_paths",
    "sized_names", "skipped_path", "skipped_path_of", "stats_path", "stats_path_of", "store_dir", "tmp_prefix",
    "write_json_atomic",
]  # fmt: skip

PACKED_NAME = "packed_seq_dataset"
"""Prefix name of the packed output (NeMo's)."""
META_SUFFIX = ".meta.json"
PLAN_SUFFIX = ".plan.npz"
"""The plan table's own file, for a format that keeps it apart from its data (plan_table.py)."""
CHECKPOINT_SUFFIX = ".checkpoint.npz"
"""Written beside the temporary prefix while packs are written (what --resume continues from)."""
TMP_SUFFIX = ".tmp"

STORE_DIR = PACKED_NAME
"""The sample store's directory (neva_pack/sample_store/files.py names what is inside)."""
SKIPPED_FILE = "skipped.jsonl"
STATS_FILE = "stats.json"
LOCK_FILE = ".neva_pack.lock"
"""The run's lock (pipeline/ownership.OutputLock); never counted as content and never removed."""


# --- the run's files -----------------------------------------------------------------------------


def packed_prefix(output_dir: Path, pack_size: int | None = None) -> Path:
    """output_dir/packed_seq_dataset, or output_dir/packed_seq_dataset_<size> in a multi-size run."""
    return Path(output_dir) / (PACKED_NAME if pack_size is None else f"{PACKED_NAME}_{pack_size}")


def stats_path(output_dir: Path, pack_size: int | None = None) -> Path:
    """output_dir/stats.json, or output_dir/stats_<size>.json in a multi-size run."""
    return Path(output_dir) / (STATS_FILE if pack_size is None else f"stats_{pack_size}.json")


def skipped_path(output_dir: Path, pack_size: int | None = None) -> Path:
    """output_dir/skipped.jsonl (the run's), or output_dir/skipped_<size>.jsonl (one prefix's) in a multi-size run."""
    return Path(output_dir) / (SKIPPED_FILE if pack_size is None else f"skipped_{pack_size}.jsonl")


def skipped_path_of(prefix: Path) -> Path:
    """The skipped list that accounts for a prefix: skipped_<size>.jsonl beside packed_seq_dataset_<size>,
    skipped.jsonl beside the plain prefix (and beside a sized one written before sizes had their own)."""
    own = skipped_path(Path(prefix).parent, pack_size_of(prefix))
    return own if own.is_file() else Path(prefix).parent / SKIPPED_FILE


def read_skipped_indices(path: Path) -> list[int]:
    """The record index of every line of a skipped list; InputError naming it if a line is damaged."""
    import io

    from neva_pack.core import InputError, parsing
    from neva_pack.files.untrusted import MAX_OUTPUT_TABLE_BYTES, open_file

    indices = []
    raw = open_file(path, what="", max_bytes=MAX_OUTPUT_TABLE_BYTES, error=InputError)
    with parsing(path), io.TextIOWrapper(raw, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    indices.append(json.loads(line)["index"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"line {number}: {exc}") from None
                if type(indices[-1]) is not int:
                    raise ValueError(f"line {number}: a record index that is not an integer")
    return indices


def is_skipped_list(name: str) -> bool:
    """skipped.jsonl or skipped_<size>.jsonl."""
    return name == SKIPPED_FILE or re.fullmatch(r"skipped_\d+\.jsonl", name) is not None


def store_dir(output_dir: Path) -> Path:
    return Path(output_dir) / STORE_DIR


def pack_size_of(prefix: Path) -> int | None:
    """The size in packed_seq_dataset_<size>, or None for the plain prefix."""
    match = re.fullmatch(rf"{PACKED_NAME}_(\d+)", Path(prefix).name)
    return int(match.group(1)) if match else None


def stats_path_of(prefix: Path) -> Path:
    """The stats file of a prefix (stats_<size>.json beside packed_seq_dataset_<size>)."""
    return stats_path(Path(prefix).parent, pack_size_of(prefix))


def packed_prefixes(output_dir: Path) -> list[Path]:
    """Every complete prefix (one with a meta) in output_dir, the plain one first, then by size."""
    output_dir = Path(output_dir)
    found = [packed_prefix(output_dir)] if meta_path(packed_prefix(output_dir)).is_file() else []
    sizes = sorted(int(m.group(1)) for p in output_dir.glob(f"{PACKED_NAME}_*{META_SUFFIX}")
                   if (m := re.fullmatch(rf"{PACKED_NAME}_(\d+){re.escape(META_SUFFIX)}", p.name)))  # fmt: skip
    return found + [packed_prefix(output_dir, size) for size in sizes]


_SIZED = re.compile(rf"(?:{PACKED_NAME}|skipped)_(\d+)\.")
"""A file of a multi-size run's prefix or skipped list: a format names its files ``<prefix>.<...>``."""


def sized_names(output_dir: Path) -> list[int | None]:
    """None (the plain prefix), then every size some file of output_dir is named for, ascending."""
    sizes = {int(m.group(1)) for p in Path(output_dir).glob("*_*") if (m := _SIZED.match(p.name))}
    return [None, *sorted(sizes)]


def run_paths(output_dir: Path) -> list[Path]:
    """The files of a run that belong to no format, present or not: the sample store, and the stats
    and skipped lists of every prefix with their temporary names (what --overwrite removes besides
    each format's files, ``pipeline.ownership.output_paths``)."""
    output_dir = Path(output_dir)
    paths = [store_dir(output_dir), output_dir / SKIPPED_FILE, output_dir / (SKIPPED_FILE + TMP_SUFFIX)]
    for size in sized_names(output_dir):
        stats = stats_path(output_dir, size)
        if size is not None:
            skipped = skipped_path(output_dir, size)
            paths += [skipped, skipped.with_name(skipped.name + TMP_SUFFIX)]
        paths += [stats, stats.with_name(stats.name + TMP_SUFFIX)]
    return paths


# --- names every format's prefix shares ----------------------------------------------------------


def meta_path(prefix: Path) -> Path:
    return Path(str(prefix) + META_SUFFIX)


def plan_path(prefix: Path) -> Path:
    return Path(str(prefix) + PLAN_SUFFIX)


def tmp_prefix(prefix: Path) -> Path:
    """Where a writer writes a prefix's files before ``publish`` renames them into place."""
    return Path(str(prefix) + TMP_SUFFIX)


def prefix_file(prefix: Path, suffix: str) -> Path:
    """prefix + a suffix its format owns."""
    return Path(str(prefix) + suffix)


def checkpoint_paths(prefix: Path) -> tuple[Path, Path]:
    """The format writer's checkpoint beside the temporary prefix, and the file it is saved to first
    (then renamed over it)."""
    checkpoint = Path(str(tmp_prefix(prefix)) + CHECKPOINT_SUFFIX)
    return checkpoint, Path(str(checkpoint) + ".tmp.npz")


def write_json_atomic(path: Path, data) -> None:
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def relative_name(output_dir: Path, path: Path) -> str:
    """How a meta names a file: relative to the output directory, with forward slashes."""
    return Path(path).relative_to(output_dir).as_posix()
