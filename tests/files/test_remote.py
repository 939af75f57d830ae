"""Mirroring a local directory to an s3:// prefix (a real S3-protocol server on loopback): the bucket
never vouches for bytes it does not hold. A completion marker goes after the files it marks; a marker
whose files are about to be replaced is deleted first; a marker that only grew (a store's progress
file after a commit, its segment's files being new names) is replaced in place, never absent; the
bucket is what a pull starts from, whatever the local disk held; errors blank every credential."""

import pytest

from neva_pack.files import mirror, pull, redacted, remote_listing
from tests.object_storage import BUCKET, SECRET, s3_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "staging") as server:
        yield server


def is_marker(name: str) -> bool:
    return name.endswith((".meta.json", "progress.json"))


@pytest.fixture
def requests(server, monkeypatch):
    """The client's batches of uploads and deletions, in order: (kind, the names of a batch sent at once;
    each batch still goes to the server, and completes before the next is sent)."""
    fs = server.fs()
    sent = []
    put, rm = fs.put, fs.rm

    def names(urls):
        return {url.rsplit("/", 1)[-1] for url in ([urls] if isinstance(urls, str) else urls)}

    monkeypatch.setattr(fs, "put", lambda local, urls, **kw: (sent.append(("put", names(urls))), put(local, urls, **kw))[1])
    monkeypatch.setattr(fs, "rm", lambda urls, **kw: (sent.append(("rm", names(urls))), rm(urls, **kw))[1])
    return sent


def test_markers_go_last_and_a_replaced_files_marker_is_deleted_first(server, requests, tmp_path):
    url = f"s3://{BUCKET}/mirror_a"
    local = tmp_path / "out"
    state = pull(url, local)
    (local / "store").mkdir()
    (local / "store" / "seg_0.bin").write_bytes(b"a" * 10)
    (local / "store" / "progress.json").write_text('{"segments": 1}')
    (local / "data.bin").write_bytes(b"packs")
    (local / "data.meta.json").write_text("{}")
    mirror(state, is_marker)
    assert requests == [("put", {"seg_0.bin", "data.bin"}), ("put", {"progress.json", "data.meta.json"})]

    requests.clear()  # a commit: a new segment, the progress file grows; it is never absent from the bucket
    (local / "store" / "seg_1.bin").write_bytes(b"b" * 10)
    (local / "store" / "progress.json").write_text('{"segments": 2}')
    mirror(state, is_marker, under="store")
    assert requests == [("put", {"seg_1.bin"}), ("put", {"progress.json"})]

    requests.clear()  # republished: the old meta goes before the packs it vouched for are replaced
    (local / "data.bin").write_bytes(b"other packs")
    (local / "data.meta.json").write_text('{"v": 2}')
    mirror(state, is_marker)
    assert requests == [("rm", {"data.meta.json"}), ("put", {"data.bin"}), ("put", {"data.meta.json"})]
    assert remote_listing(url) == {"data.bin": 11, "data.meta.json": 8, "store/progress.json": 15, "store/seg_0.bin": 10,
                                   "store/seg_1.bin": 10}  # fmt: skip


def test_files_gone_locally_are_deleted_and_their_marker_first(server, requests, tmp_path):
    url = f"s3://{BUCKET}/mirror_b"
    local = tmp_path / "out"
    state = pull(url, local)
    (local / "seg_0.bin").write_bytes(b"a")
    (local / "progress.json").write_text("{}")
    mirror(state, is_marker)
    requests.clear()
    for path in local.iterdir():  # --overwrite removed the old output
        path.unlink()
    mirror(state, is_marker)
    assert requests == [("rm", {"progress.json"}), ("rm", {"seg_0.bin"})]
    assert remote_listing(url) == {}


def test_a_pull_starts_from_the_bucket_not_from_what_the_disk_held(server, tmp_path):
    url = f"s3://{BUCKET}/mirror_c"
    server.fs().pipe(f"{BUCKET}/mirror_c/part/progress.json", b'{"committed": 3}')
    local = tmp_path / "staging"
    (local / "part").mkdir(parents=True)
    (local / "part" / "progress.json").write_text('{"committed": 4}')  # written after the bucket's last commit
    (local / "part" / "seg_3.bin").write_bytes(b"uncommitted")
    pull(url, local)
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == ["part/progress.json"]
    assert (local / "part" / "progress.json").read_text() == '{"committed": 3}'


def test_every_credential_of_the_environment_is_blanked(server):
    assert redacted(f"cannot list http://127.0.0.1:9/{SECRET}/x") == "cannot list http://127.0.0.1:9/***/x"
