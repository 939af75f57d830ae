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
    """The client's uploads and deletions, in order (each still sent to the server)."""
    fs = server.fs()
    sent = []
    put, rm = fs.put_file, fs.rm
    monkeypatch.setattr(fs, "put_file", lambda local, url, **kw: (sent.append(("put", url.rsplit("/", 1)[-1])), put(local, url, **kw))[1])
    monkeypatch.setattr(fs, "rm", lambda urls, **kw: (sent.extend(("rm", u.rsplit("/", 1)[-1]) for u in urls), rm(urls, **kw))[1])
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
    assert requests[-2:] in ([("put", "progress.json"), ("put", "data.meta.json")], [("put", "data.meta.json"), ("put", "progress.json")])
    assert {name for kind, name in requests[:2]} == {"seg_0.bin", "data.bin"}

    requests.clear()  # a commit: a new segment, the progress file grows; it is never absent from the bucket
    (local / "store" / "seg_1.bin").write_bytes(b"b" * 10)
    (local / "store" / "progress.json").write_text('{"segments": 2}')
    mirror(state, is_marker, under="store")
    assert requests == [("put", "seg_1.bin"), ("put", "progress.json")]

    requests.clear()  # republished: the old meta goes before the packs it vouched for are replaced
    (local / "data.bin").write_bytes(b"other packs")
    (local / "data.meta.json").write_text('{"v": 2}')
    mirror(state, is_marker)
    assert requests[0] == ("rm", "data.meta.json") and requests[-1] == ("put", "data.meta.json")
    assert requests.index(("put", "data.bin")) < len(requests) - 1


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
    assert requests[0] == ("rm", "progress.json")
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
