"""The registry of model families and of the vision-encoder settings that ship with the package,
so runs never touch a hub: one line per family (``FAMILIES``), one per processor kind.

``--hf_vision_encoder`` is either a well-known name (one JSON file in families/shipped each) or a
local directory holding ``preprocessor_config.json`` (and, for the patch size, ``config.json``).
Its processor kind picks the family; the family object (``model_family``) is what every other
module asks about images. An output records how to rebuild it (``processor_record``)::

    {"family": "native", "encoder": "Qwen/Qwen2-VL-7B-Instruct", "processor": "qwen2_vl",
     "preprocessor_config": {...}, "model_config": {...}, "patch_size": 14,
     "arithmetic": null, "min_pixels": 3136, "max_pixels": 12845056}

so that a reader, a re-pack or a check rebuilds exactly the family the images were made with,
without the command line that made them: the family's options as resolved (``ModelFamily.options``),
each null for a family that has no such option.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

from neva_pack.core import ConfigError, ImageRun
from neva_pack.files import MAX_SETTINGS_BYTES, read_json
from neva_pack.families.anyres import AnyresProcessor
from neva_pack.families.base import EncoderSpec, FamilyOptions, Join, ModelFamily, RunRequest, model_image_run
from neva_pack.families.fixed import ImagePreprocessor
from neva_pack.families.internvl import InternVLProcessor
from neva_pack.families.gemma4 import Gemma4Family
from neva_pack.families.native import NativeProcessor
from neva_pack.families.settings_keys import COMMON_SETTINGS, MAX_PATCH, check_keys, is_int

__all__ = [
    "FAMILIES", "IMAGE_DELIMITER_PIECES", "IMAGE_REFERENCES", "PROCESSOR_FAMILIES", "check_settings", "dynamic_image_run", "dynamic_processor",
    "known_encoders", "model_family", "processor_from_record", "processor_record", "registered_batch_keys", "resolve_encoder",
]  # fmt: skip

FAMILIES = {
    "fixed": ImagePreprocessor,
    "anyres": AnyresProcessor,
    "native": NativeProcessor,
    "internvl": InternVLProcessor,
    "gemma4": Gemma4Family,
}
"""Family name (as outputs record it) -> the class of its family object (base.ModelFamily)."""

PROCESSOR_FAMILIES = {
    "clip": "fixed",
    "siglip": "fixed",
    "llava_next": "anyres",
    "llava_onevision": "anyres",
    "qwen2_vl": "native",
    "got_ocr2": "internvl",
    "gemma4": "gemma4",
}
"""Processor kind -> its family (``FAMILIES``' key)."""

_PROCESSOR_TYPES = (  # image_processor_type in a preprocessor_config.json (any backend suffix) -> kind; first match wins
    ("llavaonevision", "llava_onevision"),
    ("llavanext", "llava_next"),
    ("qwen2vl", "qwen2_vl"),
    ("gotocr2", "got_ocr2"),
    ("gemma4", "gemma4"),
    ("siglip", "siglip"),
    ("clip", "clip"),
)


def known_encoders(family: str | None = None) -> list[str]:
    """Names of the shipped encoders, of one family ("fixed", "anyres", "native") or all."""
    shipped = (json.loads(p.read_text()) for p in _shipped() if p.name.endswith(".json"))
    return sorted(data["name"] for data in shipped if family is None or PROCESSOR_FAMILIES[data["processor"]] == family)


def resolve_encoder(name_or_dir: str, patch_size: int | None = None) -> EncoderSpec:
    """A shipped name or a local directory -> EncoderSpec; ``patch_size`` overrides what the files say."""
    path = Path(name_or_dir)
    if path.is_dir():
        return _from_directory(path, patch_size)
    shipped = importlib.resources.files("neva_pack.families") / "shipped" / (name_or_dir.replace("/", "__") + ".json")
    if "/" in name_or_dir and shipped.is_file():
        data = json.loads(shipped.read_text())
        return EncoderSpec(
            name=data["name"],
            processor=data["processor"],
            family=PROCESSOR_FAMILIES[data["processor"]],
            preprocessor_config=data["preprocessor_config"],
            patch_size=int(patch_size or data["patch_size"]),
            model_config=data.get("model_config", {}),
        )
    raise ConfigError(
        f"--hf_vision_encoder {name_or_dir!r}: not a local directory with preprocessor_config.json and not a "
        f"known encoder ({', '.join(known_encoders())}); this tool never downloads from a hub"
    )


def _from_directory(directory: Path, patch_size: int | None) -> EncoderSpec:
    config_file = directory / "preprocessor_config.json"
    if not config_file.exists():
        raise ConfigError(f"--hf_vision_encoder {directory}: no preprocessor_config.json in this directory")
    settings = _read(config_file)
    check_settings(settings, config_file)
    kind = str(settings.get("image_processor_type", "")).lower().replace("_", "")
    processor = next((name for key, name in _PROCESSOR_TYPES if key in kind), None)
    if processor is None:
        raise ConfigError(
            f"{config_file}: image_processor_type {settings.get('image_processor_type')!r} is not supported "
            "(CLIPImageProcessor, SiglipImageProcessor, LlavaNextImageProcessor, LlavaOnevisionImageProcessor, "
            "Qwen2VLImageProcessor or GotOcr2ImageProcessor)"
        )
    family = FAMILIES[PROCESSOR_FAMILIES[processor]]
    check_keys(settings, config_file, family.settings_keys)
    family.check_settings_file(settings, processor, config_file)
    model_file = directory / "config.json"
    model_config = _read(model_file) if model_file.exists() else {}
    vision = model_config.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise ConfigError(f"{model_file}: vision_config {vision!r:.60}: expected an object, got {type(vision).__name__}")
    if patch_size is None and family.settings_patch_size:
        patch_size = settings.get("patch_size")
        if patch_size is not None and not _patch(patch_size):
            raise ConfigError(f"{config_file}: patch_size {patch_size!r:.60}: expected {_PATCH}")
    if patch_size is None:
        key = "vision_config.patch_size" if vision.get("patch_size") else "patch_size"
        patch_size = _square_side(vision.get("patch_size") or model_config.get("patch_size"))
        if patch_size and not _patch(patch_size):
            raise ConfigError(f"{model_file}: {key} {patch_size!r:.60}: expected {_PATCH}")
    if not patch_size:
        raise ConfigError(
            f"--hf_vision_encoder {directory}: patch size unknown (no config.json with patch_size); "
            "pass --patch_dim or set model.mm_cfg.vision_encoder.patch_dim in --hparams_file"
        )
    extra = family.model_settings(directory, model_config, _read)
    return EncoderSpec(
        name=str(directory), processor=processor, family=PROCESSOR_FAMILIES[processor], preprocessor_config=settings,
        patch_size=int(patch_size), model_config=extra,
    )


def _read(path: Path) -> dict:
    value = read_json(path, what="--hf_vision_encoder", max_bytes=MAX_SETTINGS_BYTES)
    if not isinstance(value, dict):
        raise ConfigError(f"--hf_vision_encoder {path}: expected a JSON object, got {type(value).__name__}")
    return value


def check_settings(settings: dict, path) -> None:
    """The settings every family reads alike (settings_keys.COMMON_SETTINGS) have the types and ranges
    the processors expect: a bad one is one line naming the file and the key (not a TypeError deep
    inside a worker, nor pixels normalised to infinity)."""
    check_keys(settings, path, COMMON_SETTINGS)


def _positive_int(value) -> bool:
    return is_int(value) and value > 0


def _patch(value) -> bool:
    return _positive_int(value) and value <= MAX_PATCH


_PATCH = f"a positive integer (pixels on a patch's side, at most {MAX_PATCH})"


def _square_side(value):
    """A patch size written as [side, side] (transformers saves some vision configs' patch size so) -> side;
    anything else as it is."""
    if isinstance(value, list) and len(value) == 2 and value[0] == value[1] and _positive_int(value[0]):
        return value[0]
    return value


def _shipped():
    return (importlib.resources.files("neva_pack.families") / "shipped").iterdir()


IMAGE_DELIMITER_PIECES = tuple((start, end) for cls in FAMILIES.values() for start, _, end in [cls.image_tokens] if start and end)
"""Special pieces that open and close an image run, as a one-call prompt writes an image (each
family's start and end tokens, where its runs have both)."""


def registered_batch_keys() -> dict[str, Join]:
    """Every family's model-input keys, each with how it joins a batch (what batches items alone by;
    families that share a key declare it alike: ValueError otherwise, a bug)."""
    keys: dict[str, Join] = {}
    for cls in FAMILIES.values():
        for key, join in cls.batch_keys.items():
            if keys.setdefault(key, join) is not join:
                raise ValueError(f"model input {key!r}: families declare it as {keys[key]} and {join}")
    return keys


RECORD_OPTIONS = ("arithmetic", "min_pixels", "max_pixels")
"""The options every record lists, in this order (null where a family has none); a family's further
options follow them (``ModelFamily.options``), so that the records of the families that have none stay
as they were."""


def model_family(encoder: EncoderSpec, options: FamilyOptions = FamilyOptions()) -> ModelFamily:
    """The family object of ``encoder``'s images, with the command line's image options
    (ConfigError, one line, for an option the family does not take)."""
    cls = FAMILIES[encoder.family]
    _refuse_others(cls, encoder, {"min_pixels": options.min_pixels, "max_pixels": options.max_pixels,
                                  "max_soft_tokens": options.max_soft_tokens})  # fmt: skip
    if options.reference is not None and options.reference not in cls.references:
        follows = f"one of {', '.join(cls.references)}" if cls.references else "its Hugging Face processor only (no --image_reference)"
        raise ConfigError(f"--image_reference {options.reference}: {encoder.name}'s images ({cls.models}) follow {follows}")
    return cls.from_options(encoder, options)


def dynamic_processor(
    encoder: EncoderSpec, *, arithmetic: str = "transformers", min_pixels: int | None = None, max_pixels: int | None = None,
    max_soft_tokens: int | None = None,
) -> ModelFamily:
    """The family object of an encoder whose images each have their own size, with the families' own
    options (``arithmetic``: "transformers" or "llava"; ``min_pixels`` / ``max_pixels``; ``max_soft_tokens``); ConfigError
    for an option given to a family that has none, or for a fixed-crop encoder."""
    cls = FAMILIES[encoder.family]
    if not cls.own_size:
        raise ConfigError(f"--hf_vision_encoder {encoder.name}: a fixed-crop encoder ({encoder.processor}), not a dynamic-resolution one")
    _refuse_others(cls, encoder, {"min_pixels": min_pixels, "max_pixels": max_pixels, "max_soft_tokens": max_soft_tokens})
    given = {"arithmetic": arithmetic, "min_pixels": min_pixels, "max_pixels": max_pixels, "max_soft_tokens": max_soft_tokens}
    return cls.from_encoder(encoder, **{name: given[name] for name in cls.option_names})


IMAGE_REFERENCES = tuple(dict.fromkeys(reference for cls in FAMILIES.values() for reference in cls.references))
"""Every reference a family's images can follow (``--image_reference``'s choices; ``ModelFamily.references``)."""


def _refuse_others(cls, encoder: EncoderSpec, given: dict) -> None:
    """ConfigError for an option set that only another family takes, naming that family's options."""
    for name, value in given.items():
        if value is not None and name not in cls.option_names:
            owner = next(other for other in FAMILIES.values() if name in other.option_names)
            flags = " / ".join(f"--{option}" for option in owner.option_names)
            raise ConfigError(f"{flags}: {encoder.name} is not a {owner.models} encoder")


def dynamic_image_run(tokenizer, family: str, patch_id: int | None = None, start_id: int | None = None, end_id: int | None = None) -> ImageRun:
    """The image run of a family (``EncoderSpec.family``) whose images each have their own length,
    with the model's image tokens from the tokenizer; an id given explicitly replaces the token's.
    ConfigError, one line, for a tokenizer lacking one."""
    cls = FAMILIES[family]
    return model_image_run(tokenizer, cls.image_tokens, cls.models, RunRequest(patch_id=patch_id, start_id=start_id, end_id=end_id))


def processor_record(encoder: EncoderSpec, processor: ModelFamily) -> dict:
    """What rebuilds ``processor`` (made from ``encoder`` by ``dynamic_processor``), as JSON values."""
    return {
        "family": processor.family,
        "encoder": encoder.name,
        "processor": encoder.processor,
        "preprocessor_config": encoder.preprocessor_config,
        "model_config": encoder.model_config,
        "patch_size": encoder.patch_size,
        **dict.fromkeys(RECORD_OPTIONS),
        **processor.options(),
    }


def processor_from_record(record: dict) -> ModelFamily:
    """The family object ``processor_record`` describes (ConfigError for settings it refuses)."""
    encoder = EncoderSpec(
        name=record["encoder"], processor=record["processor"], family=record["family"],
        preprocessor_config=record["preprocessor_config"], patch_size=int(record["patch_size"]),
        model_config=record.get("model_config") or {},
    )  # fmt: skip
    family = FAMILIES[encoder.family].from_encoder(encoder, **{name: record[name] for name in FAMILIES[encoder.family].option_names})
    if record.get("video") is not None:  # a family reading video clips (native.py: NativeVideo)
        family = family.with_video_record(record["video"])
    return family
