"""The one place that knows file names: where each output file of a run lives.

    output_dir/
      packed_seq_dataset[_<size>].*    a packed prefix (formats/nemo.py, formats/compact.py say what is inside)
      packed_seq_dataset/              the sample store (its files: neva_pack/sample_store/files.py)
      stats[_<size>].json              the run report of each prefix
      skipped.jsonl                    one line per record skipped while encoding
      skipped_<size>.jsonl             in a multi-size run: those lines plus the samples the size's cut
                                       leaves without a trained label (what accounts for that prefix)

Format modules ask this module for paths; nothing else spells a file name.
"""


from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

PACKED_NAME = "packed_seq_dataset"
"""Prefix name of the packed output (NeMo's)."""
META_SUFFIX = ".meta.json"
PLAN_SUFFIX = ".plan.npz"
CHECKPOINT_SUFFIX = ".checkpoint.npz"
"""Written beside the temporary prefix while packs are written (what --resume continues from)."""
STORE_DIR = PACKED_NAME
"""The sample store's directory (neva_pack/sample_store/files.py names what is inside)."""

SKIPPED_FILE = "skipped.jsonl"
STATS_FILE = "stats.json"
_READ_CHUNK = 16 << 20
COMPACT_TOKENS, COMPACT_LABELS, COMPACT_INDEX = ".tokens.bin", ".labels.bin", ".index.bin"
COMPACT_SUFFIXES = (COMPACT_TOKENS, COMPACT_LABELS, COMPACT_INDEX)
"""Files of a compact prefix beside its meta (formats/compact.py says what is inside)."""


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
    from neva_pack.errors import parsing

    indices = []
    with parsing(path), open(path, encoding="utf-8") as f:
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


def meta_path(prefix: Path) -> Path:
    return Path(str(prefix) + META_SUFFIX)


def plan_path(prefix: Path) -> Path:
    return Path(str(prefix) + PLAN_SUFFIX)


def store_dir(output_dir: Path) -> Path:
    return Path(output_dir) / STORE_DIR


def bin_path(prefix: Path) -> Path:
    return Path(str(prefix) + ".bin")


def idx_path(prefix: Path) -> Path:
    return Path(str(prefix) + ".idx")


def tmp_prefix(prefix: Path) -> Path:
    return Path(str(prefix) + ".tmp")


def prefix_file(prefix: Path, suffix: str) -> Path:
    """prefix + one of COMPACT_SUFFIXES (or another suffix a format owns)."""
    return Path(str(prefix) + suffix)


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


def output_paths(output_dir: Path) -> list[Path]:
    """Every path a run may create in output_dir (what --overwrite removes, and only that)."""
    output_dir = Path(output_dir)
    sizes = [None] + [int(m.group(1)) for p in output_dir.glob("*_*") if (m := _SIZED.match(p.name))]
    paths = [store_dir(output_dir), output_dir / SKIPPED_FILE, output_dir / (SKIPPED_FILE + ".tmp")]
    for size in sorted(set(sizes), key=lambda v: -1 if v is None else v):
        prefix = packed_prefix(output_dir, size)
        stats = stats_path(output_dir, size)
        if size is not None:
            skipped = skipped_path(output_dir, size)
            paths += [skipped, skipped.with_name(skipped.name + ".tmp")]
        paths += [meta_path(prefix), bin_path(prefix), idx_path(prefix), plan_path(prefix), stats,
                  stats.with_name(stats.name + ".tmp")]  # fmt: skip
        paths += [prefix_file(prefix, suffix) for suffix in COMPACT_SUFFIXES]
        paths += writer_tmp_paths(prefix)
    return paths


def checkpoint_paths(prefix: Path) -> tuple[Path, Path]:
    """The format writer's checkpoint beside the temporary prefix, and the file it is saved to first
    (then renamed over it)."""
    checkpoint = Path(str(tmp_prefix(prefix)) + CHECKPOINT_SUFFIX)
    return checkpoint, Path(str(checkpoint) + ".tmp.npz")


def writer_tmp_paths(prefix: Path) -> list[Path]:
    """Every temporary file a format writer (either format) may leave beside a prefix while it writes:
    the temporary prefix's files and the writer's checkpoint (and the checkpoint's own temporary file)."""
    tmp = tmp_prefix(prefix)
    return [bin_path(tmp), idx_path(tmp), *checkpoint_paths(prefix), Path(str(tmp) + PLAN_SUFFIX),
            *(prefix_file(tmp, suffix) for suffix in COMPACT_SUFFIXES)]  # fmt: skip


_SIZED = re.compile(rf"(?:{PACKED_NAME}|skipped)_(\d+)\.")


_ZEROS = memoryview(bytes(1 << 20))
"""What a hole is hashed as, a MiB at a time (xxh3 has no shortcut for zeros; a buffer that stays
in the CPU cache hashes fastest)."""


def data_extents(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The [start, end) byte ranges of an open file's first ``size`` bytes that hold data; the rest
    are holes, which read as zeros (a sparse file: the nemo writer leaves zero images as holes).

    From ``lseek(SEEK_DATA / SEEK_HOLE)``; None where the OS or the filesystem cannot tell (then
    every byte must be read). A filesystem without holes reports the whole file as data.
    Moves the file's position.
    """
    if not hasattr(os, "SEEK_DATA"):
        return None
    extents: list[tuple[int, int]] = []
    position = 0
    try:
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole from position to the end
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            extents.append((start, end))
            position = end
    except OSError:  # SEEK_DATA not supported here: read everything
        return None
    return extents


def hash_zeros(digest, size: int) -> None:
    """Feed ``size`` zero bytes to ``digest``: what a hole reads as, hashed without reading it."""
    for offset in range(0, size, len(_ZEROS)):
        digest.update(_ZEROS[: min(len(_ZEROS), size - offset)])


def file_checksum(path: Path) -> str:
    """xxh3-128 of the file's bytes; its holes are hashed as the zeros they read as, without reading them."""
    import xxhash

    digest = xxhash.xxh3_128()
    view = memoryview(bytearray(_READ_CHUNK))
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        extents = data_extents(f.fileno(), size)
        f.seek(0)
        if extents is None:
            while read := f.readinto(view):
                digest.update(view[:read])
            return digest.hexdigest()
        position = 0
        for start, end in extents + [(size, size)]:  # the last one: a hole to the end
            hash_zeros(digest, start - position)  # the hole before this extent
            f.seek(start)
            position = start
            while position < end:
                read = f.readinto(view[: min(len(view), end - position)])
                if not read:  # the file shrank while read: what was there
                    return digest.hexdigest()
                digest.update(view[:read])
                position += read
    return digest.hexdigest()


def digest_of_first_bytes(path: Path, size: int):
    """An xxh3-128 state fed the first ``size`` bytes of ``path``: a writer that continues a file
    after a checkpoint feeds it what it appends, and has the file's checksum at the end without
    reading the file again. The file must hold ``size`` bytes (ValueError otherwise)."""
    import xxhash

    digest = xxhash.xxh3_128()
    if size:
        view = memoryview(bytearray(min(_READ_CHUNK, size)))
        with open(path, "rb", buffering=0) as f:
            remaining = size
            while remaining:
                read = f.readinto(view[: min(len(view), remaining)])
                if not read:
                    raise ValueError(f"{path}: shorter than its checkpoint ({size} bytes)")
                digest.update(view[:read])
                remaining -= read
    return digest


def write_json_atomic(path: Path, data) -> None:
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def relative_name(output_dir: Path, path: Path) -> str:
    """How a meta names a file: relative to the output directory, with forward slashes."""
    return Path(path).relative_to(output_dir).as_posix()
