"""Dynamic-resolution images in the energon format, read by the real megatron-energon.

A Qwen2-VL run written as energon and as compact holds the same packs: every sample Energon's
``get_train_dataset``/``get_loader`` yields is the compact output's pack (tokens, labels, sample
boundaries, image run lengths, and each StoredImage's size, tokens and uint8 parts bit for bit). The
output verifies, reads back through PackedSeqDataset with the processor its meta records, and
converts to compact and back with the same packs and the same tars. Images of two parts (LLaVA-NeXT)
and images shared between the packs of a shard survive a write, a stop and a resume.
"""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("megatron.energon")

from megatron.energon import WorkerConfig, get_loader, get_train_dataset  # noqa: E402

from neva_pack.files import paths  # noqa: E402
from neva_pack.assembly import AssembledPack  # noqa: E402
from neva_pack.cli import main  # noqa: E402
from neva_pack.reading import PackedSeqDataset  # noqa: E402
from neva_pack.core import ConfigError  # noqa: E402
from neva_pack.formats import FORMATS, check_dynamic_images, open_packed  # noqa: E402
from neva_pack.formats import WriteSpec  # noqa: E402
from neva_pack.formats import Writer, dataset_path  # noqa: E402
from neva_pack.formats import ImageTokenIds, PackedMeta  # noqa: E402
from neva_pack.core import ImageRun  # noqa: E402
from neva_pack.families import StoredImage  # noqa: E402
from neva_pack.families import processor_from_record  # noqa: E402
from neva_pack.packing import PlanTable  # noqa: E402
from neva_pack.commands import verify  # noqa: E402
from tests.pipeline.test_dynamic_pipeline import run as compact_run  # noqa: E402
from tests.pipeline.test_dynamic_pipeline import workload  # noqa: E402, F401 (the fixture)
from tests.formats.test_formats import CLIP, tiny_meta  # noqa: E402

ONE_WORKER = WorkerConfig(rank=0, world_size=1, num_workers=0)


def energon_run(workload, output_dir) -> int:
    """The run of test_dynamic_pipeline, written as energon."""
    args = ["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "img"),
            "--tokenizer_path", str(workload / "tok"), "--hf_vision_encoder", "Qwen/Qwen2-VL-7B-Instruct",
            "--conv_template", "qwen2_vl", "--output_format", "energon", "--max_seq_length", "256",
            "--max_pixels", "50176", "--output_dir", str(output_dir), "--num_workers", "0"]  # fmt: skip
    return main(args)


