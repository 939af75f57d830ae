"""On-disk formats: one module per format, each a matched writer, reader and ``check``.

    FORMATS["nemo"]      formats/nemo.py      float32, NeMo's NevaPackedSeqDatatset layout (default)
    FORMATS["compact"]   formats/compact.py   int32 ids, uint8 images stored once, normalised on read
    sample_store.py      the intermediate store the packs are assembled from (not a packed format)

A third format is one module with NAME, NEEDS_PIXELS, Writer, Reader and check, added here.
``open_packed`` picks the reader from the meta's ``format`` field.
"""

from __future__ import annotations

from pathlib import Path

from neva_pack.errors import InputError
from neva_pack.formats import compact, nemo
from neva_pack.formats.meta import PackedMeta, checksum_problems, meta_checksum_ok, read_meta, read_meta_json
from neva_pack.store import META_SUFFIX, PACKED_NAME, file_checksum, meta_path, pack_size_of, packed_prefixes

FORMATS = {module.NAME: module for module in (nemo, compact)}
"""Registry: meta "format" -> format module."""
DEFAULT_FORMAT = nemo.NAME


def format_module(name: str):
    try:
        return FORMATS[name]
    except KeyError:
        raise InputError(f"format {name!r} is not one this neva_pack reads ({', '.join(sorted(FORMATS))})") from None


def resolve_prefixes(path: Path) -> list[Path]:
    """An output directory (one prefix, or one per --pack_sizes size) or a prefix -> its complete prefixes."""
    path = Path(path)
    if meta_path(path).is_file():
        return [path]
    if path.is_dir():
        found = packed_prefixes(path)
        if found:
            return found
    raise InputError(f"{path}: no {PACKED_NAME}{META_SUFFIX} here (not a complete neva_pack output)")


def open_packed(path: Path, pack_size: int | None = None):
    """The reader of an output directory or prefix, whatever its format.

    A directory written with --pack_sizes holds one prefix per size: ``pack_size`` picks one,
    the largest by default (as the run's summary reports it).
    """
    prefixes = resolve_prefixes(path)
    if pack_size is None:
        return open_prefix(max(prefixes, key=lambda p: pack_size_of(p) or 0))
    metas = {prefix: read_meta(meta_path(prefix)) for prefix in prefixes}
    chosen = [prefix for prefix, meta in metas.items() if meta.max_seq_length == pack_size]
    if not chosen:
        sizes = ", ".join(str(meta.max_seq_length) for meta in metas.values())
        raise InputError(f"{path}: no prefix of pack size {pack_size} (sizes: {sizes})")
    return open_prefix(chosen[0], metas[chosen[0]])


def open_prefix(prefix: Path, meta: PackedMeta | None = None):
    meta = meta if meta is not None else read_meta(meta_path(prefix))
    return format_module(meta.format).Reader(Path(prefix), meta)


def checked_meta(prefix: Path, names=None) -> PackedMeta:
    """The prefix's meta, once its own checksum and the checksums of the files ``names`` (default:
    every file it lists) match, as verify checks them: for the commands that read an output without
    verifying all of it. Converting a damaged output would publish its damage under new checksums
    that verify; stats would print figures made from it. InputError names the first file that differs."""
    path = meta_path(prefix)
    raw = read_meta_json(path)
    meta = PackedMeta.from_json(raw, where=str(path))
    if not meta_checksum_ok(raw):
        raise InputError(f"{path}: its own checksum does not match (the meta was changed or corrupted)")
    if not meta.checksums:
        raise InputError(f"{path}: lists no checksums")
    expected = {name: meta.checksums[name] for name in (meta.checksums if names is None else names) if name in meta.checksums}
    directory = Path(prefix).parent

    def checksum(name: str) -> str | None:
        return file_checksum(directory / name) if (directory / name).is_file() else None

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="checksum") as threads:  # xxh3 and reads release the GIL
        problems = checksum_problems(expected, dict(zip(expected, threads.map(checksum, expected))))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"{directory / problems[0]}{more}; neva-pack verify {directory} lists what is wrong")
    return meta
