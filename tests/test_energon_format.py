"""The energon format read by the real megatron-energon: its loaders, ``energon info`` and ``energon prepare``.

Every pack Energon's ``get_train_dataset``/``get_loader`` yields is the pack our reader gives, bit for
bit, each exactly once per epoch; the ``.nv-meta/`` files are those Energon's own ``prepare`` makes of
our tars; two writes (one of them stopped and resumed) give the same bytes.
"""

import io
import shutil
import sqlite3
import tarfile

import numpy as np
import pytest

pytest.importorskip("megatron.energon")

from click.testing import CliRunner  # noqa: E402
from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset, stateless  # noqa: E402
from megatron.energon.cli.main import main as energon_cli  # noqa: E402

from neva_pack import paths  # noqa: E402
from neva_pack.formats import FORMATS, open_packed  # noqa: E402
from neva_pack.formats.base import WriteSpec  # noqa: E402
from neva_pack.formats.energon import IMAGES_MEMBER, Writer, dataset_path, decode, pack_index  # noqa: E402
from neva_pack.image_run import ImageRun  # noqa: E402
from neva_pack.sample_store.files import segment_name  # noqa: E402
from neva_pack.sample_store.image_pool import PoolWriter, pool_segment  # noqa: E402
from neva_pack.verify import verify  # noqa: E402
from tests.test_formats import CLIP, SHAPE, START, PATCH, run_preprocess, tiny_meta, tiny_packs  # noqa: E402

ONE_WORKER = WorkerConfig(rank=0, world_size=1, num_workers=0)


def write_tiny_shards(directory, stop_after: int | None = None, resume: bool = False):
    """The tiny packs, one shard each (shard_bytes=1); ``stop_after``: killed after checkpointing that many."""
    store = paths.store_dir(directory)
    store.mkdir(parents=True, exist_ok=True)
    pool = PoolWriter(pool_segment(store, segment_name(0), 0), {}, 0)
    packs = tiny_packs(pool)
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1, plan_digest="tiny",
                     pool=(pool_segment(store, segment_name(0), pool.close()),), image_run=ImageRun(positions=2, patch_id=PATCH, start_id=START))  # fmt: skip
    writer = Writer(paths.packed_prefix(directory), spec, resume=resume, shard_bytes=1)
    for p in range(writer.num_packs, len(packs)):
        writer.add(packs[p])
        if stop_after is not None and p + 1 == stop_after:
            writer.checkpoint()
            return None
    from neva_pack.plan_table import PlanTable

    table = PlanTable(offsets=np.array([0, 2, 3, 5]), record_index=np.array([3, 0, 1, 2, 4]), length=np.array([5, 3, 3, 3, 2]),
                      padded_length=np.array([5, 3, 3, 4, 4]), num_images=np.array([1, 1, 0, 1, 0]))  # fmt: skip
    return writer.publish(table, [], tiny_meta(len(packs)))


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("energon") / "out"
    run_preprocess(out, "energon")
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    write_tiny_shards(out)
    return out


def prefixes(out):
    from neva_pack.formats import resolve_prefixes

    return resolve_prefixes(out)


