"""Vision-encoder processor settings that ship with the package, so runs never touch a hub.

``--hf_vision_encoder`` is either a well-known name (one JSON file here each) or a local
directory holding ``preprocessor_config.json`` (and, for the patch size, ``config.json``).
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from neva_pack.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderSpec:
    name: str
    """Hub name of a shipped encoder, or the local directory it was read from."""
    processor: str
    """"clip" or "siglip": which transformers image processor applies the settings."""
    preprocessor_config: dict
    """The processor's settings, as in a preprocessor_config.json."""
    patch_size: int
    """Vision transformer patch size in pixels."""

    @property
    def crop_size(self) -> tuple[int, int]:
        """(height, width) of the processed image."""
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


def known_encoders() -> list[str]:
    return sorted(json.loads(p.read_text())["name"] for p in _shipped() if p.name.endswith(".json"))


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
    kind = str(settings.get("image_processor_type", "")).lower()
    if "siglip" in kind:
        processor = "siglip"
    elif "clip" in kind:
        processor = "clip"
    else:
        raise ConfigError(
            f"{config_file}: image_processor_type {settings.get('image_processor_type')!r} is not supported "
            "(CLIPImageProcessor or SiglipImageProcessor)"
        )
    if patch_size is None:
        model_config = _read(directory / "config.json") if (directory / "config.json").is_file() else {}
        patch_size = (model_config.get("vision_config") or {}).get("patch_size") or model_config.get("patch_size")
    if not patch_size:
        raise ConfigError(
            f"--hf_vision_encoder {directory}: patch size unknown (no config.json with patch_size); "
            "pass --patch_dim or set model.mm_cfg.vision_encoder.patch_dim in --hparams_file"
        )
    return EncoderSpec(name=str(directory), processor=processor, preprocessor_config=settings, patch_size=int(patch_size))


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
