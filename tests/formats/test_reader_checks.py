"""Readers believe only what they can check (neva_pack/formats/trust.py, training/item_checks.py).

By class, over the registry: every small file a reader trusts (the meta, the plan table, the format's
index files: ``PackedFormat.trusted_files``) of every registered format, edited at random (a byte
flipped, a value changed, the file cut short), is refused on open by ``open_packed`` and
``PackedSeqDataset`` in one line naming the file and ``neva-pack verify``; the open reads none of the
data files. And the collates refuse items of outputs with other ignore values, image runs or families.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neva_pack.core import InputError
from neva_pack.files import meta_path, packed_prefix, relative_name
from neva_pack.formats import FORMATS, open_packed, read_meta
from neva_pack.reading import PackedSamples, PackedSeqDataset
from neva_pack.training import hf_batch, hf_collate, thd_batch, thd_collate
from tests.pipeline.test_dynamic_pipeline import workload  # noqa: F401 (a fixture: a Qwen2-VL workload of images of several sizes)
from tests.formats.test_formats import write_tiny


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny published output of every registered format."""
    made = {}
    for name in FORMATS:
        made[name] = tmp_path_factory.mktemp(name)
        write_tiny(made[name], name)
    return made


def trusted(directory: Path, name: str) -> list[str]:
    """The output-relative names of the files a reader of ``directory`` believes: the meta first."""
    prefix = packed_prefix(directory)
    files = FORMATS[name].trusted_files(prefix, read_meta(meta_path(prefix)))
    return [relative_name(directory, meta_path(prefix)), *(relative_name(directory, path) for path in files)]


@st.composite
def edits(draw, data: bytes, is_json: bool):
    """The bytes of a file after one random edit: a bit pattern flipped, a value changed, cut short."""
    kind = draw(st.sampled_from(["flip", "value", "truncate"]))
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flip":
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    if is_json:  # a value of the meta changed, the file otherwise as written (its checksum as it was)
        value = json.loads(data)
        leaves = list(_leaves(value))
        path, old = draw(st.sampled_from(leaves))
        new = draw(st.one_of(st.integers(-10, 10**6), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
                             st.none(), st.booleans()).filter(lambda v: v != old or type(v) is not type(old)))  # fmt: skip
        _set(value, path, new)
        return json.dumps(value, indent=2).encode()
    at = draw(st.integers(0, max(0, len(data) - 8)))  # a binary word overwritten
    word = draw(st.binary(min_size=min(8, len(data) - at), max_size=min(8, len(data) - at)).filter(lambda w: w != data[at : at + len(w)]))
    return data[:at] + word + data[at + len(word) :]


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "meta_checksum":
                yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for k, item in enumerate(value):
            yield from _leaves(item, (*path, k))
    else:
        yield path, value


def _set(value, path, new):
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_edit_of_a_file_a_reader_trusts_is_refused_on_open_in_one_line(outputs, tmp_path_factory, name, data):
    source = outputs[name]
    file = data.draw(st.sampled_from(trusted(source, name)), label="file")
    original = (source / file).read_bytes()
    edited = data.draw(edits(original, file.endswith(".json")), label="edit")
    directory = tmp_path_factory.mktemp("edited")
    shutil.copytree(source, directory, dirs_exist_ok=True)
    (directory / file).write_bytes(edited)
    if file.endswith(".meta.json") and _same_json(original, edited):
        open_packed(directory)  # whitespace flipped: the meta (checksummed by what it says) is read as before
        return
    for opener in (open_packed, PackedSeqDataset):
        with pytest.raises(InputError) as caught:
            opener(directory)
        message = str(caught.value)
        assert "\n" not in message and str(directory / file) in message, message
        assert "neva-pack verify" in message, message


def _same_json(original: bytes, edited: bytes) -> bool:
    try:
        return json.dumps(json.loads(edited), sort_keys=True) == json.dumps(json.loads(original), sort_keys=True)  # 0 is not 0.0
    except ValueError:
        return False


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_an_open_reads_only_the_small_files_it_trusts_never_the_data(outputs, monkeypatch, name):
    """What the open hashes is exactly the format's trusted files: a published output's data files
    (.bin, shards, rows, pool pixels) are verify's to read, never an open's."""
    from neva_pack.formats import trust

    hashed = []
    real = trust.file_checksum
    monkeypatch.setattr(trust, "file_checksum", lambda path: hashed.append(Path(path)) or real(path))
    directory = outputs[name]
    PackedSeqDataset(directory)
    names = {relative_name(directory, path) for path in hashed}
    assert names == set(trusted(directory, name)[1:])
    data = {"nemo": ".bin", "compact": "tokens.bin", "bridge": ".npy", "bridge_parquet": ".idx.parquet", "energon": ".tar",
            "llamafactory": ".arrow"}[name]
    assert not [n for n in names if n.endswith(data)]
    listed = read_meta(meta_path(packed_prefix(directory))).checksums
    assert any(n.endswith(data) for n in listed)  # the data file exists, and is not read


