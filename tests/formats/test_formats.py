"""Every packed format through its own writer and reader, on hand-built packs and in real runs.

Parametrised over the registry: a new format is one more module, and these tests cover it --
its contract (formats/base.py), a run that leaves exactly the files it declares, --overwrite that
removes them all and nothing else, stats, verify and convert to every other format. Golden bytes
pin each format's layout for a tiny pack; the normalisation table is checked against
transformers' processors value by value.
"""

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.files import file_checksum, paths
from neva_pack.assembly import AssembledPack
from neva_pack.packing import PlanTable, padded_lengths
from neva_pack.formats import (
    Counts, FORMATS, ImageTokenIds, META_VERSION, Normalisation, PackedMeta, PackingSettings, WriteSpec, open_packed,
    read_meta, resolve_prefixes
)
from neva_pack.core import ImageRun
from neva_pack.sample_store import PoolWriter, image_key, pool_segment, segment_name
from neva_pack.commands import verify
from tests.conftest import SAMPLE_DATA

SHAPE = (3, 2, 2)
CLIP = Normalisation(rescale_factor=1 / 255, mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
RED = np.arange(12, dtype=np.uint8).reshape(SHAPE) * 20
BLUE = (255 - np.arange(12, dtype=np.uint8)).reshape(SHAPE)
START, PATCH = 7, 0  # an image run is [START, PATCH] (2 positions)


def tiny_packs(pool) -> list[AssembledPack]:
    """Three packs: two samples with images (RED twice, by two names: stored once), a text-only
    pack, and a padded pack (pad_to_multiple_of 4)."""
    red, blue = pool.add(RED)[1], pool.add(BLUE)[1]
    assert pool.add(RED.copy())[1] == red  # same pixels under another name: the same pool entry
    return [
        pack([[5, START, PATCH, 9, 2], [START, PATCH, 11]], [[-1, -1, -1, 2, -1], [-1, -1, 12]], [[red], [red, blue][:1]],
             records=[3, 0], multiple=1),  # fmt: skip
        pack([[4, 5, 6]], [[5, 6, -1]], [[]], records=[1], multiple=1),
        pack([[START, PATCH, 8], [9, 10]], [[-1, 8, -1], [10, -1]], [[blue], []], records=[2, 4], multiple=4),
    ]


def text_packs() -> list[AssembledPack]:
    """For a format that holds text only: a pack, and a padded pack (pad_to_multiple_of 4)."""
    return [
        pack([[4, 5, 6]], [[5, 6, -1]], [[]], records=[1], multiple=1),
        pack([[3, 8, 2], [9, 10]], [[-1, 2, -1], [10, -1]], [[], []], records=[2, 4], multiple=4),
    ]


def pack(tokens, labels, images, records, multiple) -> AssembledPack:
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    indices = np.array([i for sample in images for i in sample], dtype=np.int64)
    flat = np.concatenate(tokens)
    return AssembledPack(
        lengths=lengths,
        padded_lengths=padded_lengths(lengths, multiple),
        tokens=np.concatenate(tokens).astype(np.int32),
        labels=np.concatenate(labels).astype(np.int32),
        record_indices=np.array(records, dtype=np.int64),
        num_images=np.array([len(sample) for sample in images], dtype=np.int64),
        image_indices=indices,
        image_starts=np.flatnonzero(flat == START),
        pixels=np.stack([[RED, BLUE][i] for i in indices]) if len(indices) else np.zeros((0, *SHAPE), np.uint8),
    )


def tiny_meta(num_packs: int) -> PackedMeta:
    return PackedMeta(
        format="?", version=META_VERSION, num_packs=num_packs, image_shape=SHAPE, normalisation=CLIP, dataset="tiny.json",
        template="plain", tokenization="nemo", tokenizer="hand", vocab_size=16, encoder="tiny", image_aspect_ratio="square", image_positions=2,
        image_token_ids=ImageTokenIds(patch=PATCH, start=START, end=None), ignore_index=-1, pad_id=0,
        packing=PackingSettings(pad_to_multiple_of=4, max_seq_length=8, algorithm="hand", seed=0, max_samples_per_pack=None,
                                balance_data_parallel=None),
        counts=Counts(records=5, samples=5, skipped=0, truncated=0, packs=num_packs, images=3),
    )  # fmt: skip


def write_tiny(directory, name: str, stop_after: int | None = None, resume: bool = False, groups: list[int] | None = None):
    """Write the tiny packs in format ``name`` into directory; with ``stop_after``, stop after
    checkpointing that many packs and writing one more (a run killed before its next checkpoint);
    with ``groups``, hand them to the writer prepared, that many packs at a time (as from workers)."""
    store = paths.store_dir(directory)
    store.mkdir(parents=True, exist_ok=True)
    known: dict = {}
    pool = PoolWriter(pool_segment(store, segment_name(0), 0), known, 0)
    packs = tiny_packs(pool) if FORMATS[name].holds_images else text_packs()
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1,
                     pool=(pool_segment(store, segment_name(0), pool.close()),), plan_digest="tiny", image_run=ImageRun(positions=2, patch_id=PATCH, start_id=START))  # fmt: skip
    fmt = FORMATS[name]
    writer = fmt.writer(paths.packed_prefix(directory), spec, resume=resume)
    for first, count in zip(np.cumsum([0, *(groups or [])]).tolist(), groups or []):
        group = packs[first : first + count]
        writer.add_prepared(fmt.prepare(group, spec), [p.pixels for p in group])
    for p in range(writer.num_packs, len(packs)):
        writer.add(packs[p])
        if stop_after is not None and p + 1 == stop_after:
            writer.checkpoint()
        if stop_after is not None and p == stop_after:
            return None  # killed: the pack after the checkpoint is in the file, never checkpointed
    return writer.publish(tiny_table(name), [], tiny_meta(len(packs)))


