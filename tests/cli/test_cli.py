"""The command line: NeMo's flags and defaults, fast --help, thin wrapper script."""

import json
import os
import subprocess
import sys

import pytest

from neva_pack.cli import main, preprocess_parser
from neva_pack.packing import ALGORITHMS
from neva_pack.files import bin_path, packed_prefix, skipped_path
from tests.conftest import ROOT

NEMO_FLAGS = [
    "--data_path", "--image_folder", "--tokenizer_path", "--output_dir", "--max_seq_length", "--packing_algorithm",
    "--hf_vision_encoder", "--conv_template", "--image_aspect_ratio", "--seed", "--hparams_file",
]  # fmt: skip


def test_every_nemo_flag_is_accepted(capsys):
    with pytest.raises(SystemExit):
        main(["preprocess", "--help"])
    listed = capsys.readouterr().out
    assert all(flag in listed for flag in NEMO_FLAGS)
    assert preprocess_parser().format_help().split("options:")[1] == listed.split("options:")[1]


def test_algorithm_choices_come_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        main(["preprocess", "--packing_algorithm", "no_such_algorithm"])
    err = capsys.readouterr().err
    assert "invalid choice: 'no_such_algorithm'" in err
    assert all(repr(name) in err for name in ALGORITHMS)


@pytest.mark.parametrize(
    "argv, prog, says",
    [
        (["preprocess", "--output_format=compat"], "neva-pack preprocess", "argument --output_format: invalid choice: 'compat'"),
        (["preprocess", "--max_seq_length", "many"], "neva-pack preprocess", "argument --max_seq_length: invalid int value"),
        (["plan", "out"], "neva-pack plan", "the following arguments are required: --pack_sizes"),
        (["convert", "a", "b", "--to", "nemo2"], "neva-pack convert", "argument --to: invalid choice: 'nemo2'"),
        (["bogus"], "neva-pack", "invalid choice: 'bogus'"),
        ([], "neva-pack", "the following arguments are required: command"),
    ],
)  # fmt: skip
def test_an_argument_error_is_one_line_with_exit_code_2(capsys, argv, prog, says):
    """docs/bad_input.md: bad arguments fail with one line and exit code 2, not argparse's whole usage."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and "usage:" not in captured.err
    assert captured.err.startswith(f"{prog}: error: ") and says in captured.err
    assert captured.err.rstrip().endswith(f"see {prog} --help")


def test_the_nemo_wrapper_script_errors_in_one_line_too():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_dataset.py"), "--output_format=compat"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "invalid choice: 'compat'" in result.stderr


def test_help_does_not_import_torch_megatron_or_transformers():
    code = (
        "import sys; from neva_pack.cli import build_parser; build_parser().format_help(); "
        "print([m for m in ('torch', 'megatron', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_missing_required_flag_is_one_line(capsys):
    assert main(["preprocess", "--data_path", str(ROOT / "sample_data" / "llava_sample.json")]) == 2
    err = capsys.readouterr().err
    assert err == "neva-pack: error: --tokenizer_path is required\n"


def test_a_run_where_every_record_is_skipped_fails_clearly(sample_dataset, tmp_path, capsys):
    data = sample_dataset["root"] / "bad.jsonl"
    data.write_text(json.dumps({"conversations": []}) + "\n")
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path",
                 str(sample_dataset["tokenizer_path"]), "--output_dir", str(tmp_path / "o"), "--num_workers", "0",
                 "--max_skip_fraction", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "none of the 1 record(s)" in err
    assert json.loads(skipped_path(tmp_path / "o").read_text())["reason"] == "empty_conversation"
    assert not bin_path(packed_prefix(tmp_path / "o")).exists()


@pytest.mark.slow
def test_wrapper_script_runs_as_nemo_users_call_it(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "preprocess_dataset.py"), f"--data_path={ROOT}/sample_data/llava_sample.json",
         f"--image_folder={ROOT}/sample_data/images", f"--tokenizer_path={ROOT}/sample_data/tokenizer.model",
         f"--output_dir={tmp_path}/out", "--max_seq_length=4096", "--packing_algorithm=first_fit_shuffle",
         "--hf_vision_encoder=openai/clip-vit-large-patch14-336", "--conv_template=v1", "--image_aspect_ratio=pad",
         "--seed=42"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "model.data.data_prefix=" in result.stdout


def test_a_parquet_data_path_is_refused_before_any_work(sample_dataset, tmp_path, capsys):
    data = tmp_path / "llava.parquet"
    data.write_bytes(b"PAR1" + bytes(200))
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path",
                 str(sample_dataset["tokenizer_path"]), "--output_dir", str(tmp_path / "o"), "--num_workers", "0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"neva-pack: error: --data_path {data}: a Parquet file, not JSON or JSONL")
    assert not any((tmp_path / "o").rglob("*"))  # nothing written