def test_an_edited_image_mean_is_refused_where_it_was_read_silently(tmp_path):
    """The issue's case: the meta's image mean changed by hand (a valid meta, its checksum as written)."""
    write_tiny(tmp_path, "compact")
    path = meta_path(packed_prefix(tmp_path))
    meta = json.loads(path.read_text())
    meta["normalisation"]["mean"][0] = 0.5
    path.write_text(json.dumps(meta, indent=2))
    with pytest.raises(InputError, match=r"meta\.json: its own checksum does not match .*neva-pack verify"):
        PackedSeqDataset(tmp_path)


# --- the collates ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ignore_values(tmp_path_factory):
    """sample_data preprocessed twice, text only, with ignore values -1 and -7."""
    from neva_pack.cli import main
    from tests.conftest import SAMPLE_DATA

    made = []
    for ignore in (-1, -7):
        output = tmp_path_factory.mktemp(f"ignore{ignore}")
        args = ["preprocess", "--quiet", "--data_path", SAMPLE_DATA / "llava_sample.json", "--image_folder", SAMPLE_DATA / "images",
                "--tokenizer_path", SAMPLE_DATA / "tokenizer.model", "--output_dir", output, "--max_seq_length", 2048,
                "--num_workers", 0, "--output_format", "compact", f"--ignore_index={ignore}"]  # fmt: skip
        assert main(list(map(str, args))) == 0
        made.append(PackedSeqDataset(output))
    return made


@pytest.mark.parametrize("collate", [hf_collate, thd_collate])
def test_a_collate_refuses_items_of_an_output_with_another_ignore_value(two_ignore_values, collate):
    ours, theirs = two_ignore_values
    fn = collate(ours)
    fn([ours[0], ours[1]])  # one output's items: as before
    with pytest.raises(ValueError, match=r"^batch item 1 comes from an output with ignore_index -7, the collate's output has -1: .*ignore values") as caught:
        fn([ours[0], theirs[0]])
    assert "\n" not in str(caught.value)
    rebuilt = dict(theirs[0])  # a dict rebuilt by user code: no marker, its labels still show it
    with pytest.raises(ValueError, match=r"holds label -7, neither a token id nor this collate's ignore value -1"):
        fn([ours[0], rebuilt])


def test_batches_of_items_given_directly_refuse_two_outputs(two_ignore_values):
    ours, theirs = two_ignore_values
    for batch in (hf_batch, thd_batch):
        with pytest.raises(ValueError, match="ignore values cannot share a batch"):
            batch([ours[0], theirs[0]], **({} if batch is hf_batch else {"with_packed_seq_params": False}))


def test_a_collate_refuses_items_of_another_family_or_image_run_in_one_line(two_ignore_values):
    from dataclasses import replace

    from neva_pack.reading import PackItem

    ours = two_ignore_values[0]
    fn = thd_collate(ours)
    family = PackItem({key: value for key, value in ours[0].items() if key != "image"})
    family.update(pixel_values=torch.zeros((0, 1176)), image_grid_thw=torch.zeros((0, 3), dtype=torch.long))
    family.source = replace(ours.source, family="qwen2_vl", image_shape=None, image_run=(None, 5, 4, 6))
    with pytest.raises(ValueError, match=r"^batch item 1 comes from an output with image_run .*image runs cannot share a batch$"):
        fn([ours[0], family])
    with pytest.raises(ValueError, match=r"^batch item 1 has image_grid_thw, pixel_values that item 0 does not: .*families"):
        fn([ours[0], dict(family)])  # no marker: its keys show its family


def test_items_keep_their_marker_through_pickling_and_samples_carry_it_too(two_ignore_values):
    import pickle

    ours = two_ignore_values[0]
    item = pickle.loads(pickle.dumps(ours[0]))
    assert item.source == ours.source and set(item) == set(ours[0])
    assert all(torch.equal(item[key], ours[0][key]) for key in item)
    assert PackedSamples(ours)[0].source == ours.source


def test_a_dynamic_pools_shape_files_are_trusted_and_checked_on_open(workload, tmp_path):  # noqa: F811 (the fixture imported)
    """A dynamic-resolution compact output: where each image's parts lie is in the pool's shape files,
    which the reader believes, so an open checks them too."""
    from tests.pipeline.test_dynamic_pipeline import run

    assert run(workload, tmp_path / "out", 0) == 0
    names = trusted(tmp_path / "out", "compact")
    shapes = [name for name in names if name.endswith(".image_shapes")]
    assert shapes, names
    PackedSeqDataset(tmp_path / "out")[0]  # unedited: read as before
    path = tmp_path / "out" / shapes[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"^{path}: checksum mismatch .*neva-pack verify"):
        PackedSeqDataset(tmp_path / "out")
