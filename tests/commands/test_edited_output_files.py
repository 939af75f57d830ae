"""Any file of an output edited at random, data files included, by class over the registry: ``verify``
finds it (exit 1, or 2 where the meta itself is unreadable), ``convert`` refuses to carry it into
another format, and ``stats``, ``open_packed``, ``PackedSeqDataset`` and the collates either read on
(a data file is verify's to check, never an open's: tests/formats/test_reader_checks.py) or refuse in
one line -- never a traceback, a hang or a message of several lines.

The edits are those a disk, a copy or a hand makes: a bit flipped, a word overwritten with an extreme
value, the file cut short, emptied, or grown by bytes that are not a whole item."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neva_pack.cli import main
from neva_pack.core import NevaPackError
from neva_pack.files import meta_path, packed_prefix, relative_name
from neva_pack.formats import FORMATS, open_packed, read_meta
from neva_pack.reading import PackedSeqDataset
from neva_pack.training import hf_collate, thd_collate
from tests.formats.test_reader_checks import outputs  # noqa: F401 (a fixture: a tiny published output of every format)

WORDS = (b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x00\x00\x00\x00", b"\xff" * 8)
"""Extreme values a word of a binary file is overwritten with: int32 and int64 limits, zero, all ones."""


def output_files(directory: Path) -> list[str]:
    """The meta and every file its checksums list (data files, the pool's, Energon's index), by name."""
    prefix = packed_prefix(directory)
    checksums = read_meta(meta_path(prefix)).checksums
    listed = checksums.get("files", checksums)  # a run's meta nests them beside the algorithm; write_tiny's does not
    return [relative_name(directory, meta_path(prefix)), *sorted(listed)]


@st.composite
def edits(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "word", "truncate", "empty", "grow"]))
    if not data or kind == "grow":
        return data + bytes(draw(st.integers(1, 7)))
    if kind == "truncate":
        return data[: draw(st.integers(1, len(data) - 1))] if len(data) > 1 else b""
    if kind == "empty":
        return b""
    at = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1 :]
    word = draw(st.sampled_from(WORDS))[: len(data) - at]
    return data[:at] + word + data[at + len(word) :]


def cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def read_everything(directory: Path) -> None:
    """What a training job does with an output: open it, read every pack and item, batch them."""
    reader = open_packed(directory)
    for p in range(len(reader)):
        reader.pack(p)
    dataset = PackedSeqDataset(directory)
    items = [dataset[i] for i in range(len(dataset))]
    if items:
        hf_collate(dataset)(items)
        thd_collate(dataset)(items)


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_edit_of_any_file_of_an_output_is_found_by_verify_and_refused_in_one_line_elsewhere(outputs, tmp_path_factory, name, data):  # noqa: F811
    edited_output_holds(outputs, tmp_path_factory, name, data)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_many_edits_of_any_file_of_an_output(outputs, tmp_path_factory, name, data):  # noqa: F811
    edited_output_holds(outputs, tmp_path_factory, name, data)


def edited_output_holds(outputs, tmp_path_factory, name, data):  # noqa: F811
    source = outputs[name]
    file = data.draw(st.sampled_from(output_files(source)), label="file")
    original = (source / file).read_bytes()
    edited = data.draw(edits(original).filter(lambda new: new != original), label="edit")
    directory = tmp_path_factory.mktemp("edited")
    shutil.copytree(source, directory, dirs_exist_ok=True)
    (directory / file).write_bytes(edited)
    if file.endswith(".meta.json") and _same_json(original, edited):
        return  # whitespace changed: the meta says what it said (its checksum is of what it says)

    code, err = cli("verify", "--quiet", str(directory))
    assert code in (1, 2), (code, err)
    assert "Traceback" not in err
    target = min(set(FORMATS) - {name})
    code, err = cli("convert", "--quiet", "--to", target, str(directory), str(directory) + "_converted")
    assert code == 2 and err.count("\n") == 1 and err.startswith("neva-pack: error: "), err
    code, err = cli("stats", str(directory))
    assert code in (0, 2) and (code == 0 or err.count("\n") == 1), err
    try:
        read_everything(directory)
    except (NevaPackError, ValueError) as refused:
        assert "\n" not in str(refused), refused


def _same_json(original: bytes, edited: bytes) -> bool:
    try:
        return json.dumps(json.loads(edited), sort_keys=True) == json.dumps(json.loads(original), sort_keys=True)
    except ValueError:
        return False


def test_a_pack_whose_data_file_moved_its_sample_bounds_is_refused_by_the_items_in_one_line(outputs, tmp_path):  # noqa: F811
    """NeMo's .bin holds each pack's cu_seqlens (float32): edited, the bounds no longer held the tokens,
    and the batch functions failed far from the cause (a RuntimeError of tensor sizes). An item is now
    checked against the plan table the open checked."""
    import numpy as np

    shutil.copytree(outputs["nemo"], tmp_path, dirs_exist_ok=True)
    bin_file = tmp_path / "packed_seq_dataset.bin"
    data = bin_file.read_bytes()
    bounds = np.array([0, 5, 8], dtype=np.float32).tobytes()  # the first tiny pack's cu_seqlens
    assert data.count(bounds) == 1
    bin_file.write_bytes(data.replace(bounds, np.array([0, 6, 8], dtype=np.float32).tobytes()))
    dataset = PackedSeqDataset(tmp_path)  # the open hashes no data file
    with pytest.raises(NevaPackError, match=r"pack 0 holds 8 tokens and 8 labels in samples ending at \[6, 8\], its plan table \[5, 8\]") as refused:
        dataset[0]
    assert "\n" not in str(refused.value) and "neva-pack verify" in str(refused.value)
    assert cli("verify", "--quiet", str(tmp_path))[0] == 1
