"""Vision-encoder processor settings that ship with the package, so runs never touch a hub.

``--hf_vision_encoder`` is either a well-known name (one JSON file here each) or a local
directory holding ``preprocessor_config.json`` (and, for the patch size, ``config.json``).
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass, field
from pathlib import Path

from neva_pack.errors import ConfigError


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
    shipped = importlib.resources.files("neva_pack.encoders") / (name_or_dir.replace("/", "__") + ".json")
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
    if not config_file.is_file():
        raise ConfigError(f"--hf_vision_encoder {directory}: no preprocessor_config.json in this directory")
    settings = _read(config_file)
    kind = str(settings.get("image_processor_type", "")).lower().replace("_", "")
    processor = next((name for key, name in _PROCESSOR_TYPES if key in kind), None)
    if processor is None:
        raise ConfigError(
            f"{config_file}: image_processor_type {settings.get('image_processor_type')!r} is not supported "
            "(CLIPImageProcessor, SiglipImageProcessor, LlavaNextImageProcessor, LlavaOnevisionImageProcessor "
            "or Qwen2VLImageProcessor)"
        )
    model_config = _read(directory / "config.json") if (directory / "config.json").is_file() else {}
    if patch_size is None and processor == "qwen2_vl":
        patch_size = settings.get("patch_size")
    if patch_size is None:
        patch_size = (model_config.get("vision_config") or {}).get("patch_size") or model_config.get("patch_size")
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
    processor_config = _read(processor_file) if processor_file.is_file() else {}
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
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable JSON ({exc})") from None


def _shipped():
    return importlib.resources.files("neva_pack.encoders").iterdir()
