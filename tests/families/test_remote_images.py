"""An s3:// image folder, a prefix or a .tar object on a real S3-protocol server (moto's, on loopback):
the same bytes as the local folder, the same names refused (absolute, climbing out with '..'), the
byte budget kept (never more fetched), a missing image a counted skip."""


import pytest

from neva_pack.families import ImageSource
from neva_pack.records import RecordError
from tests.conftest import SAMPLE_DATA
from tests.object_storage import BUCKET, s3_server

IMAGES = SAMPLE_DATA / "images"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("s3")
    with s3_server(scratch / "staging") as server:
        server.put_tree(IMAGES, f"{BUCKET}/images")
        server.put_tar(IMAGES, f"{BUCKET}/archives/images.tar", scratch)
        yield server


@pytest.mark.parametrize("where", ["images", "archives/images.tar"])
def test_an_s3_folder_reads_the_bytes_of_the_local_one(server, where):
    source, local = ImageSource(f"s3://{BUCKET}/{where}"), ImageSource(IMAGES)
    for name in ("coffee.jpg", "logo.png", "./rocket.jpg"):
        assert source.read(name) == local.read(name)
        with source.open(name) as remote_file, local.open(name) as local_file:
            assert remote_file.read(64) == local_file.read(64)  # a header read
    assert source.read("sub/../chelsea.jpg") == local.read("chelsea.jpg")


@pytest.mark.parametrize("where", ["images", "archives/images.tar"])
@pytest.mark.parametrize(("name", "reason"), [
    ("../secrets/key.jpg", "outside_image_folder"), ("/etc/passwd", "outside_image_folder"),
    ("images/../../x.jpg", "outside_image_folder"), ("no_such.jpg", "missing_image"),
])  # fmt: skip
def test_an_s3_folder_refuses_the_names_a_local_one_refuses(server, where, name, reason):
    source = ImageSource(f"s3://{BUCKET}/{where}", allow_outside=False)
    with pytest.raises(RecordError) as refused:
        source.read(name)
    assert refused.value.reason == reason
    local = ImageSource(IMAGES)
    with pytest.raises(RecordError) as local_refused:
        local.read(name)
    assert local_refused.value.reason == reason


@pytest.mark.parametrize("where", ["images", "archives/images.tar"])
def test_an_image_over_the_byte_budget_is_skipped_without_reading_more(server, where):
    size = (IMAGES / "coffee.jpg").stat().st_size
    source = ImageSource(f"s3://{BUCKET}/{where}", max_bytes=size - 1)
    for read in (source.read, source.open):
        with pytest.raises(RecordError) as refused:
            read("coffee.jpg")
        assert refused.value.reason == "image_too_large"
    assert ImageSource(f"s3://{BUCKET}/{where}", max_bytes=size).read("coffee.jpg") == (IMAGES / "coffee.jpg").read_bytes()


def test_a_worker_gets_the_source_by_pickle_and_reads_on_its_own(server):
    import pickle

    source = pickle.loads(pickle.dumps(ImageSource(f"s3://{BUCKET}/archives/images.tar")))
    assert source.read("logo.png") == (IMAGES / "logo.png").read_bytes()


def test_a_missing_prefix_or_archive_is_one_line_at_start(server):
    from neva_pack.core import ConfigError

    with pytest.raises(ConfigError, match=f"--image_folder s3://{BUCKET}/nothing_here: no such prefix or archive"):
        ImageSource(f"s3://{BUCKET}/nothing_here")
    server.fs().pipe(f"{BUCKET}/archives/not_a.tar", b"\x1f\x8b" + bytes(600))
    with pytest.raises(ConfigError, match="gzip-compressed file"):
        ImageSource(f"s3://{BUCKET}/archives/not_a.tar")