def tiny_table(name: str) -> PlanTable:
    if not FORMATS[name].holds_images:
        return PlanTable(offsets=np.array([0, 1, 3]), record_index=np.array([1, 2, 4]), length=np.array([3, 3, 2]),
                         padded_length=np.array([3, 4, 4]), num_images=np.array([0, 0, 0]))  # fmt: skip
    return PlanTable(
        offsets=np.array([0, 2, 3, 5]), record_index=np.array([3, 0, 1, 2, 4]), length=np.array([5, 3, 3, 3, 2]),
        padded_length=np.array([5, 3, 3, 4, 4]), num_images=np.array([1, 1, 0, 1, 0]),
    )  # fmt: skip


EXPECTED = [  # (cu_seqlens, cu_seqlens_unpadded, tokens, labels, images as pixels)
    ([0, 5, 8], [0, 5, 8], [5, 7, 0, 9, 2, 7, 0, 11], [-1, -1, -1, 2, -1, -1, -1, 12], [RED, RED]),
    ([0, 3], [0, 3], [4, 5, 6], [5, 6, -1], []),
    ([0, 4, 8], [0, 3, 5], [7, 0, 8, 0, 9, 10, 0, 0], [-1, 8, -1, -1, 10, -1, -1, -1], [BLUE]),
]
EXPECTED_TEXT = [  # text_packs()
    ([0, 3], [0, 3], [4, 5, 6], [5, 6, -1], []),
    ([0, 4, 8], [0, 3, 5], [3, 8, 2, 0, 9, 10, 0, 0], [-1, 2, -1, -1, 10, -1, -1, -1], []),
]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_through_writer_and_reader(tmp_path, name):
    meta = write_tiny(tmp_path, name)
    assert meta.format == name and read_meta(paths.meta_path(paths.packed_prefix(tmp_path))) == meta
    reader = open_packed(tmp_path)
    expected = EXPECTED if FORMATS[name].holds_images else EXPECTED_TEXT
    assert type(reader) is type(FORMATS[name].reader(paths.packed_prefix(tmp_path))) and len(reader) == len(expected)
    for p, (cu, cu_unpadded, tokens, labels, pixels) in enumerate(expected):
        got = reader.pack(p)
        assert got.cu_seqlens.tolist() == cu and got.cu_seqlens_unpadded.tolist() == cu_unpadded
        assert got.tokens.tolist() == tokens and got.labels.tolist() == labels
        assert got.num_images == len(pixels)
        expected = CLIP.apply(np.stack(pixels)) if pixels else np.zeros((1, *SHAPE), np.float32)
        images = got.images if got.pixels is None else (CLIP.apply(got.pixels) if len(got.pixels) else np.zeros((1, *SHAPE), np.float32))
        assert images.tobytes() == expected.tobytes()
    assert reader.plan_table().padded_length.tolist() == tiny_table(name).padded_length.tolist()
    reader.close()
    result = verify(tmp_path, progress=False)
    assert result.ok, result.problems


