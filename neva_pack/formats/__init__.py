"""On-disk packed formats: the registry. The contract a format satisfies is ``formats/base.py``.

    FORMATS        meta "format" -> the format object (``base.PackedFormat``), one line per format
    open_packed    the reader of an output directory or prefix, whatever its format (the meta says)

A new format is one module exposing ``FORMAT`` plus one line in ``FORMATS``. The intermediate
store the packs are assembled from is not a packed format: it is ``neva_pack.sample_store``.
"""

from __future__ import annotations

from pathlib import Path

from neva_pack.core import ConfigError, InputError
from neva_pack.formats import bridge, bridge_parquet, compact, energon, llamafactory, nemo
from neva_pack.formats.base import Checkpoint, PackReader, PackWriter, PackedFormat, PrefixFiles, WriteSpec, pending_meta_path
from neva_pack.formats.meta import (
    Counts, ImageTokenIds, META_VERSION, Normalisation, PackedMeta, PackingSettings, ReadPack, checksum_problems,
    meta_checksum_ok, read_meta, read_meta_json
)
from neva_pack.formats.trust import checked_meta, trusted_meta, verify_hint
from neva_pack.files import META_SUFFIX, PACKED_NAME, meta_path, pack_size_of, packed_prefixes

from neva_pack.formats.energon import IMAGES_MEMBER, Writer, dataset_path, decode, fetch_from, pack_index


FORMATS: dict[str, PackedFormat] = {
    fmt.name: fmt for fmt in (nemo.FORMAT, compact.FORMAT, bridge.FORMAT, bridge_parquet.FORMAT, energon.FORMAT, llamafactory.FORMAT)
}
"""Registry: meta "format" (--output_format, convert --to) -> format object."""
DEFAULT_FORMAT = nemo.FORMAT.name
"""--output_format's default: NeMo's layout, as NeMo's own preprocessing writes it."""
NEMO_FORMAT = nemo.FORMAT.name
"""The format NeMo 1's NeVA training reads (``data_prefix``): what the run's training overrides
name, after ``neva-pack convert --to`` it for an output of another format."""


def check_dynamic_images(name: str, encoder: str, flag: str = "--output_format") -> None:
    """ConfigError, one line naming the formats that can, when format ``name`` cannot hold the images
    of ``encoder``, each at its own size (``PackedFormat.holds_dynamic_images``): one that holds one crop
    shape, and a text-only one, which could only skip every record with an image."""
    fmt = output_format(name)
    if not fmt.holds_dynamic_images:
        holding = " or ".join(other for other, f in FORMATS.items() if f.holds_dynamic_images)
        what = "holds text only" if not fmt.holds_images else "holds one image shape"
        raise ConfigError(f"{flag} {name}: cannot hold the dynamic-resolution images of {encoder} (each at its own size; "
                          f"it {what}); use {flag} {holding}")  # fmt: skip


def get_format(name: str) -> PackedFormat:
    """The format of a meta's ``format`` field; InputError for one this neva_pack does not read."""
    try:
        return FORMATS[name]
    except KeyError:
        raise InputError(f"format {name!r} is not one this neva_pack reads ({', '.join(sorted(FORMATS))})") from None


def output_format(name: str) -> PackedFormat:
    """The format a run or a conversion is asked to write; ConfigError naming --output_format otherwise."""
    if name not in FORMATS:
        raise ConfigError(f"--output_format {name!r}: choose one of {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def declared_files(prefix: Path) -> dict[Path, list[PackedFormat]]:
    """Every path some format's writer creates for ``prefix`` -> the formats that declare it."""
    declared: dict[Path, list[PackedFormat]] = {}
    for fmt in FORMATS.values():
        for path in fmt.files(prefix).every:
            declared.setdefault(path, []).append(fmt)
    return declared


def temporary_files(prefix: Path) -> list[Path]:
    """Every temporary file any format's writer may leave beside ``prefix`` (a stale one, left by
    another run, maybe of another format, goes before a writer starts)."""
    return list(dict.fromkeys(path for fmt in FORMATS.values() for path in fmt.files(prefix).temporary))


def prefix_without_meta(path: Path) -> Path:
    """A prefix another tool wrote (no meta): read in NeMo's layout, the only one such tools write."""
    return nemo.prefix_without_meta(path)


def read_without_meta(prefix: Path, image_values: int) -> dict:
    """Per-pack sample lengths and image counts of a prefix without meta (``prefix_without_meta``)."""
    return nemo.read_packs_from_index(prefix, image_values)


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
    """The reader of an output directory or prefix, whatever its format, once what the reader trusts
    is checked (``open_prefix``).

    A directory written with --pack_sizes holds one prefix per size: ``pack_size`` picks one,
    the largest by default (as the run's summary reports it).
    """
    prefixes = resolve_prefixes(path)
    if pack_size is None:
        return open_prefix(max(prefixes, key=lambda p: pack_size_of(p) or 0))
    metas = {prefix: read_meta(meta_path(prefix)) for prefix in prefixes}
    chosen = [prefix for prefix, meta in metas.items() if meta.packing.max_seq_length == pack_size]
    if not chosen:
        sizes = ", ".join(str(meta.packing.max_seq_length) for meta in metas.values())
        raise InputError(f"{path}: no prefix of pack size {pack_size} (sizes: {sizes})")
    return open_prefix(chosen[0])


def open_prefix(prefix: Path, meta: PackedMeta | None = None):
    """The reader of a prefix. Without ``meta``, the meta's own checksum and the checksums of the small
    files its format's reader trusts (``PackedFormat.trusted_files``: plan table, index) are checked
    first (``formats/trust.py``): an edited one is refused in one line naming it and ``neva-pack verify``.
    A ``meta`` given is one its caller already checked (``checked_meta``)."""
    if meta is None:
        meta = open_checked_meta(prefix)
    return get_format(meta.format).reader(Path(prefix), meta)


def open_checked_meta(prefix: Path) -> PackedMeta:
    """The prefix's meta, checked as ``open_prefix`` checks it before a reader believes it."""
    prefix = Path(prefix)
    return trusted_meta(prefix, lambda meta: get_format(meta.format).trusted_files(prefix, meta), check_format=get_format)

__all__ = [
    "Checkpoint",
    "Counts",
    "DEFAULT_FORMAT",
    "FORMATS",
    "IMAGES_MEMBER",
    "ImageTokenIds",
    "META_VERSION",
    "NEMO_FORMAT",
    "Normalisation",
    "PackReader",
    "PackWriter",
    "PackedFormat",
    "PackedMeta",
    "PackingSettings",
    "PrefixFiles",
    "ReadPack",
    "WriteSpec",
    "Writer",
    "check_dynamic_images",
    "checked_meta",
    "checksum_problems",
    "dataset_path",
    "declared_files",
    "decode",
    "fetch_from",
    "get_format",
    "meta_checksum_ok",
    "open_checked_meta",
    "open_packed",
    "open_prefix",
    "output_format",
    "pack_index",
    "prefix_without_meta",
    "read_meta",
    "pending_meta_path",
    "read_meta_json",
    "read_without_meta",
    "resolve_prefixes",
    "temporary_files",
    "verify_hint",
]