def assert_same_pack(got, expected, reader, p):
    for name in ("cu_seqlens", "cu_seqlens_unpadded", "tokens", "labels", "pixels"):
        a, b = np.asarray(getattr(got, name)), getattr(expected, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (p, name)
    assert got.num_images == expected.num_images
    normalised = reader.meta.normalisation.apply(got.pixels) if got.num_images else np.zeros((1, *reader.image_shape), np.float32)
    assert normalised.tobytes() == reader.images(p).numpy().tobytes()


@pytest.mark.parametrize("which", ["sample_run", "tiny"])
def test_every_pack_through_energons_loader_is_the_readers_pack_once_per_epoch(request, which):
    out = request.getfixturevalue(which)
    for prefix in prefixes(out):
        reader = open_packed(prefix)
        dataset = get_train_dataset(str(dataset_path(prefix)), batch_size=None, shuffle_buffer_size=None,
                                    max_samples_per_sequence=None, worker_config=ONE_WORKER)  # fmt: skip
        assert len(dataset) == len(reader)
        loader = iter(get_loader(dataset))
        seen = []
        for _ in range(len(reader)):  # one epoch
            sample = next(loader)
            seen.append(sample.pack)
            assert_same_pack(sample, reader.pack(sample.pack), reader, sample.pack)
        assert sorted(seen) == list(range(len(reader)))
        reader.close()


class CookedPacks(DefaultTaskEncoder):
    """The raw (crude) samples, cooked by ``decode``: the route for a dataset.yaml of its own."""

    cookers = [Cooker(stateless(lambda raw: {"pack": pack_index(raw), "read": decode(raw)}))]

    @stateless
    def encode_sample(self, sample):
        return sample

    def batch(self, samples):
        return samples


def test_decode_turns_energons_raw_samples_into_the_readers_packs(tiny):
    prefix = paths.packed_prefix(tiny)
    meta_dir = dataset_path(prefix) / ".nv-meta"
    (meta_dir / "crude.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    try:
        dataset = get_train_dataset(str(dataset_path(prefix)), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                    worker_config=ONE_WORKER, task_encoder=CookedPacks(), dataset_config="crude.yaml")  # fmt: skip
        reader = open_packed(prefix)
        loader = iter(get_loader(dataset))
        seen = []
        for _ in range(len(reader)):
            sample = next(loader)
            seen.append(sample["pack"])
            assert_same_pack(sample["read"], reader.pack(sample["pack"]), reader, sample["pack"])
        assert sorted(seen) == list(range(len(reader)))
        reader.close()
    finally:
        (meta_dir / "crude.yaml").unlink()


def test_energon_info_opens_it(sample_run):
    result = CliRunner().invoke(energon_cli, ["info", str(dataset_path(prefixes(sample_run)[0]))])
    assert result.exit_code == 0, result.output
    reader = open_packed(prefixes(sample_run)[0])
    assert f"({len(reader)} samples" in result.output and "PackSample" in result.output
    reader.close()


def test_the_nv_meta_is_what_energon_prepare_makes_of_the_tars(tiny, tmp_path):
    ours = dataset_path(paths.packed_prefix(tiny))
    tars = sorted(ours.glob("*.tar"))
    assert len(tars) == 3  # one pack per shard here
    theirs = tmp_path / "prepared"
    theirs.mkdir()
    for tar in tars:
        shutil.copy(tar, theirs)
    split = f"train:shard_{{000000..{len(tars) - 1:06d}}}.tar"
    result = CliRunner().invoke(energon_cli, ["prepare", str(theirs), "--non-interactive", "--split-parts", split,
                                              "--skip-dataset-yaml", "--no-progress"])  # fmt: skip
    assert result.exit_code == 0, result.output
    for name in [*(t.name + ".idx" for t in tars), ".nv-meta/split.yaml", ".nv-meta/.info.json"]:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name

    def index(path):
        db = sqlite3.connect(path)
        tables = {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall()) for t in ("samples", "sample_parts")}  # prepare's workers: any order
        schema = sorted(db.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall())
        db.close()
        return tables, schema

    assert index(ours / ".nv-meta/index.sqlite") == index(theirs / ".nv-meta/index.sqlite")


def test_tars_are_byte_identical_between_runs_and_after_a_resume(tiny, tmp_path):
    write_tiny_shards(tmp_path / "again")
    assert write_tiny_shards(tmp_path / "resumed", stop_after=2) is None
    write_tiny_shards(tmp_path / "resumed", resume=True)
    ours = dataset_path(paths.packed_prefix(tiny))
    files = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    for other in ("again", "resumed"):
        theirs = dataset_path(paths.packed_prefix(tmp_path / other))
        assert sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file()) == files
        for name in files:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), (other, name)
    assert verify(tmp_path / "resumed", progress=False).ok


def test_members_carry_no_time_owner_or_pax_record_and_keys_are_unique_across_shards(tiny):
    keys = []
    for tar in sorted(dataset_path(paths.packed_prefix(tiny)).glob("*.tar")):
        with tarfile.open(tar) as t:
            assert not t.pax_headers
            for member in t.getmembers():
                assert (member.mtime, member.uid, member.gid, member.uname, member.gname, member.mode) == (0, 0, 0, "", "", 0o644)
                assert member.type == tarfile.REGTYPE and not member.pax_headers
                keys.append(member.name.split(".", 1)[0])
    assert len(set(keys)) == 3 and keys == sorted(keys)


def test_an_image_used_twice_in_a_pack_is_stored_once(tiny):
    reader = open_packed(tiny)
    stored = np.load(io.BytesIO(reader.sample(0)[IMAGES_MEMBER]))
    assert reader.pack(0).num_images == 2 and len(stored) == 1
    reader.close()


def test_the_registry_holds_it():
    assert FORMATS["energon"].needs_pixels and not FORMATS["energon"].uses_image_pool