def test_compact_golden_bytes_inline(tmp_path):
    """The compact layout, spelled out: int32 ids (an image run's first positions implied), the index
    arrays back to back, the pool."""
    write_tiny(tmp_path, "compact")
    prefix = paths.packed_prefix(tmp_path)
    from neva_pack.formats import compact

    meta_file = paths.meta_path(prefix)
    tokens_file, labels_file, index_file = (paths.prefix_file(prefix, s) for s in (compact.TOKENS, compact.LABELS, compact.INDEX))
    assert tokens_file.read_bytes() == np.array([5, 0, 9, 2, 0, 11, 4, 5, 6, 0, 8, 9, 10], "<i4").tobytes()
    assert labels_file.read_bytes() == np.array([-1, -1, 2, -1, -1, 12, 5, 6, -1, 8, -1, 10, -1], "<i4").tobytes()
    arrays = read_meta(meta_file).layout["arrays"]
    index = index_file.read_bytes()
    expected = {
        "pack_offsets": np.array([0, 2, 3, 5], "<i8"), "token_offsets": np.array([0, 6, 9, 13], "<i8"),
        "image_offsets": np.array([0, 2, 2, 3], "<i8"), "length": np.array([5, 3, 3, 3, 2], "<i4"),
        "padded_length": np.array([5, 3, 3, 4, 4], "<i4"), "record_index": np.array([3, 0, 1, 2, 4], "<i8"),
        "num_images": np.array([1, 1, 0, 1, 0], "<i4"), "image_indices": np.array([0, 0, 1], "<i8"),
        "image_starts": np.array([1, 5, 0], "<i8"),
    }  # fmt: skip
    assert index == b"".join(values.tobytes() for values in expected.values())
    assert list(arrays) == list(expected)
    pool = pool_segment(paths.store_dir(tmp_path), segment_name(0), 2)
    assert pool.images_file.read_bytes() == RED.tobytes() + BLUE.tobytes()  # RED once, though used twice
    assert pool.keys_file.read_bytes() == image_key(RED) + image_key(BLUE)


def test_nemo_golden_bytes_inline(tmp_path):
    """NeMo's layout, spelled out: per pack cu_seqlens, tokens, labels, images, all float32."""
    write_tiny(tmp_path, "nemo")
    zero = np.zeros((1, *SHAPE), np.float32)
    items = [
        [0, 5, 8], [5, 7, 0, 9, 2, 7, 0, 11], [-1, -1, -1, 2, -1, -1, -1, 12], CLIP.apply(np.stack([RED, RED])),
        [0, 3], [4, 5, 6], [5, 6, -1], zero,
        [0, 4, 8], [7, 0, 8, 0, 9, 10, 0, 0], [-1, 8, -1, -1, 10, -1, -1, -1], CLIP.apply(BLUE[None]),
    ]  # fmt: skip
    from neva_pack.files import bin_path

    assert bin_path(paths.packed_prefix(tmp_path)).read_bytes() == b"".join(np.asarray(i, "<f4").tobytes() for i in items)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_writer_resumes_after_its_last_checkpoint_with_the_same_bytes(tmp_path, name):
    write_tiny(tmp_path / "whole", name)
    assert write_tiny(tmp_path / "killed", name, stop_after=1) is None
    write_tiny(tmp_path / "killed", name, resume=True)
    meta = read_meta(paths.meta_path(paths.packed_prefix(tmp_path / "whole")))
    for file in meta.checksums:
        assert (tmp_path / "killed" / file).read_bytes() == (tmp_path / "whole" / file).read_bytes(), file


