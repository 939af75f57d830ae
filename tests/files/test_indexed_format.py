"""files/indexed.py against Megatron-Core's IndexedDatasetBuilder and IndexedDataset, byte for byte.

Any sequence of add_item / add_document / end_document / add_index calls (and all-zero items
left as holes, and a resume from a checkpoint of the writer's state) gives the .bin/.idx that
Megatron's builder writes for the same calls; Megatron's reader reads our files to the same
arrays, and our reader reads Megatron's files to the same arrays as Megatron's reader.
"""

import contextlib
import os
import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neva_pack.core import InputError
from neva_pack.files import DTYPE_CODES, IndexedReader, IndexedWriter, bin_path, idx_path, read_index


def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@contextlib.contextmanager
def without_megatrons_gc(indexed_dataset):
    """Megatron's add_index calls gc.collect() to free the index it read: it changes no byte, but a
    full collection of a heap holding torch costs ~0.6 s, most of this property's time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(indexed_dataset, "gc", types.SimpleNamespace(collect=lambda *args: 0))
        yield


DTYPES = sorted(DTYPE_CODES, key=str)
values = st.lists(st.integers(0, 120), max_size=6).map(lambda v: np.array(v, dtype=np.int64))
item = st.tuples(values, st.integers(0, 3))
operation = st.one_of(
    st.tuples(st.just("item"), item),
    st.tuples(st.just("zeros"), st.tuples(st.integers(0, 5), st.integers(0, 3))),
    st.tuples(st.just("document"), st.lists(item, max_size=4)),
    st.tuples(st.just("end"), st.none()),
    st.tuples(st.just("index"), st.none()),
)


def apply_megatron(builder, op, arg, dtype, source):
    import torch

    kind = op
    if kind == "item":
        builder.add_item(torch.from_numpy(arg[0].astype(dtype)), arg[1])
    elif kind == "zeros":
        builder.add_item(torch.from_numpy(np.zeros(arg[0], dtype=dtype)), arg[1])
    elif kind == "document":
        flat = np.concatenate([v for v, _ in arg]) if arg else np.zeros(0, dtype=np.int64)
        builder.add_document(flat.astype(dtype), [len(v) for v, _ in arg], [m for _, m in arg])
    elif kind == "end":
        builder.end_document()
    else:
        builder.add_index(str(source))


def apply_ours(writer, op, arg, dtype, source):
    if op == "item":
        writer.add_item(arg[0], arg[1])
    elif op == "zeros":
        writer.skip_item(arg[0], arg[1])
    elif op == "document":
        flat = np.concatenate([v for v, _ in arg]) if arg else np.zeros(0, dtype=np.int64)
        writer.add_document(flat, [len(v) for v, _ in arg], [m for _, m in arg])
    elif op == "end":
        writer.end_document()
    else:
        writer.add_index(source)


def build_source(directory, dtype, multimodal, items) -> str:
    """A small dataset written by Megatron, for add_index."""
    mi = megatron()
    prefix = str(directory / "source")
    builder = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype.type, multimodal=multimodal)
    for k, (values_, mode) in enumerate(items):
        apply_megatron(builder, "item", (values_, mode), dtype, None)
        if k % 2:
            builder.end_document()
    builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def same_items(ours, theirs, multimodal):
    """Our reader and Megatron's read the same items, documents and modes."""
    assert list(ours.document_indices) == list(theirs.document_indices)
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        got = theirs[i]
        if multimodal:
            got, mode = got
            assert mode == ours.sequence_modes[i]
        assert got.dtype == ours[i].dtype
        assert np.array_equal(got, ours[i])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    multimodal=st.booleans(),
    ops=st.lists(operation, max_size=12),
    source_items=st.lists(item, min_size=1, max_size=4),
    checkpoint=st.integers(0, 12),
)
def test_same_bytes_as_megatron_builder(tmp_path_factory, dtype, multimodal, ops, source_items, checkpoint):
    mi = megatron()
    directory = tmp_path_factory.mktemp("indexed")
    source = build_source(directory, dtype, multimodal, source_items)
    theirs = str(directory / "theirs")
    builder = mi.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype.type, multimodal=multimodal)
    ours = directory / "ours"
    writer = IndexedWriter(bin_path(ours), dtype, multimodal=multimodal)
    state = None
    with without_megatrons_gc(mi):
        for k, (op, arg) in enumerate(ops):
            if k == checkpoint:
                writer.sync()
                state = writer.state()
            apply_megatron(builder, op, arg, dtype, source)
            apply_ours(writer, op, arg, dtype, source)
    builder.end_document()  # a dataset ends with a document boundary (Megatron's reader insists)
    builder.finalize(theirs + ".idx")
    if state is not None:  # killed after the checkpoint: continue from it, byte-identical
        writer.close()
        with open(bin_path(ours), "ab") as f:
            f.write(b"torn write after the checkpoint")
        writer = IndexedWriter(bin_path(ours), dtype, multimodal=multimodal, state=state)
        for op, arg in ops[checkpoint:]:
            apply_ours(writer, op, arg, dtype, source)
    writer.end_document()
    writer.finalize(idx_path(ours))
    assert bin_path(ours).read_bytes() == open(theirs + ".bin", "rb").read()
    assert idx_path(ours).read_bytes() == open(theirs + ".idx", "rb").read()
    # Megatron reads our files (file reads: it cannot map an empty .bin); we read Megatron's
    same_items(IndexedReader(ours, multimodal=multimodal), mi.IndexedDataset(str(ours), multimodal=multimodal, mmap=False), multimodal)
    for mmap in (False, True):
        same_items(IndexedReader(theirs, multimodal=multimodal, mmap=mmap),
                   mi.IndexedDataset(theirs, multimodal=multimodal, mmap=False), multimodal)  # fmt: skip


