"""Dynamic-resolution images (each at its own size and run length) through the sample store,
assembly, the pack checks and the compact format, and back out of its reader, exactly.

Samples are built by hand as the sample builder makes them (DYNAMIC contract): a Qwen2-VL run is
``<|vision_start|> <|image_pad|> x tokens <|vision_end|>``, the images images.StoredImage."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from neva_pack.files import paths
from neva_pack.assembly import assemble_packs, rows_at
from neva_pack.families import (
    StoredImage, dynamic_processor, processor_from_record, processor_record, resolve_encoder, stored_vision_cost
)
from neva_pack.core import ConfigError, ImageRun
from neva_pack.formats import (
    Counts, FORMATS, ImageTokenIds, META_VERSION, PackedMeta, PackingSettings, WriteSpec, check_dynamic_images,
    open_prefix
)
from neva_pack.packing import PackSpec, PlanTable, pack, pack_is_sound, pack_problems
from neva_pack.sample_store import PROGRESS_FILE, SampleStore, SampleStoreWriter, join_part, stored_batch
from neva_pack.samples import Sample
from neva_pack.commands import verify

IGNORE = -100
START, PATCH, END = 3, 4, 5
RUN = ImageRun(positions=None, patch_id=PATCH, start_id=START, end_id=END)
QWEN = resolve_encoder("Qwen/Qwen2-VL-7B-Instruct")
PROCESSOR = dynamic_processor(QWEN, min_pixels=28 * 28, max_pixels=28 * 28 * 64)
RECORD = processor_record(QWEN, PROCESSOR)


def stored(seed: int, grid_h: int, grid_w: int) -> StoredImage:
    """A Qwen-shaped stored image: (3, 28 h, 28 w) pixels, h * w tokens (patch 14, merge 2)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (3, 28 * grid_h, 28 * grid_w), dtype=np.uint8)
    return StoredImage(size=(28 * grid_w + seed % 5, 28 * grid_h), parts=(pixels,), tokens=grid_h * grid_w)


def sample(index: int, pieces, rng) -> Sample:
    """Text pieces (lists of ids >= 10) and images in order; labels are the next id or ignored,
    always ignored inside a run before its last position."""
    ids, starts, images = [], [], []
    for piece in pieces:
        if isinstance(piece, StoredImage):
            starts.append(len(ids))
            images.append(piece)
            ids += [START] + [PATCH] * piece.tokens + [END]
        else:
            ids += piece
    ids.append(10 + index)
    inside = np.zeros(len(ids), dtype=bool)
    for start, image in zip(starts, images):
        inside[start : start + image.tokens + 1] = True
    labels = [IGNORE if inside[k] or rng.random() < 0.3 else ids[k + 1] for k in range(len(ids) - 1)]
    lengths = np.array([image.tokens + 2 for image in images], dtype=np.int32)
    return Sample(
        index=index, record_id=str(index), tokens=np.array(ids[:-1], np.int32), labels=np.array(labels, np.int32),
        images=tuple(images), image_starts=np.array(starts, np.int32), image_tokens=lengths,
        vision_cost=sum(stored_vision_cost(PROCESSOR, image) for image in images), truncated=False,
    )  # fmt: skip


