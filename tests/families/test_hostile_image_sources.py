"""Hostile image sources: images are confined to --image_folder (a name, a symbolic link, a tar
member's name or link leading out is skipped unless allowed), a link loop or a sparse member is an
unreadable image, a truncated tar is one line saying so. The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

from neva_pack.files import skipped_path
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import GOOD, HOSTILE_AT, image_record, images, png_bytes, run_on, run_with, write_data  # noqa: F401 (images: the fixture)


def test_images_outside_the_folder_are_skipped_unless_allowed(tmp_path, capsys, images):
    (tmp_path / "x.png").write_bytes(png_bytes(8, 8))
    (images / "link.png").symlink_to(tmp_path / "x.png")
    names = ["../x.png", str(tmp_path / "x.png"), "link.png", "sub/../../x.png"]
    records = GOOD + [image_record(name) for name in names]
    data = write_data(tmp_path / "data.jsonl", records, "jsonl")
    run = run_on(tmp_path, capsys, data, images, "--max_skip_fraction", "1")
    assert run.code == 0 and run.reasons == {3: "outside_image_folder", 4: "outside_image_folder",
                                             5: "outside_image_folder", 6: "outside_image_folder"}  # fmt: skip
    assert run.verified
    shutil.rmtree(run.out)
    allowed = run_on(tmp_path, capsys, data, images, "--allow_outside_image_folder")
    assert allowed.code == 0 and allowed.reasons == {}
    assert allowed.verified


def test_a_relative_name_inside_the_folder_with_dots_is_fine(tmp_path, capsys, images):
    (images / "sub").mkdir()
    run = run_with(tmp_path, capsys, images, image_record("sub/../chelsea.jpg"))
    assert run.code == 0 and run.reasons == {}


def test_a_symlink_loop_is_an_unreadable_image_not_a_crash(tmp_path, capsys, images):
    (images / "loop.jpg").symlink_to("loop.jpg")
    run = run_with(tmp_path, capsys, images, image_record("loop.jpg"))
    assert run.code == 0 and run.reasons == {HOSTILE_AT: "unreadable_image"}
    assert "cannot be resolved" in json.loads(skipped_path(run.out).read_text())["detail"]
    assert run.verified


def image_tar(path: Path, images: Path, extra) -> Path:
    """chelsea.jpg as a regular member, then whatever ``extra(tar)`` adds."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(images / "chelsea.jpg", arcname="chelsea.jpg")
        extra(tar)
    return path


def test_a_tar_reads_hard_and_symbolic_links_as_the_folder_it_unpacks_to(tmp_path, capsys, images):
    import tarfile

    def links(tar):
        for name, kind, target in (("copy.jpg", tarfile.LNKTYPE, "chelsea.jpg"), ("sub/alias.jpg", tarfile.SYMTYPE, "../chelsea.jpg"),
                                   ("chain.jpg", tarfile.SYMTYPE, "sub/alias.jpg"), ("loop.jpg", tarfile.SYMTYPE, "loop.jpg"),
                                   ("out.jpg", tarfile.SYMTYPE, "../chelsea.jpg")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)

    archive = image_tar(tmp_path / "links.tar", images, links)
    names = ["copy.jpg", "sub/alias.jpg", "chain.jpg", "loop.jpg", "out.jpg"]
    data = write_data(tmp_path / "data.jsonl", GOOD[:1] + [image_record(name) for name in names], "jsonl")
    run = run_on(tmp_path, capsys, data, archive, "--max_skip_fraction", "1")
    # the three links to chelsea.jpg read its bytes; a looping or escaping link is no member
    assert run.code == 0 and run.reasons == {4: "missing_image", 5: "missing_image"}
    assert run.verified


def test_a_tar_names_outside_and_sparse_members_as_a_folder_would(tmp_path, capsys, images):
    import tarfile

    data_bytes = (images / "chelsea.jpg").read_bytes()

    def odd_members(tar):
        for name in ("../up.jpg", "/abs.jpg"):
            info = tarfile.TarInfo(name)
            info.size = len(data_bytes)
            tar.addfile(info, io.BytesIO(data_bytes))

    archive = image_tar(tmp_path / "odd.tar", images, odd_members)
    names = ["../up.jpg", "/abs.jpg", "x/../../up.jpg"]
    data = write_data(tmp_path / "data.jsonl", GOOD[:1] + [image_record(name) for name in names], "jsonl")
    run = run_on(tmp_path, capsys, data, archive, "--max_skip_fraction", "1")
    assert run.code == 0 and run.reasons == dict.fromkeys((1, 2, 3), "outside_image_folder")
    shutil.rmtree(run.out)
    allowed = run_on(tmp_path, capsys, data, archive, "--allow_outside_image_folder")
    assert allowed.code == 0 and allowed.reasons == {}
    shutil.rmtree(allowed.out)

    if shutil.which("tar") is None:
        return
    folder = tmp_path / "sparse"
    folder.mkdir()
    shutil.copyfile(images / "chelsea.jpg", folder / "chelsea.jpg")
    with open(folder / "holes.jpg", "wb") as f:
        f.write(data_bytes)
        f.truncate(8 << 20)  # a long hole: GNU tar --sparse stores only the data
    sparse = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(sparse), "-C", str(folder), "chelsea.jpg", "holes.jpg"], check=True)
    run = run_on(tmp_path, capsys, write_data(tmp_path / "s.jsonl", GOOD[:1] + [image_record("holes.jpg"), GOOD[1]], "jsonl"),
                 sparse, "--max_skip_fraction", "1")  # fmt: skip
    assert run.code == 0 and run.reasons == {1: "unreadable_image"}  # skipped, the archive itself is sound
    assert "sparse" in json.loads(skipped_path(run.out).read_text())["detail"]


def test_a_truncated_tar_is_reported_as_truncated(tmp_path, capsys):
    import tarfile

    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(SAMPLE_DATA / "images" / "chelsea.jpg", arcname="chelsea.jpg")
        tar.add(SAMPLE_DATA / "images" / "coffee.jpg", arcname="coffee.jpg")
    archive.write_bytes(archive.read_bytes()[:40_000])  # cut inside coffee.jpg
    run = run_with(tmp_path, capsys, archive, GOOD[0])
    assert run.code == 2 and "truncated" in run.err and "compressed" not in run.err
