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
from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, cooker, get_loader, get_train_dataset, stateless  # noqa: E402
from megatron.energon.cli.main import main as energon_cli  # noqa: E402
from megatron.energon import __version__ as energon_release  # noqa: E402
from neva_pack.formats.webdataset import ENERGON_VERSION  # noqa: E402

from neva_pack.files import paths  # noqa: E402
from neva_pack.formats import FORMATS, open_packed  # noqa: E402
from neva_pack.formats import WriteSpec  # noqa: E402
from neva_pack.core import InputError  # noqa: E402
from neva_pack.formats import IMAGES_MEMBER, Writer, dataset_path, decode, fetch_from, pack_index  # noqa: E402
from neva_pack.core import ImageRun  # noqa: E402
from neva_pack.sample_store import segment_name  # noqa: E402
from neva_pack.sample_store import PoolWriter, pool_segment  # noqa: E402
from neva_pack.commands import verify  # noqa: E402
from tests.formats.test_formats import BLUE, CLIP, PATCH, RED, SHAPE, START, pack, run_preprocess, tiny_meta, tiny_packs  # noqa: E402

ONE_WORKER = WorkerConfig(rank=0, world_size=1, num_workers=0)


def shared_packs(pool):
    """The tiny packs and a fourth using RED and BLUE again (each first used by an earlier pack)."""
    red, blue = pool.add(RED)[1], pool.add(BLUE)[1]
    return [*tiny_packs(pool), pack([[START, PATCH, 9], [START, PATCH, 3]], [[-1, 9, -1], [-1, 3, -1]], [[blue], [red]], records=[5, 6], multiple=1)]


def write_tiny_shards(directory, stop_after: int | None = None, resume: bool = False, packs_of=tiny_packs, shard_bytes: int = 1):
    """The tiny packs, one shard each (shard_bytes=1); ``stop_after``: killed after checkpointing that many."""
    store = paths.store_dir(directory)
    store.mkdir(parents=True, exist_ok=True)
    pool = PoolWriter(pool_segment(store, segment_name(0), 0), {}, 0)
    packs = packs_of(pool)
    spec = WriteSpec(image_shape=SHAPE, normalisation=CLIP, pad_id=0, ignore_index=-1, plan_digest="tiny",
                     pool=(pool_segment(store, segment_name(0), pool.close()),), image_run=ImageRun(positions=2, patch_id=PATCH, start_id=START))  # fmt: skip
    writer = Writer(paths.packed_prefix(directory), spec, resume=resume, shard_bytes=shard_bytes)
    for p in range(writer.num_packs, len(packs)):
        writer.add(packs[p])
        if stop_after is not None and p + 1 == stop_after:
            writer.checkpoint()
            return None
    from neva_pack.packing import PlanTable

    table = PlanTable(offsets=np.cumsum([0, *(len(p.lengths) for p in packs)]), record_index=np.concatenate([p.record_indices for p in packs]),
                      length=np.concatenate([p.lengths for p in packs]), padded_length=np.concatenate([p.padded_lengths for p in packs]),
                      num_images=np.concatenate([p.num_images for p in packs]))  # fmt: skip
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


@cooker(need_primary=True)
@stateless
def cook(raw, primary):
    """A raw sample and Energon's file store of its dataset -> its pack."""
    return {"pack": pack_index(raw), "read": decode(raw, fetch=fetch_from(primary))}


class CookedPacks(DefaultTaskEncoder):
    """The raw (crude) samples, cooked by ``decode``: the route for a dataset.yaml of its own."""

    cookers = [Cooker(cook)]

    @stateless
    def encode_sample(self, sample):
        return sample

    def batch(self, samples):
        return samples


@pytest.mark.parametrize("which", ["tiny", "shared"])
def test_decode_turns_energons_raw_samples_into_the_readers_packs(request, which):
    prefix = paths.packed_prefix(request.getfixturevalue(which))
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


def as_if_written_by(release: str, info: bytes) -> bytes:
    """``.info.json`` names the Energon release that wrote it (its ``info`` command only prints it): ours names
    the release we reproduce, so the installed one's name is swapped for it and every other byte must match."""
    return info.replace(f'"energon_version": "{energon_release}"'.encode(), f'"energon_version": "{release}"'.encode())


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
        assert (ours / name).read_bytes() == as_if_written_by(ENERGON_VERSION, (theirs / name).read_bytes()), name

    def index(path):
        db = sqlite3.connect(path)
        tables = {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall()) for t in ("samples", "sample_parts")}  # prepare's workers: any order
        schema = sorted(db.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall())
        db.close()
        return tables, schema

    assert index(ours / ".nv-meta/index.sqlite") == index(theirs / ".nv-meta/index.sqlite")


@pytest.mark.parametrize("which", ["tiny", "shared"])
def test_tars_are_byte_identical_between_runs_and_after_a_resume(request, which, tmp_path):
    """``shared`` stops with the shard open after pack 1: the resumed run still refers to the image pack 0 carries."""
    settings = {"packs_of": shared_packs, "shard_bytes": 1 << 30} if which == "shared" else {}
    write_tiny_shards(tmp_path / "again", **settings)
    assert write_tiny_shards(tmp_path / "resumed", stop_after=2, **settings) is None
    write_tiny_shards(tmp_path / "resumed", resume=True, **settings)
    ours = dataset_path(paths.packed_prefix(request.getfixturevalue(which)))
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


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Four packs in one shard, the fourth using the images the first and third carry."""
    out = tmp_path_factory.mktemp("shared")
    write_tiny_shards(out, packs_of=shared_packs, shard_bytes=1 << 30)
    return out


def stored_images(tar_path):
    """Every image stored in a shard (the rows of every images member), as bytes."""
    images = []
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if member.name.endswith("." + IMAGES_MEMBER):
                images.extend(row.tobytes() for row in np.load(io.BytesIO(data), allow_pickle=False))
            else:
                assert RED.tobytes() not in data and BLUE.tobytes() not in data, member.name
    return images


def test_an_image_used_by_two_packs_of_a_shard_is_stored_once_in_it(shared):
    (tar,) = dataset_path(paths.packed_prefix(shared)).glob("*.tar")
    assert sorted(stored_images(tar)) == sorted([RED.tobytes(), BLUE.tobytes()])
    reader = open_packed(shared)
    assert len(reader) == 4 and reader.pack(3).num_images == 2
    assert reader.pack(3).pixels.tobytes() == np.stack([BLUE, RED]).tobytes()
    assert verify(shared, progress=False).ok
    reader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_shared_images_read_through_energons_loaders_are_the_readers_packs(shared, workers):
    prefix = paths.packed_prefix(shared)
    reader = open_packed(prefix)
    dataset = get_train_dataset(str(dataset_path(prefix)), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers))  # fmt: skip
    seen = []
    for sample, _ in zip(get_loader(dataset), range(len(reader))):
        seen.append(sample.pack)
        assert_same_pack(sample, reader.pack(sample.pack), reader, sample.pack)
    assert sorted(seen) == list(range(len(reader)))
    reader.close()


def test_decode_asks_for_a_fetch_when_a_pack_uses_images_another_pack_carries(shared):
    reader = open_packed(shared)
    with pytest.raises(InputError, match="uses images of pack"):
        decode(reader.sample(3))
    assert decode(reader.sample(3), fetch=reader.member).pixels.tobytes() == np.stack([BLUE, RED]).tobytes()
    reader.close()


def test_the_registry_holds_it():
    assert FORMATS["energon"].needs_pixels and not FORMATS["energon"].uses_image_pool