@st.composite
def dynamic_samples(draw):
    """Samples mixing text and images of random grids (1..5 x 1..5 merged patches), some images shared."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    images = [stored(k, draw(st.integers(1, 5)), draw(st.integers(1, 5))) for k in range(draw(st.integers(1, 4)))]
    samples = []
    for index in range(draw(st.integers(1, 7))):
        pieces = draw(st.lists(st.one_of(st.sampled_from(images), st.lists(st.integers(10, 60), min_size=1, max_size=5)),
                               min_size=1, max_size=4))  # fmt: skip
        samples.append(sample(index, pieces, rng))
    return samples


def write_store(directory: Path, samples, per_segment: int = 2) -> SampleStore:
    writer = SampleStoreWriter(directory, None, {"test": 1}, image_run=RUN, ignore_index=IGNORE, image_processor=RECORD)
    for first in range(0, len(samples), per_segment):
        chunk = samples[first : first + per_segment]
        writer.append_stored(stored_batch(chunk, RUN, IGNORE, None), first, first + len(chunk))
        writer.commit(first + len(chunk))
    writer.finish(len(samples))
    return SampleStore(directory)


def write_compact(output_dir: Path, store: SampleStore, capacity: int, algorithm: str = "first_fit_decreasing"):
    """Pack the store at ``capacity``, check each pack, write a compact prefix; (packs, prefix)."""
    rows, cuts, _ = rows_at(store, capacity, IGNORE)
    plan = pack(rows["length"].astype(np.int64), capacity, algorithm=algorithm)
    spec = WriteSpec(image_shape=None, normalisation=PROCESSOR.normalisation, pad_id=0, ignore_index=IGNORE,
                     pool=tuple(store.pool_segments), plan_digest="dynamic", image_run=RUN, image_processor=RECORD)  # fmt: skip
    checks = PackSpec(max_seq_length=capacity, ignore_index=IGNORE, image_run=RUN, pad_id=0)
    packs = list(assemble_packs(store, plan, cuts, pad_id=0, ignore_index=IGNORE))
    prefix = paths.packed_prefix(output_dir)
    writer = FORMATS["compact"].writer(prefix, spec)
    for assembled in packs:
        cu = np.concatenate([[0], np.cumsum(assembled.padded_lengths)])
        args = (checks, cu, assembled.padded_tokens, assembled.padded_labels, len(assembled.image_indices))
        assert pack_problems(*args, real_lengths=assembled.lengths, image_lengths=assembled.image_lengths) == []
        assert pack_is_sound(*args, real_lengths=assembled.lengths, image_lengths=assembled.image_lengths)
        writer.add(assembled)
    meta = PackedMeta(
        format="?", version=META_VERSION, num_packs=len(packs), image_shape=None, normalisation=PROCESSOR.normalisation,
        dataset="hand.json", template="qwen2_vl", tokenization="hf", tokenizer="hand", vocab_size=64, encoder=QWEN.name,
        image_aspect_ratio="native", image_positions=None, image_token_ids=ImageTokenIds(patch=PATCH, start=START, end=END),
        ignore_index=IGNORE, pad_id=0, packing=PackingSettings(pad_to_multiple_of=1, max_seq_length=capacity, algorithm=algorithm,
                                                               seed=0, max_samples_per_pack=None, balance_data_parallel=None),
        counts=Counts(records=len(store), samples=len(store), skipped=0, truncated=len(cuts), packs=len(packs),
                      images=int(sum(len(p.image_indices) for p in packs))),
    )  # fmt: skip
    writer.publish(PlanTable.of(rows, plan, 1), [], meta)
    return packs, prefix


@settings(max_examples=25, deadline=None)
@given(samples=dynamic_samples())
def test_store_assemble_compact_read_round_trips_dynamic_samples_exactly(samples):
    """Property: whatever the images' run lengths and their mix with text, every sample's tokens,
    labels, image starts, image run lengths and stored images come back exactly, through the store,
    assembly (every pack sound by both checks), the compact writer and its reader."""
    with tempfile.TemporaryDirectory() as tmp:
        store = write_store(Path(tmp) / "store", samples)
        assert store.dynamic and store.image_shape is None
        for i, s in enumerate(samples):
            tokens, labels = store.tokens_labels(i)
            np.testing.assert_array_equal(tokens, s.tokens)
            np.testing.assert_array_equal(labels, s.labels)
            starts, lengths = store.image_runs(i)
            assert starts.tolist() == s.image_starts.tolist() and lengths.tolist() == s.image_tokens.tolist()
            assert_same_images(store.images(i), s.images)
        np.testing.assert_array_equal(store.image_tokens, [int(s.image_tokens.sum()) for s in samples])
        np.testing.assert_array_equal(store.vision_cost, [s.vision_cost for s in samples])
        np.testing.assert_array_equal(store.num_images, [len(s.images) for s in samples])
        distinct = {image.parts[0].tobytes() for s in samples for image in s.images}
        assert len(store.pool) == len(distinct)  # each image stored once
        capacity = int(max(len(s.tokens) for s in samples))
        packs, prefix = write_compact(Path(tmp), store, capacity)
        reader = open_prefix(prefix)
        assert reader.meta.image_shape is None and reader.meta.crop_size is None
        assert processor_from_record(reader.meta.image_processor).settings == PROCESSOR.settings
        for p, assembled in enumerate(packs):
            read = reader.pack(p)
            np.testing.assert_array_equal(read.tokens, assembled.tokens)
            np.testing.assert_array_equal(read.labels, assembled.labels)
            np.testing.assert_array_equal(read.image_lengths, assembled.image_lengths)
            assert read.pixels is None and read.images is None and read.num_images == len(assembled.image_indices)
            records = assembled.record_indices.tolist()
            expected = [image for r in records for image in samples[r].images]
            assert_same_images(read.stored_images, expected)
            starts = np.concatenate([[0], np.cumsum(assembled.lengths)])[:-1]
            expected_starts = np.concatenate([start + samples[r].image_starts for start, r in zip(starts, records)] or [[]])
            np.testing.assert_array_equal(assembled.image_starts, expected_starts)
        reader.close()
        assert verify(prefix, progress=False).ok


def assert_same_images(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.size == b.size and a.tokens == b.tokens and len(a.parts) == len(b.parts)
        for x, y in zip(a.parts, b.parts):
            assert x.shape == y.shape and x.dtype == y.dtype == np.uint8 and np.array_equal(x, y)


def test_real_qwen_images_round_trip_with_their_vision_cost(tmp_path):
    """Photos through the real processor, two images in one sample: stored once each, read back
    exactly, the row's image tokens and vision cost those of both images."""
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (150, 230, 3), dtype=np.uint8))
    first, second = PROCESSOR.to_uint8(photo), PROCESSOR.to_uint8(photo.resize((60, 90)))
    s = sample(0, [[11, 12], first, [13, 14, 15], second, [16]], np.random.default_rng(1))
    store = write_store(tmp_path / "store", [s])
    assert_same_images(store.images(0), [first, second])
    assert store.image_tokens.tolist() == [first.tokens + second.tokens + 4]
    assert store.vision_cost.tolist() == [(first.tokens * 4) ** 2 + (second.tokens * 4) ** 2]
    packs, prefix = write_compact(tmp_path, store, len(s.tokens))
    assert_same_images(open_prefix(prefix).pack(0).stored_images, [first, second])