def test_zero_items_are_holes(tmp_path):
    """A skipped all-zero item takes no disk blocks; a hole at the end is materialised by finalize."""
    big = 1 << 20
    writer = IndexedWriter(tmp_path / "d.bin", np.float32, multimodal=True)
    writer.write_item(np.arange(4, dtype=np.float32))
    writer.skip_item(big, mode=1)
    writer.end_document()
    writer.finalize(tmp_path / "d.idx")
    assert os.path.getsize(tmp_path / "d.bin") == 16 + 4 * big
    assert os.stat(tmp_path / "d.bin").st_blocks * 512 < big  # sparse: the zeros were never written
    reader = IndexedReader(tmp_path / "d", multimodal=True)
    assert not np.any(reader[1]) and len(reader[1]) == big and list(reader.sequence_modes) == [0, 1]
    assert [len(item) for item in reader.document(0)] == [4, big]


def test_items_and_documents_read_at_once(tmp_path):
    writer = IndexedWriter(tmp_path / "d.bin", np.int32)
    writer.add_document(np.arange(5), [2, 0, 3])
    writer.add_document(np.arange(7, 9), [2])
    writer.finalize(tmp_path / "d.idx")
    reader = IndexedReader(tmp_path / "d")
    assert [a.tolist() for a in reader.document(0)] == [[0, 1], [], [2, 3, 4]]
    assert [a.tolist() for a in reader.items(2, 2)] == [[2, 3, 4], [7, 8]]
    assert reader.items(1, 0) == []


def test_refuses_what_is_not_an_index(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(InputError, match="not an IndexedDataset index"):
        read_index(tmp_path / "x.idx")
    writer = IndexedWriter(tmp_path / "t.bin", np.int32)
    writer.add_document(np.arange(3), [3])
    writer.finalize(tmp_path / "t.idx")
    data = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(data[:-4])
    with pytest.raises(InputError, match="header announces"):
        read_index(tmp_path / "t.idx")
    (tmp_path / "t.idx").write_bytes(data)
    (tmp_path / "t.bin").write_bytes(b"\x00" * 4)
    with pytest.raises(InputError, match="ends at byte"):
        IndexedReader(tmp_path / "t")[0]
    with pytest.raises(ValueError, match="contiguous"):
        IndexedWriter(tmp_path / "u.bin", np.int32).write_item(np.arange(3, dtype=np.int64))