@pytest.mark.parametrize("groups", [[3], [1, 2], [2, 1]])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_packs_prepared_in_groups_are_written_as_packs_added_one_by_one(tmp_path, name, groups):
    """What workers send (``fmt.prepare`` of a group of packs) writes the bytes ``add`` writes."""
    write_tiny(tmp_path / "one_by_one", name)
    write_tiny(tmp_path / "grouped", name, groups=groups)
    meta = read_meta(paths.meta_path(paths.packed_prefix(tmp_path / "one_by_one")))
    for file in meta.checksums:
        assert (tmp_path / "grouped" / file).read_bytes() == (tmp_path / "one_by_one" / file).read_bytes(), file


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_meta_of_an_unknown_format_or_newer_version_is_refused(tmp_path, name):
    from neva_pack.core import InputError

    meta = write_tiny(tmp_path, name)
    path = paths.meta_path(paths.packed_prefix(tmp_path))
    for change, message in (({"format": "parquet"}, "format 'parquet' is not one"), ({"version": META_VERSION + 1}, "newer")):
        paths.write_json_atomic(path, {**meta.to_json(), **change})
        with pytest.raises(InputError, match=message):
            open_packed(tmp_path)


GOLDEN_METAS = SAMPLE_DATA.parent / "tests" / "golden" / "meta"
"""Metas written by the code before PackedMeta nested its packing settings (``PackingSettings``; made at
commit a7a448b: a flat ``PackedMeta(...)`` written with ``paths.write_json_atomic(path, meta.to_json())``):
a fixed-crop nemo meta with every packing setting set, and a dynamic compact one with them unset."""


GOLDEN_PACKING = {
    "fixed": PackingSettings(pad_to_multiple_of=8, max_seq_length=4096, algorithm="first_fit_decreasing", seed=7,
                             max_samples_per_pack=16, balance_data_parallel=2, max_images_per_pack=4,
                             max_image_tokens_per_pack=2304),
    "dynamic": PackingSettings(pad_to_multiple_of=1, max_seq_length=8192, algorithm="first_fit_shuffle", seed=0,
                               max_samples_per_pack=None, balance_data_parallel=None),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GOLDEN_PACKING))
def test_a_meta_written_before_the_nesting_reads_back_and_is_written_byte_identical(tmp_path, name):
    """Metas already published must stay readable, and a meta written now must be the bytes an
    older reader (and every checksum over the meta) expects: same flat keys, same order."""
    from neva_pack.formats import meta_checksum_ok, read_meta_json

    golden = GOLDEN_METAS / f"{name}.meta.json"
    meta = read_meta(golden)
    assert meta.packing == GOLDEN_PACKING[name]
    assert meta.max_seq_length == meta.packing.max_seq_length and meta.seed == meta.packing.seed  # read as before
    assert meta == PackedMeta.from_json(read_meta_json(golden))
    assert meta_checksum_ok(meta.to_json())
    rewritten = tmp_path / golden.name
    paths.write_json_atomic(rewritten, meta.to_json())
    assert rewritten.read_bytes() == golden.read_bytes()
    assert list(meta.to_json()) == list(read_meta_json(golden))


def test_normalisation_table_is_the_processors_float_ops_bit_for_bit():
    """All 256 values of every channel of every shipped encoder, against transformers itself."""
    from neva_pack.families import known_encoders, resolve_encoder
    from neva_pack.families.fixed import ImagePreprocessor, processor_halves

    for name in known_encoders(family="fixed"):
        pre = ImagePreprocessor(resolve_encoder(name), "square")
        h, w = pre.shape[1:]
        pixels = np.resize(np.arange(256, dtype=np.uint8), (1, 3, h, w))
        _, values = processor_halves(pre.encoder)  # transformers' own rescale + normalize
        expected = values(images=list(pixels), return_tensors="np", input_data_format="channels_first",
                          data_format="channels_first")["pixel_values"].astype(np.float32)  # fmt: skip
        got = pre.normalisation().apply(pixels)
        assert got.dtype == expected.dtype == np.float32
        assert got.tobytes() == expected.tobytes(), name
        table = pre.normalisation().lut()  # what the accelerator path looks pixels up in
        assert all(table[c][pixels[0, c]].tobytes() == expected[0, c].tobytes() for c in range(3))
        assert np.array_equal(pre.normalisation().invert(got), pixels)