def test_a_cut_keeps_the_kept_images_run_lengths_and_vision_cost(tmp_path):
    """Cut before the second image's run (it does not fit whole), the row keeps the first image's
    run length and vision cost, exactly, and the pack holds only that image."""
    photo = Image.fromarray(np.random.default_rng(3).integers(0, 256, (150, 230, 3), dtype=np.uint8))
    first, second = PROCESSOR.to_uint8(photo), PROCESSOR.to_uint8(photo.resize((60, 90)))
    s = sample(0, [[11, 12], first, [13, 14, 15], second, [16]], np.random.default_rng(1))
    s = Sample(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "labels": np.where(np.arange(len(s.labels)) == 0, 12, s.labels).astype(np.int32)})
    store = write_store(tmp_path / "store", [s])
    capacity = int(s.image_starts[1]) + 2  # the second run cannot fit
    rows, cuts, _ = rows_at(store, capacity, IGNORE)
    assert cuts == {0: (int(s.image_starts[1]), 1)}
    assert int(rows["image_tokens"][0]) == first.tokens + 2 and int(rows["num_images"][0]) == 1
    assert int(rows["vision_cost"][0]) == (first.tokens * 4) ** 2 == PROCESSOR.vision_cost_for_size(*first.size)
    packs, prefix = write_compact(tmp_path, store, capacity)
    assert_same_images(open_prefix(prefix).pack(0).stored_images, [first])


def test_a_sharded_dynamic_store_joins_to_the_unsharded_store(tmp_path):
    """Parts dedup only within themselves; joined, the pool holds each image once, in first use order."""
    rng = np.random.default_rng(2)
    images = [stored(k, 1 + k, 2) for k in range(3)]
    samples = [sample(i, [[20 + i], images[i % 3], images[(i + 1) % 3]], rng) for i in range(4)]
    whole = write_store(tmp_path / "whole", samples, per_segment=4)
    part_a = write_store(tmp_path / "a", samples[:2])
    part_b_dir = tmp_path / "b"
    writer = SampleStoreWriter(part_b_dir, None, {"test": 1}, first_record=2, image_run=RUN, ignore_index=IGNORE, image_processor=RECORD)
    writer.append_stored(stored_batch(samples[2:], RUN, IGNORE, None), 2, 4)
    writer.finish(4)
    joined = SampleStoreWriter(tmp_path / "joined", None, {"test": 1}, image_run=RUN, ignore_index=IGNORE, image_processor=RECORD)
    join_part(joined, part_a.directory, 0, 2)
    join_part(joined, part_b_dir, 2, 4)
    joined.finish(4)
    store = SampleStore(tmp_path / "joined")
    assert len(store.pool) == len(whole.pool) == 3
    for i in range(4):
        assert store.image_indices(i).tolist() == whole.image_indices(i).tolist()
        assert_same_images(store.images(i), whole.images(i))


def test_a_resume_with_other_processor_settings_is_refused(tmp_path):
    write_store(tmp_path, [sample(0, [[11], stored(0, 1, 1)], np.random.default_rng(0))])
    other = {**RECORD, "max_pixels": RECORD["max_pixels"] * 2}
    with pytest.raises(ConfigError, match="image_processor"):
        SampleStoreWriter(tmp_path, None, {"test": 1}, resume=True, image_run=RUN, ignore_index=IGNORE, image_processor=other)
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert progress["image_shape"] is None and progress["image_run"] == {"start": START, "patch": PATCH, "end": END}


def test_a_pack_with_a_wrong_run_length_is_refused_by_both_checks():
    tokens = np.array([11, START, PATCH, PATCH, END, 12])
    labels = np.full(6, IGNORE)
    spec = PackSpec(max_seq_length=8, ignore_index=IGNORE, image_run=RUN, pad_id=0)
    for lengths, sound in (([4], True), ([3], False), ([5], False), ([2, 2], False)):
        args = (spec, [0, 6], tokens, labels, len(lengths))
        assert pack_is_sound(*args, image_lengths=lengths) == sound
        assert (pack_problems(*args, image_lengths=lengths) == []) == sound


def test_formats_that_cannot_hold_dynamic_images_say_which_can():
    check_dynamic_images("compact", QWEN.name)
    for name, says in (("nemo", "holds one image shape"), ("bridge", "holds text only")):  # a text-only format would skip every image record
        with pytest.raises(ConfigError, match=f"--output_format {name}: .*{says}.*--output_format compact") as error:
            check_dynamic_images(name, QWEN.name)
        assert "\n" not in str(error.value)
