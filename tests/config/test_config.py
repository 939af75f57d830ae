"""The config: three parts by concern, each field declaring its flag, help, hparams key and checks
once; NeMo's flags keep NeMo's defaults; nothing is changed after construction; the sample part is
the sample fingerprint and the pack part the writing settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from neva_pack.config import (
    NEMO, NEMO_SECTION_KEYS, PARTS, PackConfig, PreprocessConfig, RecordBudgets, RunConfig, SampleConfig, flag_of, hparams_keys,
    meta_fields, options, settings
)
from neva_pack.core import ConfigError
from neva_pack.cli import preprocess_parser
from tests.conftest import SAMPLE_DATA

NEMO_DEFAULTS = {  # examples/multimodal/multimodal_llm/neva/sequence_packing/preprocess_dataset.py
    "max_seq_length": 4096,
    "packing_algorithm": "first_fit_shuffle",
    "hf_vision_encoder": "openai/clip-vit-large-patch14-336",
    "conv_template": "plain",
    "image_aspect_ratio": "square",
    "seed": 0,
}
NEMO_FLAGS = {"data_path", "image_folder", "tokenizer_path", "output_dir", *NEMO_DEFAULTS}
STORED_FINGERPRINT_KEYS = [  # what sample stores written so far record, in this order
    "data_path", "data_size", "data_mtime_ns", "image_folder", "tokenizer_path", "conv_template", "hf_vision_encoder",
    "image_aspect_ratio", "max_seq_length", "truncate", "ignore_index", "use_im_start_end", "patch_dim", "image_ids",
    "system_prompt", "tokenization", "budgets", "neva_pack",
]  # fmt: skip


@pytest.fixture
def required(tmp_path) -> dict:
    return {"data_path": SAMPLE_DATA / "llava_sample.json", "tokenizer_path": SAMPLE_DATA / "tokenizer.model",
            "output_dir": tmp_path / "out"}  # fmt: skip


def test_every_field_has_a_flag_or_is_hparams_only_by_declaration():
    listed = preprocess_parser().format_help()
    for spec, opt in settings():
        if opt.help is None:
            assert opt.hparams, f"{spec.name}: no flag and no hparams key: nothing can set it"
        else:
            assert f"{flag_of(spec)} " in listed or f"{flag_of(spec)}\n" in listed, spec.name


def test_nemo_flags_keep_nemo_names_and_defaults():
    nemo = {spec.name: spec.default for spec, opt in settings() if opt.group == NEMO}
    assert set(nemo) == NEMO_FLAGS
    assert {name: nemo[name] for name in NEMO_DEFAULTS} == NEMO_DEFAULTS


def test_field_names_are_unique_across_the_parts_and_read_through(required):
    names = [spec.name for spec, _ in settings()]
    assert len(names) == len(set(names)) == len(PreprocessConfig.field_names())
    config = PreprocessConfig(**required, seed=3, strict=True, tokenization="llava")
    for part in PARTS:
        holder = getattr(config, part)
        for spec, _ in options(PARTS[part]):  # a budget reads through the sample part's group
            owner = holder if spec.name in {f.name for f in dataclasses.fields(holder)} else holder.budgets
            assert getattr(config, spec.name) == getattr(owner, spec.name)
    assert (config.seed, config.strict, config.tokenization) == (3, True, "llava")


def test_every_hparams_key_is_one_nemo_configs_hold():
    for key_path in hparams_keys():
        section, key = key_path[:-1], key_path[-1]
        assert key in NEMO_SECTION_KEYS.get(section, {key}), key_path  # a section we check the keys of


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("seed", "7", "--seed '7': expected an integer, got str"),
        ("seed", -1, "--seed -1: must be between 0 and 2**63 - 1"),
        ("max_seq_length", 4096.0, "--max_seq_length (or hparams model.encoder_seq_length) 4096.0: expected an integer"),
        ("image_aspect_ratio", "wide", "--image_aspect_ratio 'wide': choose one of square, pad"),
        ("packing_algorithm", "best", "--packing_algorithm 'best': choose one of"),
        ("max_skip_fraction", 2, "--max_skip_fraction 2: must be between 0 and 1"),
        ("truncate", "yes", "--no_truncate 'yes': expected true or false, got str"),
        ("crop_size", 336, "hparams model.mm_cfg.vision_encoder.crop_size 336: expected a list of 2 integers"),
        ("image_folder", ["a", "b"], "--image_folder (or hparams model.data.image_folder) ['a', 'b']: expected a path"),
        ("pad_id", -2, "--pad_id -2: must be >= 0"),
        ("checkpoint_every", 0, "--checkpoint_every 0: must be >= 1"),
        ("pack_sizes", [1, 64], "--pack_sizes [1, 64]: every size must be between 2 and"),
    ],
)
def test_a_wrong_type_or_value_is_refused_naming_the_flag(required, setting, value, message):
    with pytest.raises(ConfigError) as error:
        PreprocessConfig(**required, **{setting: value})
    assert str(error.value).startswith(message)


def test_pack_sizes_derive_the_sizes_and_overwrite_nothing(required):
    config = PreprocessConfig(**required, pack_sizes=[2048, 1024, 2048], pad_to_multiple_of=48)
    assert config.pack.pack_sizes == (2048, 1024, 2048) and config.max_seq_length == 4096  # as given
    assert config.sizes == (1024, 2048)
    assert config.cut_length == 2016  # the largest size, less what padding to 48 would push over it
    assert config.sample_fingerprint()["max_seq_length"] == 2016
    assert config.write_settings(1024)["max_seq_length"] == 1024


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_part_holds_exactly_the_values_it_was_given(required, part):
    config = PreprocessConfig(**required, pack_sizes=[512, 256], crop_size=[336, 336], num_workers=0)
    given = getattr(config, part)
    values = {spec.name: getattr(given, spec.name) for spec in dataclasses.fields(given)}
    assert PARTS[part](**values) == given


def test_the_sample_fingerprint_is_the_sample_part(required):
    """Every field of SampleConfig is in the fingerprint (alone, or in a list with its kin), and
    the fingerprint keeps the layout sample stores already hold, so that they still resume."""
    config = PreprocessConfig(**required, image_patch_id=5, max_record_depth=9, system_prompt="Be brief.")
    fingerprint = config.sample_fingerprint()
    assert list(fingerprint) == STORED_FINGERPRINT_KEYS  # the default format holds images: no text_only key
    text_only = PreprocessConfig(**required, output_format="bridge").sample_fingerprint()
    assert list(text_only) == STORED_FINGERPRINT_KEYS + ["text_only"] and text_only["text_only"] is True
    sample = {spec.name: getattr(config, spec.name) for spec, _ in options(SampleConfig)}  # the budgets' among them
    gathered = {}
    for spec, opt in settings():
        if spec.name not in sample or opt.fingerprint == "" or (opt.fingerprint_when_set and sample[spec.name] is None):
            continue
        if opt.fingerprint:
            gathered.setdefault(opt.fingerprint, []).append(sample[spec.name])
        elif isinstance(sample[spec.name], Path):
            assert fingerprint[spec.name] == str(sample[spec.name].resolve())
        else:
            assert fingerprint[spec.name] == sample[spec.name], spec.name
    assert gathered == {key: fingerprint[key] for key in gathered}
    assert fingerprint["image_ids"] == [5, None, None] and fingerprint["budgets"][1] == 9
    # the budgets' list as the layout before their group (RecordBudgets) recorded it, in that order
    assert fingerprint["budgets"] == [8 << 20, 9, 1_000_000, 64 << 20, 36_000_000, False, 5.0, 1000]
    left_out = {spec.name for spec, opt in settings() if opt.fingerprint == "" and spec.name in sample}
    assert left_out == {"crop_size"}  # checked against the encoder, which is in the fingerprint
    when_set = {spec.name for spec, opt in settings() if opt.fingerprint_when_set}
    assert when_set == {"min_pixels", "max_pixels", "max_soft_tokens", "image_reference", "video_profile", "video_fps", "video_max_frames", "frame_compression"} and not when_set & set(fingerprint)  # unset: stores made before resume


def test_min_and_max_pixels_are_in_the_sample_fingerprint_once_set(required):
    """--min_pixels / --max_pixels decide a Qwen2-VL image's size and tokens: a store made with other
    values must not resume; unset, the fingerprint is the one stores made before these flags hold."""
    fingerprint = PreprocessConfig(**required, max_pixels=1003520).sample_fingerprint()
    assert fingerprint["max_pixels"] == 1003520 and "min_pixels" not in fingerprint
    with pytest.raises(ConfigError, match="--min_pixels"):
        PreprocessConfig(**required, min_pixels=0)


def test_every_writing_setting_changes_the_settings(required):
    base = PreprocessConfig(**required)
    changed = {"max_seq_length": 2048, "packing_algorithm": "near_optimal", "seed": 1, "global_batch_size": 64,
               "max_samples_per_pack": 3, "output_format": "compact", "pad_to_multiple_of": 8, "pad_id": 2,
               "balance_data_parallel": 2, "ignore_index": -100, "max_images_per_pack": 4,
               "max_image_tokens_per_pack": 3000, "max_video_tokens_per_pack": 2000, "step_cost_model": "qwen2.5-vl-7b"}  # fmt: skip
    assert set(changed) == set(base.write_settings(4096))
    for name, value in changed.items():
        balanced = {"balance_data_parallel": 2} if name == "step_cost_model" else {}  # it orders balanced packs only
        other = PreprocessConfig(**required, **balanced, **{name: value})
        assert other.write_settings(other.sizes[-1]) != base.write_settings(4096), name
    assert set(meta_fields()) == set(changed) - {"global_batch_size", "step_cost_model"}  # the stats file records them


def test_parts_separate_the_concerns():
    assert {spec.name for spec in dataclasses.fields(RunConfig)} >= {"output_dir", "num_workers", "resume", "num_shards"}
    assert {"seed", "pad_id", "output_format", "pack_sizes"} <= {spec.name for spec in dataclasses.fields(PackConfig)}
    assert {"tokenizer_path", "conv_template", "budgets"} <= {spec.name for spec in dataclasses.fields(SampleConfig)}
    assert {"max_record_bytes", "max_image_bytes", "allow_outside_image_folder"} <= {spec.name for spec in dataclasses.fields(RecordBudgets)}


def test_settings_by_name_build_the_same_config_as_the_parts(required, tmp_path):
    by_name = PreprocessConfig(**required, seed=3, num_workers=0, conv_template="v1")
    by_part = PreprocessConfig(
        sample=SampleConfig(data_path=required["data_path"], tokenizer_path=required["tokenizer_path"], conv_template="v1"),
        pack=PackConfig(seed=3),
        run=RunConfig(output_dir=required["output_dir"], num_workers=0),
    )
    assert by_name == by_part
    assert dataclasses.replace(by_name, pack=PackConfig(seed=4)).seed == 4
    with pytest.raises(TypeError, match="'sede'"):
        PreprocessConfig(**required, sede=1)
    with pytest.raises(TypeError, match="not both"):
        PreprocessConfig(sample=by_name.sample, pack=by_name.pack, run=by_name.run, seed=1)
