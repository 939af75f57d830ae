"""Vision-encoder processor settings that ship with the package, so runs never touch a hub.

``--hf_vision_encoder`` is either a well-known name (one JSON file here each) or a local
directory holding ``preprocessor_config.json`` (and, for the patch size, ``config.json``).
"""

from __future__ import annotations

import importlib.resources
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from neva_pack.core import ConfigError
from neva_pack.files import MAX_SETTINGS_BYTES, read_json


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderSpec:
    name: str
    """Hub name of a shipped encoder, or the local directory it was read from."""
    processor: str
    """Which transformers image processor applies the settings: "clip" or "siglip" (one fixed crop),
    "llava_next" or "llava_onevision" (anyres tiles), "qwen2_vl" (native resolution)."""
    preprocessor_config: dict
    """The processor's settings, as in a preprocessor_config.json."""
    patch_size: int
    """Vision transformer patch size in pixels."""
    model_config: dict = field(default_factory=dict)
    """What the image's token count needs beyond the processor's settings, with transformers' names
    (from the model's config.json and processor_config.json): the vision tower's ``image_size``,
    ``vision_feature_select_strategy``, ``num_additional_image_tokens`` (a CLS feature),
    ``num_image_tokens`` and ``vision_aspect_ratio`` (OneVision). Empty for the fixed-crop family."""

    @property
    def family(self) -> str:
        """The images module that processes this encoder's images: "fixed", "anyres" or "native"."""
        return PROCESSOR_FAMILIES[self.processor]

    @property
    def crop_size(self) -> tuple[int, int]:
        """(height, width) of the processed image (fixed-crop family only: the others have no one size)."""
        if self.family != "fixed":
            raise ConfigError(
                f"--hf_vision_encoder {self.name}: a dynamic-resolution encoder ({self.processor}); each image has "
                "its own size and token count, which this command does not handle (use the fixed-crop encoders)"
            )
        cfg = self.preprocessor_config
        if self.processor == "clip" and cfg.get("do_center_crop", True):
            crop = cfg.get("crop_size", 224)
            return _height_width(crop)
        return _height_width(cfg.get("size", 224))

    @property
    def image_tokens(self) -> int:
        """Sequence positions one image occupies: (H / patch) * (W / patch)."""
        height, width = self.crop_size
        return (height // self.patch_size) * (width // self.patch_size)


PROCESSOR_FAMILIES = {
    "clip": "fixed",
    "siglip": "fixed",
    "llava_next": "anyres",
    "llava_onevision": "anyres",
    "qwen2_vl": "native",
}
"""Processor kind -> the images module of its family (images/fixed.py, anyres.py, native.py)."""

_PROCESSOR_TYPES = (  # image_processor_type in a preprocessor_config.json (any backend suffix) -> kind; first match wins
    ("llavaonevision", "llava_onevision"),
    ("llavanext", "llava_next"),
    ("qwen2vl", "qwen2_vl"),
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
            "(CLIPImageProcessor, SiglipImageProcessor, LlavaNextImageProcessor, LlavaOnevisionImageProcessor "
            "or Qwen2VLImageProcessor)"
        )
    if PROCESSOR_FAMILIES[processor] == "fixed":
        _check_fixed_shape(settings, processor, config_file)
    model_file = directory / "config.json"
    model_config = _read(model_file) if model_file.exists() else {}
    vision = model_config.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise ConfigError(f"{model_file}: vision_config {vision!r:.60}: expected an object, got {type(vision).__name__}")
    if patch_size is None and processor == "qwen2_vl":
        patch_size = settings.get("patch_size")
        if patch_size is not None and not _positive_int(patch_size):
            raise ConfigError(f"{config_file}: patch_size {patch_size!r:.60}: expected a positive integer")
    if patch_size is None:
        key = "vision_config.patch_size" if vision.get("patch_size") else "patch_size"
        patch_size = vision.get("patch_size") or model_config.get("patch_size")
        if patch_size and not _positive_int(patch_size):
            raise ConfigError(f"{model_file}: {key} {patch_size!r:.60}: expected a positive integer")
    if not patch_size:
        raise ConfigError(
            f"--hf_vision_encoder {directory}: patch size unknown (no config.json with patch_size); "
            "pass --patch_dim or set model.mm_cfg.vision_encoder.patch_dim in --hparams_file"
        )
    extra = _model_settings(directory, model_config) if PROCESSOR_FAMILIES[processor] == "anyres" else {}
    return EncoderSpec(
        name=str(directory), processor=processor, preprocessor_config=settings, patch_size=int(patch_size), model_config=extra
    )


def _model_settings(directory: Path, model_config: dict) -> dict:
    """The anyres token arithmetic's settings from a checkpoint directory's config.json and
    processor_config.json (the latter wins, as when transformers builds the processor)."""
    processor_file = directory / "processor_config.json"
    processor_config = _read(processor_file) if processor_file.exists() else {}
    vision = model_config.get("vision_config") or {}
    found = {
        "image_size": vision.get("image_size"),
        "vision_feature_select_strategy": model_config.get("vision_feature_select_strategy"),
        "vision_aspect_ratio": model_config.get("vision_aspect_ratio"),
    }
    for key in ("vision_feature_select_strategy", "num_additional_image_tokens", "num_image_tokens", "vision_aspect_ratio"):
        if key in processor_config:
            found[key] = processor_config[key]
    return {key: value for key, value in found.items() if value is not None}


def _height_width(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if "height" in size:
        return int(size["height"]), int(size["width"])
    return int(size["shortest_edge"]), int(size["shortest_edge"])


def _read(path: Path) -> dict:
    value = read_json(path, what="--hf_vision_encoder", max_bytes=MAX_SETTINGS_BYTES)
    if not isinstance(value, dict):
        raise ConfigError(f"--hf_vision_encoder {path}: expected a JSON object, got {type(value).__name__}")
    return value


def check_settings(settings: dict, path) -> None:
    """The settings this tool reads itself have the types the processors expect: a bad one is one
    line naming the file and the key (not a TypeError deep inside a worker)."""

    def refuse(key: str, expected: str) -> None:
        value = settings[key]
        raise ConfigError(f"{path}: {key} {value!r:.60}: expected {expected}, got {type(value).__name__}")

    for key in ("size", "crop_size"):
        if key in settings and not _is_size(settings[key]):
            refuse(key, "a positive integer or an object with positive integers height and width (or shortest_edge)")
    for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
        if key in settings and not isinstance(settings[key], bool):
            refuse(key, "true or false")
    if "resample" in settings and not (_is_int(settings["resample"]) and 0 <= settings["resample"] <= 5):
        refuse("resample", "a PIL resampling filter number, 0 to 5")
    if "rescale_factor" in settings and not (_is_number(settings["rescale_factor"]) and settings["rescale_factor"] > 0):
        refuse("rescale_factor", "a positive number")
    for key in ("image_mean", "image_std"):
        value = settings.get(key)
        if key in settings and not (isinstance(value, list) and len(value) == 3 and all(map(_is_number, value))):
            refuse(key, "a list of 3 numbers (one per RGB channel)")
    if any(not 0 <= v <= 1 for v in settings.get("image_mean", ())):
        refuse("image_mean", "numbers from 0 to 1 (the mean of pixels scaled to 0..1)")
    if any(v <= 0 for v in settings.get("image_std", ())):
        refuse("image_std", "numbers above 0 (pixels are divided by them)")
    if "image_processor_type" in settings and not isinstance(settings["image_processor_type"], str):
        refuse("image_processor_type", "a class name")


def _check_fixed_shape(settings: dict, processor: str, path) -> None:
    """Every image must come out at one (height, width): a center crop gives it (CLIP), or a resize
    to a height and width; a resize of the shortest edge alone, or none, keeps each image's aspect."""
    size = settings.get("size", 224)
    to_box = isinstance(size, dict) and "height" in size or (processor == "siglip" and isinstance(size, int))
    if (processor == "clip" and settings.get("do_center_crop", True)) or (settings.get("do_resize", True) and to_box):
        return
    raise ConfigError(
        f"{path}: do_center_crop/do_resize/size give images of varying shape (no crop, and no resize to a height "
        'and width); packed images have one shape: set do_center_crop to true or size to {"height": H, "width": W}'
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _positive_int(value) -> bool:
    return _is_int(value) and value > 0


def _is_size(value) -> bool:
    if _positive_int(value):
        return True
    if not isinstance(value, dict):
        return False
    if "height" in value or "width" in value:
        return _positive_int(value.get("height")) and _positive_int(value.get("width"))
    return _positive_int(value.get("shortest_edge"))


def _shipped():
    return (importlib.resources.files("neva_pack.families") / "shipped").iterdir()
