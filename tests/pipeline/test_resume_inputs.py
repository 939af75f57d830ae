"""--resume covers every input by content, and an input that changes while a run reads it is caught
before anything is published.

Every input a sample depends on -- the image folder or tar, the template file, the tokenizer
directory, the encoder's settings directory (the data file: tests/pipeline/test_resume_by_content.py)
-- changed between a run stopped before publishing and its resume is refused in one line naming the
flag, and nothing is published; unchanged, the resume gives the uninterrupted bytes. A data file or
template edited while the run reads it stops the run before it publishes, in one line naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

import neva_pack.pipeline
from neva_pack.cli import main
from neva_pack.files import bin_path, idx_path, paths
from neva_pack.sample_store import PROGRESS_FILE
from tests.conftest import ROOT, SAMPLE_DATA

RECORDS = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())[:14]
"""Records with images (one of them two), and none without."""
ENCODER = "openai/clip-vit-large-patch14-336"


def make_tar(images: Path, tar: Path) -> Path:
    with tarfile.open(tar, "w") as archive:
        for path in sorted(images.iterdir()):
            archive.add(path, arcname=path.name)
    return tar


@pytest.fixture()
def inputs(tmp_path, hf_tokenizer_dir) -> dict[str, Path]:
    """Writable local copies of every input: records, an image folder and a tar of it, a template
    file, a tokenizer directory and an encoder settings directory."""
    root = tmp_path / "inputs"
    root.mkdir()
    (root / "records.json").write_text(json.dumps(RECORDS))
    shutil.copytree(SAMPLE_DATA / "images", root / "images")
    make_tar(root / "images", root / "images.tar")
    shutil.copy(ROOT / "templates" / "chatml.yaml", root / "template.yaml")
    shutil.copytree(hf_tokenizer_dir, root / "tokenizer")
    from neva_pack.families import resolve_encoder

    (root / "encoder").mkdir()
    (root / "encoder" / "preprocessor_config.json").write_text(json.dumps(resolve_encoder(ENCODER).preprocessor_config))
    return {name: root / name for name in ("records.json", "images", "images.tar", "template.yaml", "tokenizer", "encoder")}


def command(inputs: dict[str, Path], out: Path, *extra, image_folder: str = "images.tar") -> list[str]:
    return [
        "preprocess", "--data_path", str(inputs["records.json"]), "--image_folder", str(inputs[image_folder]),
        "--tokenizer_path", str(inputs["tokenizer"]), "--conv_template", str(inputs["template.yaml"]),
        "--hf_vision_encoder", str(inputs["encoder"]), "--patch_dim", "14", "--tokenization", "llava", "--output_dir", str(out), "--max_seq_length", "2048",
        "--seed", "3", "--checkpoint_every", "4", "--num_workers", "0", "--quiet", *extra,
    ]  # fmt: skip


def killed_before_publishing(out: Path) -> None:
    paths.meta_path(paths.packed_prefix(out)).unlink()


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def rebuild_tar_with_an_image_replaced(inputs) -> None:
    """coffee.jpg now holds another picture's bytes, and the archive is made again."""
    shutil.copy(inputs["images"] / "chelsea.jpg", inputs["images"] / "coffee.jpg")
    make_tar(inputs["images"], inputs["images.tar"])


def replace_an_image_file(inputs) -> None:
    shutil.copy(inputs["images"] / "chelsea.jpg", inputs["images"] / "coffee.jpg")


def edit_the_template(inputs) -> None:
    path = inputs["template.yaml"]
    path.write_text(path.read_text().replace('system: "', 'system: "Be terse. ', 1))


def edit_the_tokenizer_directory(inputs) -> None:
    path = inputs["tokenizer"] / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "bos_token": "<|im_start|>"}))  # <unk> is the image run's id 0 here


def edit_the_encoder_settings(inputs) -> None:
    path = inputs["encoder"] / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "image_mean": [0.5, 0.5, 0.5]}))