def test_pool_keys_are_content_hashes():
    assert image_key(RED) == image_key(RED.copy()) != image_key(BLUE)
    assert len(image_key(RED)) == 16


def test_resolve_prefixes_of_a_multi_size_directory(tmp_path):
    for size in (16, 8):
        prefix = paths.packed_prefix(tmp_path, size)
        paths.meta_path(prefix).write_text("{}")
    assert resolve_prefixes(tmp_path) == [paths.packed_prefix(tmp_path, 8), paths.packed_prefix(tmp_path, 16)]
    assert paths.stats_path_of(paths.packed_prefix(tmp_path, 8)) == paths.stats_path(tmp_path, 8)


@st.composite
def random_packs(draw):
    """Packs of samples made of text ids (>= 10) and image runs [START, PATCH, PATCH, 9] (4 positions)."""
    run = [START, PATCH, PATCH, 9]
    packs = []
    for _ in range(draw(st.integers(1, 4))):
        tokens, labels, starts, lengths = [], [], [], []
        for _ in range(draw(st.integers(1, 3))):
            sample, sample_labels = [], []
            for part in draw(st.lists(st.sampled_from(["text", "image"]), min_size=1, max_size=5)):
                if part == "image":
                    starts.append(len(tokens) + len(sample))
                    sample += run
                    sample_labels += [-1, -1, -1, draw(st.sampled_from([-1, 42]))]  # the run's last label may be trained
                else:
                    ids = draw(st.lists(st.integers(10, 99), min_size=1, max_size=4))
                    sample += ids
                    sample_labels += [draw(st.sampled_from([-1, i])) for i in ids]
            tokens += sample
            labels += sample_labels
            lengths.append(len(sample))
        lengths = np.array(lengths)
        packs.append(AssembledPack(
            lengths=lengths, padded_lengths=padded_lengths(lengths, draw(st.sampled_from([1, 4]))),
            tokens=np.array(tokens, np.int32), labels=np.array(labels, np.int32), record_indices=np.arange(len(lengths)),
            num_images=np.zeros(len(lengths), np.int64), image_indices=np.zeros(len(starts), np.int64),
            image_starts=np.array(starts, np.int64), pixels=None,
        ))  # fmt: skip
    return packs


@settings(max_examples=30, deadline=None)
@given(packs=random_packs())
def test_compact_stores_image_runs_once_and_reads_back_every_position(tmp_path_factory, packs):
    """Property: whatever the mix of text, image runs (trained last label or not) and padding, the compact
    reader returns exactly the positions written, padded as the contract says."""
    from neva_pack.formats import compact

    directory = tmp_path_factory.mktemp("prop")
    store = paths.store_dir(directory)
    store.mkdir()
    pool = PoolWriter(pool_segment(store, segment_name(0), 0), {}, 0)
    pool.add(RED)
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1, plan_digest="p",
                     pool=(pool_segment(store, segment_name(0), pool.close()),), image_run=ImageRun(positions=4, patch_id=PATCH, start_id=START, end_id=9))  # fmt: skip
    writer = compact.FORMAT.writer(paths.packed_prefix(directory), spec)
    for p in packs:
        writer.add(p)
    meta = tiny_meta(len(packs)).replace(image_positions=4, image_token_ids=ImageTokenIds(patch=PATCH, start=START, end=9))
    writer.publish(None, [], meta)
    reader = open_packed(directory)
    stored = 0
    for k, p in enumerate(packs):
        got = reader.pack(k)
        starts = np.concatenate([[0], np.cumsum(p.padded_lengths)[:-1]])
        real = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, p.lengths)])
        assert got.tokens[real].tolist() == p.tokens.tolist() and got.labels[real].tolist() == p.labels.tolist()
        pad = np.setdiff1d(np.arange(len(got.tokens)), real)
        assert np.all(got.tokens[pad] == 0) and np.all(got.labels[pad] == -1)
        assert got.cu_seqlens.tolist() == [0, *np.cumsum(p.padded_lengths).tolist()]
        stored += len(p.tokens) - 3 * len(p.image_starts)
    assert paths.prefix_file(paths.packed_prefix(directory), compact.TOKENS).stat().st_size == 4 * stored
    reader.close()


