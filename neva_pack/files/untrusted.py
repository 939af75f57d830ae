"""The one way the tool reads a file it did not write itself: configuration, tokenizers, templates.

A path a user hands us can name anything: a device (``/dev/zero`` never ends), a FIFO (opening
it blocks), a socket, a directory, a file being replaced while we read it, bytes in another
encoding. So a file is opened without blocking, checked with ``fstat`` on the open descriptor
(what is read is what was checked), refused unless it is a regular file, refused before reading
when its size is over a budget, and read at most budget + 1 bytes (a file that grows meanwhile is
refused too). Decoding (UTF-8, JSON, YAML) fails with one line naming the file and where.

Every failure is a ``FileRefused`` carrying why in one phrase and what kind of failure it is; the
``read_*`` helpers turn it into the caller's error class (``ConfigError`` for settings,
``InputError`` for data), and ``images.source`` turns it into a record's skip reason.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path
from typing import Literal

from neva_pack.core import ConfigError, InputError, NevaPackError

__all__ = [
    "ANY_SIZE",
    "MAX_OUTPUT_JSON_BYTES",
    "MAX_OUTPUT_TABLE_BYTES",
    "MAX_SETTINGS_BYTES",
    "MAX_YAML_CHARS",
    "MAX_YAML_NODES",
    "FileRefused",
    "compression_of",
    "open_file",
    "open_output",
    "open_regular",
    "parse_yaml",
    "read_bytes",
    "read_json",
    "read_text",
    "read_yaml",
    "regular_file_bytes",
    "regular_output",
]

MAX_SETTINGS_BYTES = 16 << 20
"""Budget of a settings file (template, hparams, preprocessor_config.json): they are a few KB."""

MAX_OUTPUT_JSON_BYTES = 256 << 20
"""Budget of a JSON file of an output or a store (meta, stats, progress): they are KBs to a few MBs."""
MAX_OUTPUT_TABLE_BYTES = 1 << 36
"""Budget of a table of an output read as a stream (plan table, skipped list): GBs at most."""

ANY_SIZE = 1 << 62
"""The budget of a file read as a stream whatever its size (an input's records, an output's data
files): only its kind is checked, so a FIFO or device in its place is refused instead of hanging."""

FailureKind = Literal["missing", "not_regular", "too_large", "unreadable"]


class FileRefused(Exception):
    """A file that is not read: ``why`` is one phrase for the user, ``kind`` what went wrong."""

    def __init__(self, kind: FailureKind, why: str):
        super().__init__(why)
        self.kind = kind
        self.why = why


def regular_file_bytes(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, or ``FileRefused``.

    The path is looked at before it is opened (opening some devices has effects of its own), then
    opened with ``O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block the open) and looked at
    again through the open descriptor, which is what is read: nothing is read from a device,
    FIFO, socket or directory, nor from a file over the budget.
    """
    with open_regular(path, max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise FileRefused("unreadable", f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise FileRefused("too_large", f"more than the {max_bytes:,} bytes read at most (it grew while read)")
    return data


def open_regular(path: str | Path, max_bytes: int):
    """``path`` opened for reading in binary (the caller closes it), once it is a regular file of at
    most ``max_bytes`` (``FileRefused`` otherwise): for a file read as a stream or by a library that
    takes a file object. The checks are ``regular_file_bytes``'s, on the descriptor returned."""
    try:
        _check(os.stat(path), max_bytes)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileRefused("missing", "no such file") from None
    except OSError as exc:
        raise FileRefused("unreadable", f"cannot be opened ({exc.strerror or exc})") from None
    f = open(descriptor, "rb")
    try:
        _check(os.fstat(f.fileno()), max_bytes)
    except BaseException:
        f.close()
        raise
    return f


def _check(info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise FileRefused("not_regular", f"not a regular file ({_kind_of(info.st_mode)})")
    if info.st_size > max_bytes:
        raise FileRefused("too_large", f"{info.st_size:,} bytes, more than the {max_bytes:,} read at most")


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a file"


def read_bytes(path: str | Path, *, what: str, max_bytes: int, error: type[NevaPackError] = ConfigError) -> bytes:
    """``regular_file_bytes``, failing with ``error`` as one line: ``{what} {path}: {why}``
    (``what`` is the flag that named the file, or "" when the path says enough)."""
    try:
        return regular_file_bytes(path, max_bytes)
    except FileRefused as refused:
        raise error(f"{_label(what, path)}: {refused.why}") from None


def open_file(path: str | Path, *, what: str, max_bytes: int, error: type[NevaPackError] = ConfigError):
    """``open_regular``, failing with ``error`` as one line (``read_bytes``'s)."""
    try:
        return open_regular(path, max_bytes)
    except FileRefused as refused:
        raise error(f"{_label(what, path)}: {refused.why}") from None


def read_text(path: str | Path, *, what: str, max_bytes: int = MAX_SETTINGS_BYTES,
              error: type[NevaPackError] = ConfigError) -> str:  # fmt: skip
    """The file as UTF-8 text (a byte-order mark dropped); another encoding is one line saying
    where the first undecodable byte is."""
    data = read_bytes(path, what=what, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        kind = compression_of(data)
        why = f"{kind}-compressed, not text" if kind else f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start:,})"
        raise error(f"{_label(what, path)}: {why}") from None


def read_json(path: str | Path, *, what: str, max_bytes: int = MAX_SETTINGS_BYTES,
              error: type[NevaPackError] = ConfigError) -> object:  # fmt: skip
    """The file's JSON value; invalid JSON is one line with its line and column."""
    text = read_text(path, what=what, max_bytes=max_bytes, error=error)
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{_label(what, path)}: invalid JSON (nested too deep)") from None
    except json.JSONDecodeError as exc:
        raise error(f"{_label(what, path)}: invalid JSON ({exc})") from None
    except ValueError as exc:  # a number json refuses to convert: an integer of more than 4,300 digits
        raise error(f"{_label(what, path)}: invalid JSON ({' '.join(str(exc).split())[:200]})") from None


MAX_YAML_CHARS = 256 << 10
"""Budget of a YAML settings file (a template is ~1 KB, a NeMo hparams file ~20 KB). YAML is parsed in
pure Python at a few hundred bytes of memory and tens of microseconds per node: a 5 MB file took
2.4 GB and 72 s; this bound keeps the worst file under a few seconds and a few hundred MB."""

MAX_YAML_NODES = 20_000
"""Budget of a YAML document's values (nodes) counted with every alias expanded; a NeMo hparams file
has a few hundred. An alias is a reference, so nested aliases ("billion laughs": ten of ten of ten
...) parse small but expand exponentially in whoever walks the value (validation, JSON, checksums):
3.1 GB and 40 s for one hparams file. Nodes are counted as the parser makes them (it stops at the
budget) and, with aliases expanded, on the node graph before any Python value is made."""


def read_yaml(path: str | Path, *, what: str, max_bytes: int = MAX_YAML_CHARS,
              error: type[NevaPackError] = ConfigError) -> object:  # fmt: skip
    """The file's YAML value (``yaml.safe_load``: no Python objects); invalid YAML is one line
    with the parser's problem and its line."""
    return parse_yaml(read_text(path, what=what, max_bytes=max_bytes, error=error), _label(what, path), error)


def parse_yaml(text: str, label: str, error: type[NevaPackError] = ConfigError) -> object:
    """YAML text (of a file named by ``label``) -> its value, or one line saying what is wrong where.

    ``yaml.safe_load``'s value, once the text is within ``MAX_YAML_CHARS`` and its document within
    ``MAX_YAML_NODES`` nodes with aliases expanded (a recursive alias never is)."""
    import yaml

    if len(text) > MAX_YAML_CHARS:
        raise error(f"{label}: {len(text):,} characters, more than the {MAX_YAML_CHARS:,} a YAML settings file may hold")
    too_many = error(f"{label}: YAML holds more than {MAX_YAML_NODES:,} values (aliases expanded), "
                     "more than a settings file has")  # fmt: skip
    loader = None
    try:
        loader = _counting_loader()(text)  # its reader refuses some characters already
        node = loader.get_single_node()
        if node is not None and _expanded_nodes(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise too_many
        return None if node is None else loader.construct_document(node)
    except _TooManyNodes:
        raise too_many from None
    except RecursionError:
        raise error(f"{label}: invalid YAML (nested too deep)") from None
    except yaml.MarkedYAMLError as exc:
        where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}" if exc.problem_mark else ""
        raise error(f"{label}: invalid YAML ({exc.problem or exc.context}{where})") from None
    except yaml.YAMLError as exc:
        raise error(f"{label}: invalid YAML ({' '.join(str(exc).split())})") from None
    except ValueError as exc:  # a value PyYAML's constructors refuse: an integer of 5,000 digits, a 13th month
        raise error(f"{label}: invalid YAML ({' '.join(str(exc).split())[:200]})") from None
    finally:
        if loader is not None:
            loader.dispose()


class _TooManyNodes(Exception):
    """The parser made more than ``MAX_YAML_NODES`` nodes."""


@functools.cache
def _counting_loader():
    """``yaml.SafeLoader`` that stops composing after ``MAX_YAML_NODES`` nodes (made once, on first
    use: yaml is imported only by what reads YAML)."""
    import yaml

    class CountingLoader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.composed = 0

        def compose_node(self, parent, index):
            self.composed += 1
            if self.composed > MAX_YAML_NODES:
                raise _TooManyNodes()
            return super().compose_node(parent, index)

    return CountingLoader


def _expanded_nodes(root, limit: int) -> int:
    """Nodes under ``root`` with each alias expanded (memoised per node, so linear in the graph);
    more than ``limit`` once it is known to exceed it, or a node that contains itself."""
    import yaml

    counted: dict[int, int] = {}
    inside: set[int] = set()

    def count(node) -> int:
        key = id(node)
        if key in counted:
            return counted[key]
        if key in inside:
            return limit + 1
        if isinstance(node, yaml.ScalarNode):
            return 1
        inside.add(key)
        children = (part for pair in node.value for part in pair) if isinstance(node, yaml.MappingNode) else node.value
        total = 1
        for child in children:
            total += count(child)
            if total > limit:
                break
        inside.discard(key)
        counted[key] = total
        return total

    return count(root)


def regular_output(path: str | Path) -> Path:
    """``path`` (as a Path) once it is a regular file or missing, for a reader of an output of ours
    that opens the file itself (``np.memmap``, ``np.fromfile``, a tar shard, a library): a FIFO in
    its place would block that open forever, a device would read without end. ``InputError`` in one
    line saying what is there instead; a missing file is left to the reader, which names it its way."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return Path(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{path}: not a regular file ({_kind_of(info.st_mode)})")
    return Path(path)


def open_output(path: str | Path):
    """A file of an output of ours opened for reading in binary (the caller closes it), whatever its
    size, once it is a regular file: ``open_regular``'s checks, ``InputError`` in one line."""
    return open_file(path, what="", max_bytes=ANY_SIZE, error=InputError)


def _label(what: str, path) -> str:
    return f"{what} {path}" if what else str(path)


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def compression_of(head: bytes) -> str | None:
    """The compression a file's first bytes announce (gzip, bzip2, xz, zstd), or None."""
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            return kind
    return None
