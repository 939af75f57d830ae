"""--resume continues an output only with the settings it was started with: every setting that
changes the written bytes (the samples' settings, checked by the sample store, and the writing
settings: format, pad id, seed, algorithm, sizes, alignment, ...) is compared, finished prefix or
unfinished, and a difference is refused with one line naming the setting, touching nothing."""

import json
import shutil

import pytest

from neva_pack.assembly import parallel as parallel_assembly
from neva_pack.files import bin_path, meta_path, packed_prefix, paths, stats_path
from neva_pack.cli import main
from neva_pack.formats import compact, nemo
from tests.conftest import SAMPLE_DATA


class Killed(BaseException):
    """Stands for a kill -9 while the packs are written: nothing after it runs."""


def command(output_dir, *extra):
    return [
        "preprocess", "--data_path", str(SAMPLE_DATA / "llava_sample.json"), "--image_folder", str(SAMPLE_DATA / "images"),
        "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--output_dir", str(output_dir),
        "--conv_template", "v1", "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--max_seq_length", "512",
        "--packing_algorithm", "near_optimal", "--checkpoint_every", "10", "--pad_to_multiple_of", "8",
        "--num_workers", "0", "--quiet", *extra,
    ]  # fmt: skip


def files(output_dir):
    return {p.name: p.read_bytes() for p in sorted(output_dir.iterdir()) if p.is_file() and p.name != paths.STATS_FILE
            and not p.name.endswith(paths.META_SUFFIX)}  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "out"
    assert main(command(out)) == 0
    return out


@pytest.fixture(scope="module")
def killed_while_writing(tmp_path_factory):
    """An output killed after the writer's first checkpoint (every pack here), before publishing."""
    out = tmp_path_factory.mktemp("killed") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_assembly, "PACKS_PER_MESSAGE", 1)  # a checkpoint after every pack
        patch.setattr(nemo.Writer, "publish", lambda *args, **kwargs: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            main(command(out))
    assert paths.checkpoint_paths(paths.packed_prefix(out))[0].is_file()
    assert not paths.meta_path(paths.packed_prefix(out)).exists()
    return out


CHANGES = [
    (("--pad_id", "5"), "pad_id=0"),
    (("--output_format", "compact"), "output_format='nemo'"),
    (("--seed", "7"), "seed=0"),
    (("--packing_algorithm", "first_fit_decreasing"), "packing_algorithm='near_optimal'"),
    (("--pad_to_multiple_of", "16"), "pad_to_multiple_of=8"),
    (("--max_samples_per_pack", "2"), "max_samples_per_pack=None"),
    (("--balance_data_parallel", "2"), "balance_data_parallel=None"),
    (("--max_images_per_pack", "4"), "max_images_per_pack=None"),
    (("--max_image_tokens_per_pack", "3000"), "max_image_tokens_per_pack=None"),
    (("--global_batch_size", "64"), "global_batch_size=None"),
]


def replaced(args, flag, value):
    args = list(args)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    return args


@pytest.mark.parametrize("state", ["killed_while_writing", "finished"])
@pytest.mark.parametrize("change, named", CHANGES, ids=[c[0][0] for c in CHANGES])
def test_resume_with_another_writing_setting_is_refused_whether_unfinished_or_finished(
    request, state, tmp_path, capsys, change, named
):
    out = tmp_path / "out"
    shutil.copytree(request.getfixturevalue(state), out)
    before = files(out)
    capsys.readouterr()
    assert main(replaced(command(out, "--resume"), *change)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--resume: the output was started with {named}" in err, err
    assert files(out) == before  # nothing touched


def test_resume_with_the_same_settings_finishes_with_the_bytes_of_an_uninterrupted_run(killed_while_writing, finished, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(killed_while_writing, out)
    assert main(command(out, "--resume")) == 0
    assert files(out) == files(finished)
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert main(command(out, "--resume")) == 0  # finished, same settings: nothing to do
    assert files(out) == files(finished)


def test_a_resumed_multi_size_run_compares_each_size(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(command(out, "--pack_sizes", "256", "512")) == 0
    capsys.readouterr()
    assert main(command(out, "--pack_sizes", "256", "512", "--resume", "--pad_id", "3")) == 2
    assert "pad_id=0" in capsys.readouterr().err
    assert main(command(out, "--pack_sizes", "256", "512", "--resume")) == 0


def test_another_format_resumed_before_any_checkpoint_leaves_no_temporary_file(tmp_path):
    """Killed before the writer's first checkpoint, there is nothing to compare and nothing to
    continue: the other format's run starts the packs again, and no file of the first survives."""
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_assembly, "PACKS_PER_MESSAGE", 1)
        patch.setattr(nemo.Writer, "checkpoint", lambda self: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            main(command(out))
    assert bin_path(paths.tmp_prefix(paths.packed_prefix(out))).is_file()
    checkpoint, staging = paths.checkpoint_paths(paths.packed_prefix(out))
    assert not checkpoint.exists()
    staging.write_bytes(b"PK\x03\x04 a save cut short")
    assert main(command(out, "--resume", "--output_format", "compact")) == 0
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    reference = tmp_path / "reference"
    assert main(command(reference, "--output_format", "compact")) == 0
    assert files(out) == files(reference)


def test_an_unfinished_compact_output_resumed_as_nemo_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_assembly, "PACKS_PER_MESSAGE", 1)
        patch.setattr(compact.Writer, "publish", lambda *args, **kwargs: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            main(command(out, "--output_format", "compact"))
    before = files(out)
    capsys.readouterr()
    assert main(command(out, "--resume")) == 2
    assert "output_format='compact', this run has 'nemo'" in capsys.readouterr().err
    assert files(out) == before
    assert main(command(out, "--resume", "--output_format", "compact")) == 0
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


def test_every_writing_setting_is_read_back_from_a_finished_output(finished):
    """What a finished prefix is compared with comes from its meta (and stats file): each writing
    setting must be recorded there, or a change of it would go unnoticed."""
    from neva_pack.config import PreprocessConfig, meta_fields

    config = PreprocessConfig(data_path=str(SAMPLE_DATA / "llava_sample.json"), tokenizer_path=str(SAMPLE_DATA / "tokenizer.model"),
                              output_dir=str(finished))  # fmt: skip
    settings = config.write_settings(512)
    meta = json.loads(meta_path(packed_prefix(finished)).read_text())
    assert set(settings) == set(meta_fields()) | {"global_batch_size", "step_cost_model"}
    # the video-token budget is written only when set (a meta without it is the bytes of one made before it): unset reads None
    assert all(field in meta for field in meta_fields().values() if field != "max_video_tokens_per_pack")
    assert "max_video_tokens_per_pack" not in meta and settings["max_video_tokens_per_pack"] is None
    assert "global_batch_size" in json.loads(stats_path(finished).read_text())


def test_a_balanced_output_resumes_only_with_the_step_cost_model_it_was_ordered_by(tmp_path, capsys):
    """The stats file's balance report records --step_cost_model; an unbalanced output ignores it."""
    out = tmp_path / "out"
    assert main(command(out, "--balance_data_parallel", "2")) == 0
    before = files(out)
    capsys.readouterr()
    assert main(command(out, "--balance_data_parallel", "2", "--resume", "--step_cost_model", "attention")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--resume: the output was started with step_cost_model='auto'" in err, err
    assert main(command(out, "--balance_data_parallel", "2", "--resume")) == 0
    assert files(out) == before