def test_nemo_writer_failure_in_its_thread_reaches_the_caller(tmp_path):
    """The nemo writer normalises and writes in a thread: what fails there is raised by the next call."""
    store = paths.store_dir(tmp_path)
    store.mkdir(parents=True)
    pool = PoolWriter(pool_segment(store, segment_name(0), 0), {}, 0)
    good = tiny_packs(pool)[0]
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1,
                     pool=(pool_segment(store, segment_name(0), pool.close()),), plan_digest="tiny", image_run=ImageRun(positions=2, patch_id=PATCH, start_id=START))  # fmt: skip
    writer = FORMATS["nemo"].writer(paths.packed_prefix(tmp_path), spec)
    broken = AssembledPack(**{**{f: getattr(good, f) for f in AssembledPack.__dataclass_fields__},
                              "pixels": good.pixels[:, :, :1]})  # fmt: skip
    writer.add(broken)
    with pytest.raises(ValueError, match="images of shape"):
        writer.checkpoint()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_checksums_computed_while_writing_are_the_files(tmp_path, name):
    """The nemo .bin and the compact tokens/labels are hashed as written (and, resumed, from the
    checkpoint's bytes on): the meta's checksums are those of the files, read back."""
    for directory, resumed in ((tmp_path / "whole", False), (tmp_path / "resumed", True)):
        if resumed:
            assert write_tiny(directory, name, stop_after=1) is None
        meta = write_tiny(directory, name, resume=resumed)
        for file, checksum in meta.checksums.items():
            assert checksum == file_checksum(directory / file), (name, resumed, file)


# --- the contract, over the registry ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_registered_format_satisfies_the_contract(tmp_path, name):
    from neva_pack.core import ConfigError
    from neva_pack.formats import PackedFormat, PackReader, PackWriter

    fmt = FORMATS[name]
    assert isinstance(fmt, PackedFormat) and fmt.name == name
    assert fmt.description and "\n" not in fmt.description  # its line of --output_format's help
    prefix = paths.packed_prefix(tmp_path)
    files = fmt.files(prefix)
    assert paths.meta_path(prefix) in files.final and files.plan_table in files.final and files.checkpoint in files.temporary
    assert not set(files.final) & set(files.temporary)
    for size in (None, 8):  # each prefix of a multi-size run has its own files, named after it (or its size)
        assert all(path.name.startswith(paths.packed_prefix(tmp_path, size).name + ".") or f"{size}" in path.name
                   for path in fmt.files(paths.packed_prefix(tmp_path, size)).every)  # fmt: skip
    assert not set(fmt.files(paths.packed_prefix(tmp_path, 8)).every) & set(fmt.files(paths.packed_prefix(tmp_path, 16)).every)
    write_tiny(tmp_path, name)
    assert isinstance(fmt.reader(prefix), PackReader)
    (tmp_path / "other").mkdir()
    assert isinstance(fmt.writer(paths.packed_prefix(tmp_path / "other"), _tiny_spec(tmp_path)), PackWriter)
    limits = fmt.limits
    fmt.check_settings(max_seq_length=limits.max_pack, ignore_index=-limits.max_integer, vocab_size=limits.max_integer)
    for settings, flag in (({"max_seq_length": limits.max_pack + 1}, "--max_seq_length"), ({"max_seq_length": 1}, "--max_seq_length"),
                           ({"pack_sizes": [4, limits.max_pack + 1]}, "--pack_sizes"),
                           ({"ignore_index": limits.max_integer + 1}, "--ignore_index")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"^{flag} "):
            fmt.check_settings(**settings)


