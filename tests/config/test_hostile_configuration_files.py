"""Every configuration file the tool reads (template, hparams, encoder settings and model config,
tokenizer) is untrusted: a bad one, a device or a FIFO is one line naming the file (and the key),
and a randomly edited one runs or is one line. The harness: tests/hostile_inputs.py."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.files import skipped_path
from tests.conftest import SAMPLE_DATA
from tests.hostile_inputs import GOOD, TOKENIZER, Captured, Run, images, run_on, write_data  # noqa: F401 (images: the fixture)


TEMPLATE_YAML = """\
name: vicuna
system: "A chat."
system_suffix: " "
system_when_empty: true
user:
  prefix: "USER: "
  suffix: " "
assistant:
  prefix: "ASSISTANT:"
  lead: " "
  suffix: "{eos}"
nemo:
  round_separator: " "
"""
HPARAMS_YAML = """\
model:
  encoder_seq_length: 4096
  mm_cfg:
    use_im_start_end: false
    vision_encoder:
      patch_dim: 14
      crop_size: [336, 336]
  data:
    image_aspect_ratio: square
"""


def settings_files(folder: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """One of each configuration file the tool reads, valid, and the flags that make a run read it."""
    from neva_pack.families import resolve_encoder

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "template.yaml").write_text(TEMPLATE_YAML)
    (folder / "hparams.yaml").write_text(HPARAMS_YAML)
    encoder = folder / "encoder"
    encoder.mkdir(exist_ok=True)
    settings_ = resolve_encoder("openai/clip-vit-large-patch14-336").preprocessor_config
    (encoder / "preprocessor_config.json").write_text(json.dumps(settings_, indent=1))
    (encoder / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14}}))
    shutil.copy(TOKENIZER, folder / "tokenizer.model")
    return {
        "template": (folder / "template.yaml", ("--conv_template", str(folder / "template.yaml"))),
        "hparams": (folder / "hparams.yaml", ("--hparams_file", str(folder / "hparams.yaml"))),
        "encoder settings": (encoder / "preprocessor_config.json", ("--hf_vision_encoder", str(encoder))),
        "encoder model config": (encoder / "config.json", ("--hf_vision_encoder", str(encoder))),
        "tokenizer": (folder / "tokenizer.model", ("--tokenizer_path", str(folder / "tokenizer.model"))),
    }


def run_configured(tmp_path, capsys, images, flags) -> Run:
    data = write_data(tmp_path / "data.jsonl", GOOD, "jsonl")
    return run_on(tmp_path, capsys, data, images, *flags)


def one_line(run: Run) -> bool:
    return run.err.count("\n") == 1 and run.err.startswith("neva-pack: error: ") and "Traceback" not in run.err


BAD_SETTINGS = {
    "template YAML that does not parse": ("template", lambda p: p.write_text("user: [\n"),
                                          "template.yaml: invalid YAML (expected the node content, but found '<stream end>' at line 2, column 1)"),
    "template not UTF-8": ("template", lambda p: p.write_bytes(b"name: caf\xe9\n"),
                           "template.yaml: not UTF-8 text (byte 0xe9 at offset 9)"),
    "template flag spelled as text": ("template", lambda p: p.write_text(TEMPLATE_YAML + "bos: 'yes'\n"),
                                      "template.yaml: bos 'yes': expected true or false, got str"),
    "template text with a lone surrogate": ("template", lambda p: p.write_text(TEMPLATE_YAML + 'system_prefix: "\\ud800"\n'),
                                            "template.yaml: system_prefix '\\ud800': holds a lone UTF-16 surrogate"),
    "template is a directory": ("template", lambda p: (p.unlink(), p.mkdir()), "template.yaml: not a regular file (a directory)"),
    "hparams not UTF-8": ("hparams", lambda p: p.write_bytes(b"model:\n  seed: \xff\n"),
                          "hparams.yaml: not UTF-8 text (byte 0xff at offset 15)"),
    "hparams gzip-compressed": ("hparams", lambda p: p.write_bytes(__import__("gzip").compress(HPARAMS_YAML.encode())),
                                "hparams.yaml: gzip-compressed, not text"),
    "crop_size a string": ("encoder settings",
                           lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "crop_size": "336"})),
                           "preprocessor_config.json: crop_size '336': expected a positive integer or an object"),
    "image_std zero": ("encoder settings",
                       lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "image_std": [0.5, 0, 0.5]})),
                       "preprocessor_config.json: image_std [0.5, 0, 0.5]: expected a list of 3 numbers from 0.001 to 1000"),
    "image_mean a number": ("encoder settings",
                            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "image_mean": 0.5})),
                            "preprocessor_config.json: image_mean 0.5: expected a list of 3 numbers from 0 to 1 (one per RGB channel"),
    "settings a JSON list": ("encoder settings", lambda p: p.write_text("[1, 2]"),
                             "preprocessor_config.json: expected a JSON object, got list"),
    "settings not JSON": ("encoder settings", lambda p: p.write_text("{'crop_size': 336}"),
                          "preprocessor_config.json: invalid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    "patch size a string": ("encoder model config", lambda p: p.write_text('{"vision_config": {"patch_size": "14"}}'),
                            "config.json: vision_config.patch_size '14': expected a positive integer"),
    "no crop and no resize to a box": ("encoder settings",
                                       lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "do_center_crop": False})),
                                       "preprocessor_config.json: do_center_crop/do_resize/size give images of varying shape"),
    "template integer of 5,000 digits": ("template", lambda p: p.write_text(TEMPLATE_YAML + "bos: " + "9" * 5000 + "\n"),
                                         "template.yaml: invalid YAML (Exceeds the limit (4300 digits) for integer string conversion"),
    "hparams date of a 13th month": ("hparams", lambda p: p.write_text(HPARAMS_YAML + "  seed: 2001-13-45\n"),
                                     "hparams.yaml: invalid YAML (month must be in 1..12)"),
    "settings integer of 5,000 digits": ("encoder settings", lambda p: p.write_text(p.read_text().rstrip()[:-1] + ', "x": ' + "9" * 5000 + "}"),
                                         "preprocessor_config.json: invalid JSON (Exceeds the limit (4300 digits)"),
    "tokenizer piece not UTF-8": ("tokenizer", lambda p: p.write_bytes(p.read_bytes().replace(b"<unk>", b"\x80unk>", 1)),
                                  "tokenizer.model: not a SentencePiece model"),
    "tokenizer a FIFO": ("tokenizer", lambda p: (p.unlink(), os.mkfifo(p)), "tokenizer.model: not a regular file (a FIFO)"),
    "tokenizer truncated": ("tokenizer", lambda p: p.write_bytes(p.read_bytes()[:1000]), "tokenizer.model: not a SentencePiece model"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_a_bad_configuration_file_is_one_line_naming_it(tmp_path, capsys, images, case):
    kind, damage, says = BAD_SETTINGS[case]
    path, flags = settings_files(tmp_path / "settings")[kind]
    damage(path)
    run = run_configured(tmp_path, capsys, images, flags)
    assert run.code == 2 and one_line(run), run.err
    assert says in run.err
    assert not skipped_path(run.out).exists()


@pytest.mark.parametrize("flag", ["--hparams_file", "--tokenizer_path", "--conv_template"])
def test_dev_zero_as_a_configuration_file_is_refused_before_reading(tmp_path, capsys, images, flag):
    value = "/dev/zero" if flag != "--conv_template" else str(tmp_path / "zero.yaml")
    if flag == "--conv_template":
        os.symlink("/dev/zero", value)  # a template is known by its suffix
    run = run_configured(tmp_path, capsys, images, (flag, value))
    assert run.code == 2 and one_line(run) and "not a regular file (a character device)" in run.err


LEAVES = st.none() | st.booleans() | st.integers(-3, 5000) | st.floats(allow_nan=False, width=32) | st.text(max_size=6)
VALUES = LEAVES | st.lists(LEAVES, max_size=3) | st.dictionaries(
    st.sampled_from(["height", "width", "shortest_edge", "prefix"]), st.integers(-2, 500), max_size=2)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))


@st.composite
def edited(draw, text: bytes, structured: bool) -> bytes:
    """The file with a random value replaced (JSON/YAML: a key's value, kept parseable, so the
    checks of keys and types are met), or random bytes overwritten, inserted or cut off."""
    import yaml

    if structured and draw(st.booleans()):
        tree = yaml.safe_load(text)
        path = draw(st.sampled_from([p for p in _paths(tree) if p]))
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = draw(VALUES)
        return json.dumps(tree).encode()  # YAML reads JSON
    data = bytearray(text)
    position = draw(st.integers(0, len(data)))
    junk = draw(st.binary(min_size=1, max_size=6))
    how = draw(st.sampled_from(["overwrite", "insert", "cut"]))
    if how == "overwrite":
        data[position : position + len(junk)] = junk
    elif how == "insert":
        data[position:position] = junk
    else:
        del data[position:]
    return bytes(data)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["template", "hparams", "encoder settings", "encoder model config", "tokenizer"]), data=st.data())
def test_property_a_randomly_edited_configuration_file_runs_or_is_one_line(tmp_path_factory, kind, data):
    tmp_path = tmp_path_factory.mktemp("edited")
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", folder)
    path, flags = settings_files(tmp_path / "settings")[kind]
    path.write_bytes(data.draw(edited(path.read_bytes(), structured=kind != "tokenizer")))
    capture = _StderrCapture()
    with capture:
        run = run_configured(tmp_path, capture, folder, flags)
    assert run.code in (0, 2), run.err
    if run.code == 2:
        assert one_line(run), run.err
    else:
        assert run.verified


class _StderrCapture:
    """capsys for a hypothesis example: what main wrote to stderr."""

    def __enter__(self):
        import contextlib

        self._buffer = io.StringIO()
        self._redirect = contextlib.redirect_stderr(self._buffer)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)

    def readouterr(self):
        return Captured(self._buffer.getvalue())
