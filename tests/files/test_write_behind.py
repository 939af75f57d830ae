"""Write-behind (files/write_behind.py) changes how a large output reaches the disk, never its
bytes: every full window behind the writer is written back and the one before dropped from the
page cache, holes stay holes, and a file system that refuses the calls gets plain writes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.files import IndexedReader, IndexedWriter, WriteBehind, bin_path, write_behind

pytestmark = pytest.mark.skipif(write_behind.sync_file_range() is None, reason="no sync_file_range (not Linux)")


@pytest.fixture()
def calls(monkeypatch):
    """Every sync_file_range and fadvise call, as (name, offset, length, flags)."""
    seen = []
    real = write_behind.sync_file_range()

    def sync_file_range(fd, offset, length, flags):
        seen.append(("sync", offset, length, flags))
        return real(fd, offset, length, flags)

    def posix_fadvise(fd, offset, length, advice):
        seen.append(("drop", offset, length, advice))

    monkeypatch.setattr(write_behind, "sync_file_range", lambda: sync_file_range)
    monkeypatch.setattr(write_behind.os, "posix_fadvise", posix_fadvise)
    return seen


def test_each_window_of_data_is_written_back_and_the_one_before_dropped(tmp_path, calls):
    """A range is written back once it holds a window of data (cut where the write that filled
    it ends), and the range before it is waited for and dropped."""
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno(), window=4096)
        f.write(b"x" * 4095)
        behind.advance(4095)
        assert calls == []
        f.write(b"x" * (3 * 4096 + 1))
        behind.advance(4 * 4096)
        for end in (5 * 4096, 6 * 4096):
            f.write(b"x" * 4096)
            behind.advance(end)
    write, wait, drop = 2, 7, os.POSIX_FADV_DONTNEED
    assert calls == [
        ("sync", 0, 4 * 4096, write),
        ("sync", 4 * 4096, 4096, write), ("sync", 0, 4 * 4096, wait), ("drop", 0, 4 * 4096, drop),
        ("sync", 5 * 4096, 4096, write), ("sync", 4 * 4096, 4096, wait), ("drop", 4 * 4096, 4096, drop),
    ]  # fmt: skip


def test_holes_count_for_nothing(tmp_path, calls):
    """Small items between large holes (text-only nemo packs): no call until a window of data is
    written, whatever the offsets; the range then spans the holes."""
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno(), window=4096)
        for k in range(8):
            f.write(b"t" * 1024)
            behind.advance(f.tell())
            f.seek(f.tell() + 100_000)
            behind.skip(f.tell())
            assert len(calls) == (0 if k < 3 else 1 if k < 7 else 4), k
    page = write_behind.PAGE  # a range ends where the page the next write continues begins
    cuts = [end - end % page for end in (3 * 101_024 + 1024, 7 * 101_024 + 1024)]
    first, second = (0, cuts[0]), (cuts[0], cuts[1] - cuts[0])  # the hole after the first is in the second
    assert calls == [("sync", *first, 2), ("sync", *second, 2), ("sync", *first, 7), ("drop", *first, os.POSIX_FADV_DONTNEED)]


def test_a_range_ends_where_the_page_being_written_begins(tmp_path, calls):
    """The partly written page at the writer's end is left to the next range: handed to the disk
    now, the next write into it would wait for the disk (stable pages)."""
    page = write_behind.PAGE
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno(), window=page)
        f.write(b"z" * (2 * page + 100))
        behind.advance(f.tell())
        assert calls == [("sync", 0, 2 * page, 2)] and behind.data == 100
        f.write(b"z" * (page - 100))
        behind.advance(f.tell())
        assert calls[-3:] == [("sync", 2 * page, page, 2), ("sync", 0, 2 * page, 7), ("drop", 0, 2 * page, os.POSIX_FADV_DONTNEED)]


def test_a_refusing_file_system_gets_plain_writes(tmp_path, monkeypatch):
    refused = []
    monkeypatch.setattr(write_behind, "sync_file_range", lambda: lambda *args: refused.append(args) or -1)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno(), window=4096)
        for _ in range(4):
            f.write(b"y" * 4096)
            behind.advance(f.tell())
    assert len(refused) == 1 and not behind.enabled
    assert (tmp_path / "f").read_bytes() == b"y" * 4 * 4096


@settings(max_examples=25, deadline=None)
@given(items=st.lists(st.tuples(st.integers(0, 3000), st.booleans()), min_size=1, max_size=30), window=st.sampled_from([512, 4096, 8192]))
def test_an_indexed_file_written_behind_has_the_same_bytes(tmp_path_factory, items, window):
    """Items and holes (skip_item) written with a tiny window read back exactly as written plainly."""
    directory = tmp_path_factory.mktemp("wb")
    rng = np.random.default_rng(len(items))
    values = [rng.integers(-5, 5, n).astype(np.float32) if n and not hole else None for n, hole in items]
    for name, behind in (("plain", False), ("behind", True)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(write_behind, "WINDOW", window)
            writer = IndexedWriter(bin_path(directory / name), np.float32, write_behind=behind)
        for (n, hole), value in zip(items, values):
            writer.skip_item(n) if value is None else writer.write_item(value)
            writer.end_document()
        writer.finalize(directory / f"{name}.idx")
    assert bin_path(directory / "behind").read_bytes() == bin_path(directory / "plain").read_bytes()
    reader = IndexedReader(directory / "behind")
    for i, ((n, _), value) in enumerate(zip(items, values)):
        np.testing.assert_array_equal(reader[i], np.zeros(n, np.float32) if value is None else value)


def test_a_window_under_a_page_never_hands_over_a_zero_length(tmp_path, calls):
    """A length of 0 means "to the end of the file" to both calls: until a whole page is written
    there is nothing to hand over."""
    page = write_behind.PAGE
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno(), window=page // 4)
        f.write(b"w" * (page // 2))
        behind.advance(f.tell())
        assert calls == []
        f.write(b"w" * page)
        behind.advance(f.tell())
    assert calls == [("sync", 0, page, 2)]