def test_output_format_help_is_each_formats_description(capsys):
    """--output_format's help is made from the registry: a new format brings its own line."""
    from neva_pack.cli import main

    with pytest.raises(SystemExit):
        main(["preprocess", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for name, fmt in FORMATS.items():
        assert "".join(f"{name}: {fmt.description}".split()) in text, name


def _tiny_spec(directory) -> WriteSpec:
    store = paths.store_dir(directory)
    return WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1,
                     pool=(pool_segment(store, segment_name(0), 0),), plan_digest="tiny",
                     image_run=ImageRun(positions=2, patch_id=PATCH, start_id=START))  # fmt: skip


def test_only_nemo_is_bound_by_float32():
    """2**24 is where float32 stops holding every integer: NeMo's limit, no other format's."""
    assert FORMATS["nemo"].limits.max_pack == FORMATS["nemo"].limits.max_integer == 2**24
    assert all(fmt.limits.max_pack > 2**24 for name, fmt in FORMATS.items() if name != "nemo")


def text_only_data(directory):
    """The sample data without its images (for a format that holds text only)."""
    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    for record in records:
        record.pop("image", None)
        for turn in record["conversations"]:
            turn["value"] = turn["value"].replace("<image>", "").strip()
    path = directory / "text_only.json"
    path.write_text(json.dumps(records))
    return path


def run_preprocess(output_dir, name, *extra) -> None:
    from neva_pack.cli import main

    data = SAMPLE_DATA / "llava_sample.json" if FORMATS[name].holds_images else text_only_data(output_dir.parent)
    args = ["preprocess", "--quiet", "--data_path", str(data), "--image_folder",
            str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--output_dir",
            str(output_dir), "--num_workers", "0", "--pack_sizes", "1024", "2048", "--output_format", name, *extra]  # fmt: skip
    assert main(args) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A two-size run of the sample data in every registered format."""
    root = tmp_path_factory.mktemp("runs")
    for name in FORMATS:
        run_preprocess(root / name, name)
    return root


def top_level(directory) -> set:
    from neva_pack.pipeline import entries

    return {directory / entry for entry in entries(directory)}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_run_leaves_exactly_the_files_its_format_declares(runs, name):
    out = runs / name
    prefixes = resolve_prefixes(out)
    assert prefixes == [paths.packed_prefix(out, 1024), paths.packed_prefix(out, 2048)]
    declared = {path for prefix in prefixes for path in FORMATS[name].files(prefix).final}
    others = {path for prefix in prefixes for other in FORMATS.values() if other.name != name
              for path in other.files(prefix).final if path != paths.meta_path(prefix)} - declared  # fmt: skip
    run_files = set(paths.run_paths(out))
    assert declared <= top_level(out), "a declared file is missing"
    assert top_level(out) - declared <= run_files, "a file that neither the format nor the run declares"
    assert not (top_level(out) & others), "another format's file"
    for prefix in prefixes:
        files = FORMATS[name].files(prefix)
        assert not any(path.exists() for path in files.temporary)
        listed = read_meta(paths.meta_path(prefix)).checksums
        for path in files.final[1:]:  # every file besides the meta (in a format's directory: every file in it) is checksummed by it
            inside = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
            assert inside and all(paths.relative_name(out, f) in listed for f in inside)
        if FORMATS[name].uses_image_pool:  # its images: the sample store's pool, which the meta checksums too
            assert any(name.startswith(paths.STORE_DIR + "/") for name in listed)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_overwrite_removes_every_file_of_the_run_and_nothing_else(runs, tmp_path, name):
    from neva_pack.pipeline import owned_outputs, remove

    out = tmp_path / "out"
    shutil.copytree(runs / name, out)
    prefix = paths.packed_prefix(out, 1024)
    for path in FORMATS[name].files(prefix).temporary:  # a killed writer's leftovers are the format's too
        path.write_bytes(b"left by a killed run")
    foreign = [out / "notes.txt", out / "their_data" / "keep.bin"]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_text("the user's")
    remove(owned_outputs(out, {}))
    assert top_level(out) == {out / "notes.txt", out / "their_data"}
    assert all(path.read_text() == "the user's" for path in foreign)
    for path in foreign:  # and a whole run with --overwrite over a run keeps them too
        path.unlink()
    shutil.copytree(runs / name, out, dirs_exist_ok=True)
    for path in foreign:
        path.write_text("the user's")
    run_preprocess(out, name, "--overwrite")
    assert all(path.read_text() == "the user's" for path in foreign)
    assert verify(out, progress=False).ok


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_overwrite_refuses_a_file_under_a_format_name_that_is_not_the_formats(tmp_path, name):
    from neva_pack.core import ConfigError
    from neva_pack.pipeline import owned_outputs

    for k, path in enumerate(FORMATS[name].files(paths.packed_prefix(tmp_path / "dirs")).final):
        directory = tmp_path / f"case_{k}"
        directory.mkdir()
        user_file = directory / path.name
        user_file.write_text("the user's")
        with pytest.raises(ConfigError, match=f"{path.name} .*nothing was deleted"):
            owned_outputs(directory, {})
        assert user_file.read_text() == "the user's"


class DirectoryFormat:
    """A format whose writer leaves a directory beside the prefix (as Energon's ``.nv-meta/``):
    only what --overwrite needs of it."""

    name = "with_directory"

    def files(self, prefix):
        from neva_pack.formats import PrefixFiles

        checkpoint, staging = paths.checkpoint_paths(prefix)
        return PrefixFiles(final=(paths.meta_path(prefix), paths.prefix_file(prefix, ".nv-meta")),
                           plan_table=paths.meta_path(prefix), temporary=(checkpoint, staging), checkpoint=checkpoint)  # fmt: skip

    def owns(self, path):
        return path.is_dir() and (path / "dataset.yaml").is_file()


def test_overwrite_removes_a_directory_a_format_declares_as_its_own(tmp_path, monkeypatch):
    from neva_pack.core import ConfigError
    from neva_pack.pipeline import owned_outputs, remove

    monkeypatch.setitem(FORMATS, DirectoryFormat.name, DirectoryFormat())
    own = paths.prefix_file(paths.packed_prefix(tmp_path, 64), ".nv-meta")
    own.mkdir()
    (own / "dataset.yaml").write_text("ours")
    remove(owned_outputs(tmp_path, {}))
    assert not own.exists()
    own.mkdir()  # without what the format recognises: refused
    with pytest.raises(ConfigError, match="nothing was deleted"):
        owned_outputs(tmp_path, {})


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_stats_verify_and_convert_to_every_other_format(runs, tmp_path, capsys, name):
    from neva_pack.cli import main
    from neva_pack.core import ConfigError

    out = runs / name
    assert main(["verify", "--quiet", str(out)]) == 0
    for prefix in resolve_prefixes(out):
        capsys.readouterr()
        assert main(["stats", "--json", str(prefix)]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(paths.stats_path_of(prefix).read_text())
    for other in sorted(set(FORMATS) - {name}):
        try:  # a target that cannot hold the data is not one to convert to
            for prefix in resolve_prefixes(out):
                meta = read_meta(paths.meta_path(prefix))
                FORMATS[other].check_settings(max_seq_length=meta.max_seq_length, ignore_index=meta.ignore_index)
        except ConfigError:
            continue
        dest = tmp_path / other
        if not FORMATS[other].holds_images and FORMATS[name].holds_images:  # the sample data has images
            capsys.readouterr()
            assert main(["convert", "--quiet", str(out), str(dest), "--to", other]) == 2
            error = capsys.readouterr().err
            assert "cannot hold (text only)" in error and error.count("\n") == 1
            continue
        assert main(["convert", "--quiet", str(out), str(dest), "--to", other]) == 0
        assert main(["verify", "--quiet", str(dest)]) == 0
        assert main(["stats", str(dest)]) == 0
        for source_prefix, prefix in zip(resolve_prefixes(out), resolve_prefixes(dest), strict=True):
            source, converted = open_packed(source_prefix), open_packed(prefix)
            assert type(converted) is type(FORMATS[other].reader(prefix)) and len(converted) == len(source)
            for p in range(len(source)):
                a, b = source.pack(p, images=False), converted.pack(p, images=False)
                assert a.tokens.tolist() == b.tokens.tolist() and a.labels.tolist() == b.labels.tolist()
                assert source.images(p).numpy().tobytes() == converted.images(p).numpy().tobytes()
            source.close()
            converted.close()
