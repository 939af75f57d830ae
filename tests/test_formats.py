"""Every packed format through its own writer and reader, on hand-built packs.

Parametrised over the registry: a third format is one more module, and these tests cover it.
Golden bytes pin each format's layout for a tiny pack; the normalisation table is checked
against transformers' processors value by value.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack import store as layout
from neva_pack.assemble import AssembledPack
from neva_pack.packing.alignment import padded_lengths
from neva_pack.formats import FORMATS, open_packed, resolve_prefixes
from neva_pack.formats.base import WriteSpec
from neva_pack.formats.image_pool import PoolWriter, image_key, pool_part
from neva_pack.formats.meta import META_VERSION, Counts, ImageTokenIds, Normalisation, PackedMeta, PlanTable, read_meta
from neva_pack.verify import verify

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
        image_token_ids=ImageTokenIds(patch=PATCH, start=START, end=None), ignore_index=-1, pad_id=0, pad_to_multiple_of=4,
        max_seq_length=8, algorithm="hand", seed=0, max_samples_per_pack=None, balance_data_parallel=None,
        counts=Counts(records=5, samples=5, skipped=0, truncated=0, packs=num_packs, images=3),
    )  # fmt: skip


def write_tiny(directory, name: str, stop_after: int | None = None, resume: bool = False, groups: list[int] | None = None):
    """Write the tiny packs in format ``name`` into directory; with ``stop_after``, stop after
    checkpointing that many packs and writing one more (a run killed before its next checkpoint);
    with ``groups``, hand them to the writer prepared, that many packs at a time (as from workers)."""
    store = layout.store_dir(directory)
    store.mkdir(parents=True, exist_ok=True)
    known: dict = {}
    pool = PoolWriter(pool_part(store, "shard_00000", 0), known, 0)
    packs = tiny_packs(pool)
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1,
                     pool=(pool_part(store, "shard_00000", pool.close()),), plan_digest="tiny", image_run=(START, PATCH))  # fmt: skip
    fmt = FORMATS[name]
    writer = fmt.Writer(layout.packed_prefix(directory), spec, resume=resume)
    for first, count in zip(np.cumsum([0, *(groups or [])]).tolist(), groups or []):
        group = packs[first : first + count]
        writer.add_prepared(fmt.prepare(group, spec), [p.pixels for p in group])
    for p in range(writer.num_packs, len(packs)):
        writer.add(packs[p])
        if stop_after is not None and p + 1 == stop_after:
            writer.checkpoint()
        if stop_after is not None and p == stop_after:
            return None  # killed: the pack after the checkpoint is in the file, never checkpointed
    table = PlanTable(
        offsets=np.array([0, 2, 3, 5]), record_index=np.array([3, 0, 1, 2, 4]), length=np.array([5, 3, 3, 3, 2]),
        padded_length=np.array([5, 3, 3, 4, 4]), num_images=np.array([1, 1, 0, 1, 0]),
    )  # fmt: skip
    return writer.publish(table, [], tiny_meta(len(packs)))


EXPECTED = [  # (cu_seqlens, cu_seqlens_unpadded, tokens, labels, images as pixels)
    ([0, 5, 8], [0, 5, 8], [5, 7, 0, 9, 2, 7, 0, 11], [-1, -1, -1, 2, -1, -1, -1, 12], [RED, RED]),
    ([0, 3], [0, 3], [4, 5, 6], [5, 6, -1], []),
    ([0, 4, 8], [0, 3, 5], [7, 0, 8, 0, 9, 10, 0, 0], [-1, 8, -1, -1, 10, -1, -1, -1], [BLUE]),
]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_through_writer_and_reader(tmp_path, name):
    meta = write_tiny(tmp_path, name)
    assert meta.format == name and read_meta(layout.meta_path(layout.packed_prefix(tmp_path))) == meta
    reader = open_packed(tmp_path)
    assert type(reader) is FORMATS[name].Reader and len(reader) == 3
    for p, (cu, cu_unpadded, tokens, labels, pixels) in enumerate(EXPECTED):
        got = reader.pack(p)
        assert got.cu_seqlens.tolist() == cu and got.cu_seqlens_unpadded.tolist() == cu_unpadded
        assert got.tokens.tolist() == tokens and got.labels.tolist() == labels
        assert got.num_images == len(pixels)
        expected = CLIP.apply(np.stack(pixels)) if pixels else np.zeros((1, *SHAPE), np.float32)
        images = got.images if got.pixels is None else (CLIP.apply(got.pixels) if len(got.pixels) else np.zeros((1, *SHAPE), np.float32))
        assert images.tobytes() == expected.tobytes()
    assert reader.plan_table().padded_length.tolist() == [5, 3, 3, 4, 4]
    reader.close()
    result = verify(tmp_path, progress=False)
    assert result.ok, result.problems


def test_compact_golden_bytes_inline(tmp_path):
    """The compact layout, spelled out: int32 ids (an image run's first positions implied), the index
    arrays back to back, the pool."""
    write_tiny(tmp_path, "compact")
    prefix = layout.packed_prefix(tmp_path)
    assert (tmp_path / "packed_seq_dataset.tokens.bin").read_bytes() == np.array(
        [5, 0, 9, 2, 0, 11, 4, 5, 6, 0, 8, 9, 10], "<i4").tobytes()  # fmt: skip
    assert (tmp_path / "packed_seq_dataset.labels.bin").read_bytes() == np.array(
        [-1, -1, 2, -1, -1, 12, 5, 6, -1, 8, -1, 10, -1], "<i4").tobytes()  # fmt: skip
    arrays = read_meta(layout.meta_path(prefix)).layout["arrays"]
    index = (tmp_path / "packed_seq_dataset.index.bin").read_bytes()
    expected = {
        "pack_offsets": np.array([0, 2, 3, 5], "<i8"), "token_offsets": np.array([0, 6, 9, 13], "<i8"),
        "image_offsets": np.array([0, 2, 2, 3], "<i8"), "length": np.array([5, 3, 3, 3, 2], "<i4"),
        "padded_length": np.array([5, 3, 3, 4, 4], "<i4"), "record_index": np.array([3, 0, 1, 2, 4], "<i8"),
        "num_images": np.array([1, 1, 0, 1, 0], "<i4"), "image_indices": np.array([0, 0, 1], "<i8"),
        "image_starts": np.array([1, 5, 0], "<i8"),
    }  # fmt: skip
    assert index == b"".join(values.tobytes() for values in expected.values())
    assert list(arrays) == list(expected)
    pool = tmp_path / "packed_seq_dataset" / "shard_00000.images"
    assert pool.read_bytes() == RED.tobytes() + BLUE.tobytes()  # RED once, though used twice
    assert (tmp_path / "packed_seq_dataset" / "shard_00000.image_keys").read_bytes() == image_key(RED) + image_key(BLUE)


def test_nemo_golden_bytes_inline(tmp_path):
    """NeMo's layout, spelled out: per pack cu_seqlens, tokens, labels, images, all float32."""
    write_tiny(tmp_path, "nemo")
    zero = np.zeros((1, *SHAPE), np.float32)
    items = [
        [0, 5, 8], [5, 7, 0, 9, 2, 7, 0, 11], [-1, -1, -1, 2, -1, -1, -1, 12], CLIP.apply(np.stack([RED, RED])),
        [0, 3], [4, 5, 6], [5, 6, -1], zero,
        [0, 4, 8], [7, 0, 8, 0, 9, 10, 0, 0], [-1, 8, -1, -1, 10, -1, -1, -1], CLIP.apply(BLUE[None]),
    ]  # fmt: skip
    assert (tmp_path / "packed_seq_dataset.bin").read_bytes() == b"".join(np.asarray(i, "<f4").tobytes() for i in items)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_writer_resumes_after_its_last_checkpoint_with_the_same_bytes(tmp_path, name):
    write_tiny(tmp_path / "whole", name)
    assert write_tiny(tmp_path / "killed", name, stop_after=1) is None
    write_tiny(tmp_path / "killed", name, resume=True)
    meta = read_meta(layout.meta_path(layout.packed_prefix(tmp_path / "whole")))
    for file in meta.checksums:
        assert (tmp_path / "killed" / file).read_bytes() == (tmp_path / "whole" / file).read_bytes(), file


@pytest.mark.parametrize("groups", [[3], [1, 2], [2, 1]])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_packs_prepared_in_groups_are_written_as_packs_added_one_by_one(tmp_path, name, groups):
    """What workers send (``fmt.prepare`` of a group of packs) writes the bytes ``add`` writes."""
    write_tiny(tmp_path / "one_by_one", name)
    write_tiny(tmp_path / "grouped", name, groups=groups)
    meta = read_meta(layout.meta_path(layout.packed_prefix(tmp_path / "one_by_one")))
    for file in meta.checksums:
        assert (tmp_path / "grouped" / file).read_bytes() == (tmp_path / "one_by_one" / file).read_bytes(), file


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_meta_of_an_unknown_format_or_newer_version_is_refused(tmp_path, name):
    from neva_pack.errors import InputError

    meta = write_tiny(tmp_path, name)
    path = layout.meta_path(layout.packed_prefix(tmp_path))
    for change, message in (({"format": "parquet"}, "format 'parquet' is not one"), ({"version": META_VERSION + 1}, "newer")):
        layout.write_json_atomic(path, {**meta.to_json(), **change})
        with pytest.raises(InputError, match=message):
            open_packed(tmp_path)


def test_normalisation_table_is_the_processors_float_ops_bit_for_bit():
    """All 256 values of every channel of every shipped encoder, against transformers itself."""
    from neva_pack.encoders import known_encoders, resolve_encoder
    from neva_pack.images import ImagePreprocessor

    for name in known_encoders(family="fixed"):
        pre = ImagePreprocessor(resolve_encoder(name), "square")
        h, w = pre.shape[1:]
        pixels = np.resize(np.arange(256, dtype=np.uint8), (1, 3, h, w))
        _, values = pre._built()  # transformers' own rescale + normalize
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
        prefix = layout.packed_prefix(tmp_path, size)
        layout.meta_path(prefix).write_text("{}")
    assert [p.name for p in resolve_prefixes(tmp_path)] == ["packed_seq_dataset_8", "packed_seq_dataset_16"]
    assert layout.stats_path_of(layout.packed_prefix(tmp_path, 8)).name == "stats_8.json"


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
    store = layout.store_dir(directory)
    store.mkdir()
    pool = PoolWriter(pool_part(store, "shard_00000", 0), {}, 0)
    pool.add(RED)
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1, plan_digest="p",
                     pool=(pool_part(store, "shard_00000", pool.close()),), image_run=(START, PATCH, PATCH, 9))  # fmt: skip
    writer = compact.Writer(layout.packed_prefix(directory), spec)
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
    assert (directory / "packed_seq_dataset.tokens.bin").stat().st_size == 4 * stored
    reader.close()


def test_nemo_writer_failure_in_its_thread_reaches_the_caller(tmp_path):
    """The nemo writer normalises and writes in a thread: what fails there is raised by the next call."""
    store = layout.store_dir(tmp_path)
    store.mkdir(parents=True)
    pool = PoolWriter(pool_part(store, "shard_00000", 0), {}, 0)
    good = tiny_packs(pool)[0]
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1,
                     pool=(pool_part(store, "shard_00000", pool.close()),), plan_digest="tiny", image_run=(START, PATCH))  # fmt: skip
    writer = FORMATS["nemo"].Writer(layout.packed_prefix(tmp_path), spec)
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
            assert checksum == layout.file_checksum(directory / file), (name, resumed, file)