@pytest.fixture(scope="module")
def runs(workload, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("qwen_energon")
    assert energon_run(workload, out / "energon") == 0
    assert compact_run(workload, out / "compact", 0) == 0
    return out


def assert_same_images(got, expected, where):
    assert len(got) == len(expected), where
    for a, b in zip(got, expected):
        assert (a.size, a.tokens, len(a.parts)) == (b.size, b.tokens, len(b.parts)), where
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype == np.uint8 and x.shape == y.shape and x.tobytes() == y.tobytes(), where


def assert_same_pack(got, expected, where):
    for name in ("cu_seqlens", "cu_seqlens_unpadded", "tokens", "labels", "image_lengths"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(expected, name))
        assert a.shape == b.shape and np.array_equal(a, b), (where, name)
    assert got.num_images == expected.num_images and got.pixels is None, where
    assert_same_images(got.stored_images, expected.stored_images, where)


def tar_bytes(prefix):
    directory = dataset_path(prefix)
    return {path.relative_to(directory): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def test_energons_loader_yields_the_compact_outputs_packs_with_their_stored_images(runs):
    compact = open_packed(runs / "compact")
    prefix = paths.packed_prefix(runs / "energon")
    dataset = get_train_dataset(str(dataset_path(prefix)), batch_size=None, shuffle_buffer_size=None,
                                max_samples_per_sequence=None, worker_config=ONE_WORKER)  # fmt: skip
    assert len(dataset) == len(compact)
    loader = iter(get_loader(dataset))
    seen = []
    for _ in range(len(compact)):  # one epoch
        sample = next(loader)
        seen.append(sample.pack)
        assert_same_pack(sample, compact.pack(sample.pack), sample.pack)
    assert sorted(seen) == list(range(len(compact)))
    assert sum(len(compact.pack(p).stored_images) for p in range(len(compact))) == 7
    compact.close()


def test_it_verifies_and_reads_back_through_its_recorded_processor(runs):
    prefix = paths.packed_prefix(runs / "energon")
    assert verify(prefix, progress=False).ok
    reader, compact = open_packed(runs / "energon"), open_packed(runs / "compact")
    assert reader.meta.image_shape is None and reader.meta.image_processor == compact.meta.image_processor
    for p in range(len(reader)):
        assert_same_pack(reader.pack(p), compact.pack(p), p)
        assert reader.pack(p, images=False).stored_images is None
    with pytest.raises(ValueError, match="no one tensor shape"):
        reader.images(0)
    processor = processor_from_record(reader.meta.image_processor)
    ours, theirs = PackedSeqDataset(runs / "energon", processor=processor), PackedSeqDataset(runs / "compact", processor=processor)
    for p in range(len(reader)):
        a, b = ours[p], theirs[p]
        assert a.keys() == b.keys()
        for key in a:
            assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), (p, key)
    reader.close()
    compact.close()


def test_convert_to_compact_and_back_keeps_the_packs_and_the_tars(runs, tmp_path):
    assert main(["convert", str(runs / "energon"), str(tmp_path / "compact"), "--to", "compact", "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "compact"), str(tmp_path / "energon"), "--to", "energon", "--quiet"]) == 0
    assert main(["convert", str(runs / "compact"), str(tmp_path / "direct"), "--to", "energon", "--quiet"]) == 0
    for out in ("compact", "energon", "direct"):
        assert verify(paths.packed_prefix(tmp_path / out), progress=False).ok, out
    original, converted = open_packed(runs / "compact"), open_packed(tmp_path / "compact")
    for p in range(len(original)):
        assert_same_pack(converted.pack(p), original.pack(p), p)
    ours = tar_bytes(paths.packed_prefix(runs / "energon"))
    assert tar_bytes(paths.packed_prefix(tmp_path / "energon")) == ours
    assert tar_bytes(paths.packed_prefix(tmp_path / "direct")) == ours


def test_the_energon_format_holds_dynamic_images_and_nemo_still_refuses_them():
    assert FORMATS["energon"].holds_dynamic_images
    check_dynamic_images("energon", "Qwen/Qwen2-VL-7B-Instruct")
    with pytest.raises(ConfigError, match="use --output_format .*energon"):
        check_dynamic_images("nemo", "Qwen/Qwen2-VL-7B-Instruct")


# LLaVA-NeXT's images: two parts each (the base tile and the image in its grid resolution), runs of <image> only
IMAGE = 7
RUN = ImageRun(positions=None, patch_id=IMAGE)


def anyres_image(seed: int, tokens: int) -> StoredImage:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (3, 6, 6), dtype=np.uint8)
    grid = rng.integers(0, 256, (3, 12 + seed, 6), dtype=np.uint8)
    return StoredImage(size=(50 + seed, 40), parts=(base, grid), tokens=tokens)


A, B, C = anyres_image(0, 3), anyres_image(1, 2), anyres_image(2, 4)


def anyres_pack(samples):
    """An assembled pack of samples, each a list of text ids (int) and images, with their images."""
    tokens, labels, lengths, starts, runs, images, counts = [], [], [], [], [], [], []
    for parts in samples:
        counts.append(sum(isinstance(part, StoredImage) for part in parts))
        ids = []
        for part in parts:
            if isinstance(part, StoredImage):
                starts.append(len(tokens) + len(ids))
                runs.append(part.tokens)
                images.append(part)
                ids += [IMAGE] * part.tokens
            else:
                ids.append(part)
        tokens += ids
        labels += [-1 if after == IMAGE else after for after in ids[1:]] + [-1]  # the next text token is trained
        lengths.append(len(ids))
    tokens, labels = np.array(tokens, np.int32), np.array(labels, np.int32)
    lengths = np.array(lengths, np.int64)
    pack = AssembledPack(lengths=lengths, padded_lengths=lengths, tokens=tokens, labels=labels, record_indices=np.arange(len(samples)),
                         num_images=np.array(counts, np.int64), image_indices=np.arange(len(images)), pixels=None,
                         image_starts=np.array(starts, np.int64), image_lengths=np.array(runs, np.int64))  # fmt: skip
    return pack, images


ANYRES_PACKS = [
    anyres_pack([[11, A, B, 12], [13, 14]]),  # adjacent runs of <image> of two images
    anyres_pack([[15, 16]]),  # no image
    anyres_pack([[17, B, 18], [C, A, 19]]),  # B and A carried by pack 0 of the same shard
]


def anyres_meta(num_packs: int) -> PackedMeta:
    meta = tiny_meta(num_packs)
    return meta.replace(image_shape=None, image_positions=None, image_token_ids=ImageTokenIds(patch=IMAGE, start=None, end=None),
                        packing=dataclasses.replace(meta.packing, pad_to_multiple_of=1, max_seq_length=16), image_processor=RECORD)  # fmt: skip


RECORD = {"family": "anyres", "encoder": "hand"}
SPEC = WriteSpec(image_shape=None, normalisation=CLIP, pad_id=0, ignore_index=-1, plan_digest="anyres", pool=(), image_run=RUN,
                 image_processor=RECORD)  # fmt: skip


def write_anyres(directory, stop_after=None, resume=False):
    """The anyres packs in one shard; ``stop_after``: killed after checkpointing that many."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = Writer(paths.packed_prefix(directory), SPEC, resume=resume)
    for p in range(writer.num_packs, len(ANYRES_PACKS)):
        pack, images = ANYRES_PACKS[p]
        writer.add_prepared(FORMATS["energon"].prepare([pack], SPEC), [images])
        if stop_after is not None and p + 1 == stop_after:
            writer.checkpoint()
            return None
    packs = [pack for pack, _ in ANYRES_PACKS]
    table = PlanTable(offsets=np.cumsum([0, *(len(p.lengths) for p in packs)]), record_index=np.concatenate([p.record_indices for p in packs]),
                      length=np.concatenate([p.lengths for p in packs]), padded_length=np.concatenate([p.padded_lengths for p in packs]),
                      num_images=np.concatenate([p.num_images for p in packs]))  # fmt: skip
    return writer.publish(table, [], anyres_meta(len(packs)))


def test_two_part_images_shared_within_a_shard_come_back_exactly_through_energon_and_a_resume(tmp_path):
    write_anyres(tmp_path / "once")
    assert write_anyres(tmp_path / "resumed", stop_after=1) is None
    write_anyres(tmp_path / "resumed", resume=True)
    assert tar_bytes(paths.packed_prefix(tmp_path / "resumed")) == tar_bytes(paths.packed_prefix(tmp_path / "once"))
    assert verify(tmp_path / "once", progress=False).ok
    reader = open_packed(tmp_path / "once")
    for p, (pack, images) in enumerate(ANYRES_PACKS):
        read = reader.pack(p)
        assert read.tokens.tolist() == pack.tokens.tolist() and read.image_lengths.tolist() == pack.image_lengths.tolist()
        assert_same_images(read.stored_images, images, p)
    dataset = get_train_dataset(str(dataset_path(paths.packed_prefix(tmp_path / "once"))), batch_size=None, shuffle_buffer_size=None,
                                max_samples_per_sequence=None, worker_config=ONE_WORKER)  # fmt: skip
    loader = iter(get_loader(dataset))
    for _ in range(len(ANYRES_PACKS)):
        sample = next(loader)
        assert_same_pack(sample, reader.pack(sample.pack), sample.pack)
    reader.close()


def test_convert_finds_adjacent_runs_of_patch_ids_by_their_lengths(tmp_path):
    write_anyres(tmp_path / "energon")
    assert main(["convert", str(tmp_path / "energon"), str(tmp_path / "compact"), "--to", "compact", "--quiet"]) == 0
    energon, compact = open_packed(tmp_path / "energon"), open_packed(tmp_path / "compact")
    for p in range(len(energon)):
        assert_same_pack(compact.pack(p), energon.pack(p), p)
