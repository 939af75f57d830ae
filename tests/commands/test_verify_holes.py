"""verify on sparse outputs: the zero image of an image-less pack is a hole in the .bin, which the
checksum hashes and the format check accepts without reading; what is written in it is still found."""

import errno
import json
import os
import shutil

import numpy as np
import pytest
import xxhash

from neva_pack.files import bin_path, checksums, paths

from neva_pack.cli import main
from neva_pack.formats import nemo
from neva_pack.commands import verify
from tests.conftest import SAMPLE_DATA

BIN = bin_path(paths.PACKED_NAME).name
"""The .bin of an output's prefix, as the meta names it."""


def read_checksum(path) -> str:
    """The checksum as a plain read of every byte computes it."""
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def sparse_file(path, pieces, size):
    """A file of ``size`` bytes with ``pieces`` ({offset: bytes}) written and holes between them."""
    with open(path, "wb") as f:
        for offset, data in pieces.items():
            f.seek(offset)
            f.write(data)
        f.truncate(size)
    return path


def holes_supported(path) -> bool:
    with open(path, "rb") as f:
        extents = checksums.data_extents(f.fileno(), os.path.getsize(path))
    return extents is not None and extents != [(0, os.path.getsize(path))]


MIB = 1 << 20
LAYOUTS = {
    "empty": ({}, 0),
    "dense": ({0: bytes(range(256)) * 9000}, 256 * 9000),
    "hole first, in the middle and last": ({3 * MIB + 5: b"\x01" * 70000, 9 * MIB: b"xyz"}, 20 * MIB + 3),
    "only a hole": ({}, 5 * MIB + 1),
    "data first and last": ({0: b"a" * 10, 7 * MIB - 2: b"bc"}, 7 * MIB),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_checksum_of_a_sparse_file_is_that_of_its_bytes(tmp_path, layout, monkeypatch):
    path = sparse_file(tmp_path / "f.bin", *layout)
    expected = read_checksum(path)
    assert checksums.file_checksum(path) == expected
    monkeypatch.setattr(checksums, "data_extents", lambda fd, size: None)  # where holes cannot be found
    assert checksums.file_checksum(path) == expected


def test_extents_are_the_data_and_fall_back_where_seek_data_is_unsupported(tmp_path, monkeypatch):
    path = sparse_file(tmp_path / "f.bin", {4 * MIB: b"\x07" * 100}, 12 * MIB)
    if not holes_supported(path):
        pytest.skip("this filesystem keeps no holes")
    with open(path, "rb") as f:
        extents = checksums.data_extents(f.fileno(), 12 * MIB)
        assert len(extents) == 1 and extents[0][0] <= 4 * MIB and extents[0][1] >= 4 * MIB + 100
        real_lseek = os.lseek

        def unsupported(fd, position, how):
            if how in (os.SEEK_DATA, os.SEEK_HOLE):
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_lseek(fd, position, how)

        monkeypatch.setattr(os, "lseek", unsupported)
        assert checksums.data_extents(f.fileno(), 12 * MIB) is None
    assert checksums.file_checksum(path) == read_checksum(path)
    monkeypatch.delattr(os, "SEEK_DATA")
    assert checksums.data_extents(0, 1) is None


@pytest.fixture(scope="module")
def text_output(tmp_path_factory):
    """A text-only NeMo output of several packs: each pack's zero image is a hole."""
    root = tmp_path_factory.mktemp("holes")
    turns = [{"from": "human", "value": "Tell me a story. " * 4}, {"from": "gpt", "value": "Once upon a time. " * 12}]
    (root / "text.json").write_text(json.dumps([{"conversations": turns}] * 12))
    out = root / "out"
    args = ["preprocess", "--data_path", str(root / "text.json"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
            "--output_dir", str(out), "--conv_template", "v1", "--max_seq_length", "512", "--num_workers", "0", "--quiet"]  # fmt: skip
    assert main(args) == 0
    if not holes_supported(out / BIN):
        pytest.skip("this filesystem keeps no holes")
    return out


def sparse_copy(source, destination):
    """A copy that keeps the .bin's holes (shutil's copy writes them out as zeros)."""
    destination.mkdir()
    for path in source.iterdir():
        if path.is_file() and path.name != BIN:
            shutil.copy(path, destination / path.name)
    data = (source / BIN).read_bytes()
    with open(source / BIN, "rb") as f:
        extents = checksums.data_extents(f.fileno(), len(data))
    sparse_file(destination / BIN, {start: data[start:end] for start, end in extents}, len(data))
    assert os.stat(destination / BIN).st_blocks * 512 < len(data) // 2
    return destination


def zero_image_byte(out, pack: int) -> int:
    """Offset in the .bin of a byte in the middle of pack ``pack``'s zero image."""
    reader = nemo.Reader(paths.packed_prefix(out))
    first, _ = reader.items_of(pack)
    start = int(reader.dataset.index.sequence_pointers[first + nemo.ITEM_IMAGE])
    size = int(reader.dataset.index.sequence_lengths[first + nemo.ITEM_IMAGE]) * 4
    reader.close()
    return start + size // 2


def write_byte(path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


def test_a_sparse_text_only_output_verifies(text_output):
    result = verify(text_output, progress=False)
    assert result.ok, result.problems
    assert result.checked["packs"] > 1
    assert os.stat(text_output / BIN).st_blocks * 512 < os.path.getsize(text_output / BIN) // 2


@pytest.mark.parametrize("restamp", [False, True], ids=["stale checksum", "checksum recomputed"])
def test_a_byte_written_into_a_zero_image_hole_is_found(text_output, tmp_path, restamp):
    out = sparse_copy(text_output, tmp_path / "copy")
    pack = 1
    write_byte(out / BIN, zero_image_byte(out, pack), b"\x3f")  # one block of the hole becomes data
    assert os.path.getsize(out / BIN) == os.path.getsize(text_output / BIN)
    if restamp:  # the checksum agrees: only the format check can tell
        meta_path = paths.meta_path(paths.packed_prefix(out))
        meta = nemo.read_meta(meta_path)
        restamped = {**meta.checksums, BIN: checksums.file_checksum(out / BIN)}
        paths.write_json_atomic(meta_path, meta.replace(checksums=restamped).to_json())
    result = verify(out, progress=False)
    problems = [f"pack {pack}: no image, so one zero image was expected"]
    if not restamp:
        problems.insert(0, f"{BIN}: checksum mismatch (the file was changed or corrupted)")
    assert result.problems == problems


def test_a_flipped_data_byte_of_a_sparse_output_is_a_checksum_mismatch(text_output, tmp_path):
    out = sparse_copy(text_output, tmp_path / "copy")
    reader = nemo.Reader(paths.packed_prefix(out))
    first, _ = reader.items_of(0)
    offset = int(reader.dataset.index.sequence_pointers[first + nemo.ITEM_TOKENS]) + 2  # a token's high byte
    reader.close()
    data = (out / BIN).read_bytes()
    write_byte(out / BIN, offset, bytes([data[offset] ^ 0x01]))
    result = verify(out, progress=False)
    assert f"{BIN}: checksum mismatch (the file was changed or corrupted)" in result.problems


def test_zero_images_are_checked_by_reading_where_holes_are_unknown(text_output, tmp_path, monkeypatch):
    out = sparse_copy(text_output, tmp_path / "copy")
    write_byte(out / BIN, zero_image_byte(out, 0), b"\x01")
    monkeypatch.setattr(nemo, "data_extents", lambda fd, size: None)
    monkeypatch.setattr(checksums, "data_extents", lambda fd, size: None)
    result = verify(out, progress=False)
    assert result.problems == [
        f"{BIN}: checksum mismatch (the file was changed or corrupted)",
        "pack 0: no image, so one zero image was expected",
    ]
    reader = nemo.Reader(paths.packed_prefix(out))
    assert nemo.read_packs_from_index(paths.packed_prefix(out), int(np.prod(reader.image_shape)))["pack_images"][0] == 1
    reader.close()


def test_a_zero_image_in_a_hole_is_not_read(text_output):
    """Only the blocks of a zero image shared with the text items around it are data, and read."""
    reader = nemo.Reader(paths.packed_prefix(text_output))
    image_values = int(np.prod(reader.image_shape))
    reads = []
    get = reader.dataset.get

    def counted(i, offset=0, length=None):
        reads.append(length)
        return get(i, offset, length)

    reader.dataset.get = counted
    result = _Problems()
    nemo.check(reader, result)
    packs = len(reader)
    reader.close()
    assert result.problems == [] and packs > 1
    assert 0 < len(reads) <= 2 * packs and sum(reads) < packs * 2 * 4096 < image_values


class _Problems:
    def __init__(self):
        self.problems = []

    def add(self, problem):
        self.problems.append(problem)
