"""neva_pack.files.untrusted: a file the tool did not write is read only if it is a regular file within
its budget, and decoded with one line naming it when it is not what it should be."""

from __future__ import annotations

import gzip
import os
import socket

import pytest

from neva_pack.core import ConfigError, InputError
from neva_pack.files import FileRefused, compression_of, read_json, read_text, read_yaml, regular_file_bytes


def test_a_regular_file_within_its_budget_is_read_whole(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"12345")
    assert regular_file_bytes(path, max_bytes=5) == b"12345"


def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)  # opening it for reading the usual way blocks until a writer comes
    return path


def unix_socket(tmp_path):
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return path


@pytest.mark.parametrize("make, kind, why", [
    (lambda t: "/dev/zero", "not_regular", "not a regular file (a character device)"),
    (lambda t: t, "not_regular", "not a regular file (a directory)"),
    (fifo, "not_regular", "not a regular file (a FIFO)"),
    (unix_socket, "not_regular", "not a regular file (a socket)"),
    (lambda t: t / "missing", "missing", "no such file"),
    (lambda t: (t / "big").write_bytes(b"x" * 11) and t / "big", "too_large", "11 bytes, more than the 10 read at most"),
])  # fmt: skip
def test_what_is_not_a_regular_file_within_budget_is_refused_unread(tmp_path, make, kind, why):
    with pytest.raises(FileRefused) as refused:
        regular_file_bytes(make(tmp_path), max_bytes=10)
    assert (refused.value.kind, refused.value.why) == (kind, why)


def test_a_symlink_to_a_device_is_refused_as_the_device(tmp_path):
    os.symlink("/dev/zero", tmp_path / "settings.yaml")
    with pytest.raises(ConfigError, match=r"^--hparams_file .*settings.yaml: not a regular file \(a character device\)$"):
        read_yaml(tmp_path / "settings.yaml", what="--hparams_file")


def test_text_must_be_utf8_and_a_compressed_file_is_named_as_such(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_bytes("name: café".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"t.yaml: not UTF-8 text \(byte 0xe9 at offset 9\)$"):
        read_text(path, what="")
    path.write_bytes(gzip.compress(b"name: x"))
    with pytest.raises(InputError, match=r"^--x .*t.yaml: gzip-compressed, not text$"):
        read_text(path, what="--x", error=InputError)
    path.write_bytes(b"\xef\xbb\xbfname: x")  # a byte-order mark is not part of the text
    assert read_yaml(path, what="") == {"name": "x"}


@pytest.mark.parametrize("text, says", [
    ("a: [1, 2\n", "invalid YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1)"),
    ("a: *missing\n", "invalid YAML (found undefined alias 'missing' at line 1, column 4)"),
    ("a: !!python/object:os.system x\n", "invalid YAML (could not determine a constructor for the tag"),
    ("[" * 20_000 + "]" * 20_000, "invalid YAML (nested too deep)"),
    ("\x00ame: x\n", "invalid YAML (unacceptable character #x0000"),
])  # fmt: skip
def test_invalid_yaml_is_one_line_with_where(tmp_path, text, says):
    path = tmp_path / "h.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        read_yaml(path, what="--hparams_file")
    assert says in str(error.value) and "\n" not in str(error.value)


def test_invalid_json_is_one_line_with_line_and_column(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{\n  "crop_size": 336,\n}')
    with pytest.raises(ConfigError, match=r"p.json: invalid JSON \(Expecting property name enclosed in double quotes: line 3 column 1 \(char 22\)\)$"):
        read_json(path, what="")


@pytest.mark.parametrize("head, kind", [
    (gzip.compress(b"x", mtime=0), "gzip"), (b"BZh91AY&SY", "bzip2"), (b"\xfd7zXZ\x00\x00", "xz"),
    (b"\x28\xb5\x2f\xfd\x00", "zstd"), (b'[{"id": 1}]', None), (b"", None),
])  # fmt: skip
def test_compression_is_known_by_its_magic_bytes(head, kind):
    assert compression_of(head) == kind


def _billion_laughs(levels: int = 9, width: int = 10) -> str:
    lines = ['a0: &a0 "lol"']
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_nested_aliases_are_refused_quickly_without_expanding_them(tmp_path):
    """A "billion laughs" hparams file parses small (aliases are references) but walking its value
    visits 10**9 strings: refused in one line naming the file, at once, in little memory."""
    import time
    import tracemalloc

    path = tmp_path / "h.yaml"
    path.write_text(_billion_laughs())
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ConfigError) as error:
            read_yaml(path, what="--hparams_file")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert message.startswith(f"--hparams_file {path}: YAML holds more than 20,000 values") and "\n" not in message
    assert time.perf_counter() - started < 5 and peak < 20 << 20


def test_a_template_with_nested_aliases_is_refused_naming_it(tmp_path):
    from neva_pack.text import load_template

    path = tmp_path / "t.yaml"
    path.write_text(_billion_laughs())
    with pytest.raises(ConfigError, match=r"^--conv_template .*t\.yaml: YAML holds more than"):
        load_template(str(path))


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: *a}\n"])
def test_a_recursive_alias_is_refused(tmp_path, text):
    path = tmp_path / "h.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="YAML holds more than"):
        read_yaml(path, what="--hparams_file")


def test_aliases_within_budget_read_as_safe_load_reads_them(tmp_path):
    import yaml

    text = "base: &base {lr: 1.0e-4, sizes: [1, 2]}\nrun:\n  <<: *base\n  again: *base\nnothing:\n"
    path = tmp_path / "h.yaml"
    path.write_text(text)
    assert read_yaml(path, what="") == yaml.safe_load(text)
    path.write_text("")
    assert read_yaml(path, what="") is None


def test_a_yaml_file_over_its_size_budget_is_refused_unparsed(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text("- a\n" * 100_000)
    with pytest.raises(ConfigError, match=r"^--hparams_file .*h\.yaml: 400,000 bytes, more than the 262,144 read at most$"):
        read_yaml(path, what="--hparams_file")


def test_a_yaml_file_of_too_many_values_is_refused_as_it_is_parsed(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text("[" + ",".join(["a"] * 60_000) + "]")
    with pytest.raises(ConfigError, match=r"^--hparams_file .*h\.yaml: YAML holds more than 20,000 values"):
        read_yaml(path, what="--hparams_file")