CHANGES = {
    "tar rebuilt": (rebuild_tar_with_an_image_replaced, "--image_folder", "images.tar"),
    "image file replaced": (replace_an_image_file, "--image_folder", "images"),
    "template edited": (edit_the_template, "--conv_template", "images.tar"),
    "tokenizer directory edited": (edit_the_tokenizer_directory, "--tokenizer_path", "images.tar"),
    "encoder settings edited": (edit_the_encoder_settings, "--hf_vision_encoder", "images.tar"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_input_changed_before_a_resume_is_refused_naming_it(inputs, tmp_path, capsys, change):
    edit, flag, folder = CHANGES[change]
    out = tmp_path / "out"
    assert main(command(inputs, out, image_folder=folder)) == 0
    killed_before_publishing(out)
    edit(inputs)
    capsys.readouterr()
    assert main(command(inputs, out, "--resume", image_folder=folder)) == 2
    err = one_line(capsys)
    assert flag in err and "--overwrite" in err, err
    assert not paths.meta_path(paths.packed_prefix(out)).exists()  # nothing published, nothing mixed


def test_unchanged_inputs_resume_to_the_uninterrupted_bytes(inputs, tmp_path):
    out = tmp_path / "out"
    assert main(command(inputs, out)) == 0
    published = bin_path(paths.packed_prefix(out)).read_bytes()
    killed_before_publishing(out)
    for name in ("template.yaml", "tokenizer", "encoder", "images"):  # touched: the same content
        os.utime(inputs[name])
    make_tar(inputs["images"], inputs["images.tar"])  # made again from the same files: the same archive
    assert main(command(inputs, out, "--resume")) == 0
    assert bin_path(paths.packed_prefix(out)).read_bytes() == published


def test_a_store_written_before_the_inputs_were_recorded_resumes_as_it_did(inputs, tmp_path):
    out = tmp_path / "out"
    assert main(command(inputs, out)) == 0
    published = bin_path(paths.packed_prefix(out)).read_bytes()
    killed_before_publishing(out)
    progress_file = paths.store_dir(out) / PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    del progress["inputs"]
    progress_file.write_text(json.dumps(progress))
    assert main(command(inputs, out, "--resume")) == 0
    assert bin_path(paths.packed_prefix(out)).read_bytes() == published


def flip_a_letter(path: Path) -> None:
    """An edit in place: same size, the mtime put back."""
    before = os.stat(path)
    raw = bytearray(path.read_bytes())
    at = next(k for k in range(len(raw) // 2, len(raw)) if chr(raw[k]).isalpha())
    raw[at] ^= 0x20
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


DURING = {
    "--data_path": lambda inputs: flip_a_letter(inputs["records.json"]),
    "--conv_template": edit_the_template,
    "--image_folder": rebuild_tar_with_an_image_replaced,
}


@pytest.mark.parametrize("flag", sorted(DURING))
def test_an_input_changed_while_the_run_reads_it_is_caught_before_publishing(inputs, tmp_path, capsys, monkeypatch, flag):
    packed = neva_pack.pipeline.pack_kept

    def edited_while_packing(*args, **kwargs):  # after every record was read, before anything is published
        DURING[flag](inputs)
        return packed(*args, **kwargs)

    monkeypatch.setattr(neva_pack.pipeline, "pack_kept", edited_while_packing)
    out = tmp_path / "out"
    assert main(command(inputs, out)) == 2
    err = one_line(capsys)
    assert f"error: {flag} " in err and "changed while the run read it" in err and "not published" in err, err
    assert not paths.meta_path(paths.packed_prefix(out)).exists()
    monkeypatch.undo()
    assert main(command(inputs, out, "--resume")) == 2  # the store holds the old content: refused as well
    assert flag in one_line(capsys)


def test_a_shard_encoded_from_another_tar_is_refused_by_the_final_step(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(command(inputs, out, "--num_shards", "2", "--shard_index", "0")) == 0
    rebuild_tar_with_an_image_replaced(inputs)
    assert main(command(inputs, out, "--num_shards", "2", "--shard_index", "1")) == 0
    capsys.readouterr()
    assert main(command(inputs, out, "--num_shards", "2")) == 2
    err = one_line(capsys)
    assert "image_folder differs" in err and "part_00000" in err, err
    assert not paths.meta_path(paths.packed_prefix(out)).exists()


@pytest.mark.parametrize("shards", [None, 2])
def test_an_output_inside_the_image_folder_is_not_an_input_that_changed(inputs, tmp_path, shards):
    """Users keep outputs beside their images (--image_folder data/ --output_dir data/packed): what the run
    writes there is not its input, so neither the check before publish nor a shard's recorded image
    folder sees it change; the bytes are the run's with the output elsewhere."""
    inside = inputs["images"] / "packed"
    elsewhere = tmp_path / "elsewhere"
    for out in (inside, elsewhere):
        flags = command(inputs, out, image_folder="images")
        if shards is None:
            assert main(flags) == 0
        else:
            for index in range(shards):
                assert main([*flags, "--num_shards", str(shards), "--shard_index", str(index)]) == 0
            assert main([*flags, "--num_shards", str(shards)]) == 0
    for file_of in (bin_path, idx_path):
        assert file_of(paths.packed_prefix(inside)).read_bytes() == file_of(paths.packed_prefix(elsewhere)).read_bytes()
