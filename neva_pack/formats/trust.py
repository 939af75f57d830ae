"""What a reader checks of an output before it believes it: the meta's own checksum, and the checksums
of the small files the format's reader trusts to find the data (its plan table and index files).

The meta is the output's description: an edited image mean or ignore value there changes every tensor
a reader returns, and an edited plan table or index moves sample boundaries. Each of those files is
read whole by the reader anyway (they are small: per pack and per sample figures), so checking their
checksums when an output is opened costs one more read of what the page cache already holds and one
xxh3 pass (GB/s): no pass over the data files (``.bin``, shards, rows, pool images), which only
``neva-pack verify`` reads. A damaged data file is verify's to find; a damaged description would be
believed silently by every reader, which is why these are checked on every open.

``checked_meta`` is the same check over any named files (every file by default), for the commands
that read an output without verifying all of it (convert, stats).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from neva_pack.core import InputError
from neva_pack.files import file_checksum, meta_path, relative_name
from neva_pack.formats.meta import PackedMeta, checksum_problems, meta_checksum_ok, read_meta_json

__all__ = ["checked_meta", "trusted_meta", "verify_hint"]


def verify_hint(directory: Path) -> str:
    """The end of every refusal of a damaged output: where to find out what else is wrong."""
    return f"neva-pack verify {directory} lists what is wrong"


def trusted_meta(prefix: Path, trusted_files: Callable[[PackedMeta], Iterable[Path]],
                 check_format: Callable[[str], object] = lambda name: None) -> PackedMeta:  # fmt: skip
    """The prefix's meta, once its own checksum matches and so do the checksums of ``trusted_files(meta)``
    (the format's small files its reader believes). ``check_format`` refuses a format this neva_pack
    does not read (InputError), before the files are asked for. Every refusal is one line naming the
    file and ``neva-pack verify``."""
    meta = _self_checked(prefix, check_format)
    directory = Path(prefix).parent
    names = [relative_name(directory, path) for path in trusted_files(meta)]
    unlisted = [name for name in names if name not in meta.checksums]
    if unlisted:
        raise InputError(f"{meta_path(prefix)}: lists no checksum of {unlisted[0]}, which its reader trusts; {verify_hint(directory)}")
    _check_files(directory, {name: meta.checksums[name] for name in names})
    return meta


def checked_meta(prefix: Path, names=None) -> PackedMeta:
    """The prefix's meta, once its own checksum and the checksums of the files ``names`` (default:
    every file it lists) match, as verify checks them: for the commands that read an output without
    verifying all of it. Converting a damaged output would publish its damage under new checksums
    that verify; stats would print figures made from it. InputError names the first file that differs."""
    meta = _self_checked(prefix)
    if not meta.checksums:
        raise InputError(f"{meta_path(prefix)}: lists no checksums")
    expected = {name: meta.checksums[name] for name in (meta.checksums if names is None else names) if name in meta.checksums}
    _check_files(Path(prefix).parent, expected)
    return meta


def _self_checked(prefix: Path, check_format: Callable[[str], object] = lambda name: None) -> PackedMeta:
    """The meta, parsed, its format known, and its own checksum matching. A meta this version cannot
    parse is refused as it always was; when its checksum does not match either, the line says it was
    changed since it was written (a byte flipped in ``"format"`` is damage, not another format)."""
    path = meta_path(prefix)
    directory = Path(prefix).parent
    try:
        raw = read_meta_json(path)
    except InputError as exc:
        if not path.is_file():
            raise  # missing, or not a regular file: not an output (what it says is enough)
        raise InputError(f"{exc}; {verify_hint(directory)}") from None
    intact = meta_checksum_ok(raw)
    try:
        meta = PackedMeta.from_json(raw, where=str(path))
        check_format(meta.format)
    except InputError as exc:
        if intact:
            raise
        said = str(exc).removeprefix(f"{path}: ")
        raise InputError(f"{path}: {said}, and its own checksum does not match (the meta was changed or corrupted); "
                         f"{verify_hint(directory)}") from None  # fmt: skip
    if not intact:
        raise InputError(f"{path}: its own checksum does not match (the meta was changed or corrupted); {verify_hint(directory)}")
    return meta


def _check_files(directory: Path, expected: dict[str, str]) -> None:
    """InputError, one line naming the first file (of ``expected``: name -> checksum) that is missing
    or differs, and how many more."""

    def checksum(name: str) -> str | None:
        return file_checksum(directory / name) if (directory / name).is_file() else None

    if len(expected) > 2:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="checksum") as threads:  # xxh3 and reads release the GIL
            actual = dict(zip(expected, threads.map(checksum, expected)))
    else:
        actual = {name: checksum(name) for name in expected}
    problems = checksum_problems(expected, actual)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"{directory / problems[0]}{more}; {verify_hint(directory)}")
