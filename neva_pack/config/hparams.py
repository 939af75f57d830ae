"""Reading a NeMo NeVA YAML config (``--hparams_file``): the keys the config fields declare
(``Option.hparams``) are read; the rest of a NeMo config is ignored, but a key unknown to NeMo in a
section we read is a typo, refused."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from neva_pack.core import ConfigError
from neva_pack.files import read_yaml

NEMO_SECTION_KEYS = {
    ("model", "data"): {
        "num_workers", "dataloader_type", "data_path", "data_prefix", "lazy_preprocess", "is_multimodal",
        "media_type", "sep_image_conv_front", "image_token_len", "conv_template", "image_folder", "video_folder",
        "image_aspect_ratio", "splice_single_frame", "num_frames", "sep_token_between_frames", "packed_sequence",
        "crop_size", "validation_drop_last", "add_extra_token",
    },
    ("model", "mm_cfg"): {
        "llm", "vision_encoder", "pretrain_mm_mlp_adapter", "use_im_start_end", "im_start_end", "mm_mlp_adapter_type",
        "use_lita", "lita",
    },
    ("model", "mm_cfg", "llm"): {"from_pretrained", "freeze", "model_type"},
    ("model", "mm_cfg", "vision_encoder"): {
        "from_pretrained", "from_hf", "patch_dim", "crop_size", "hidden_size", "vision_select_layer",
        "class_token_length", "freeze", "model_type",
    },
}  # fmt: skip
"""Keys NeVA configs hold in the sections this tool reads: a key outside these is a typo, refused."""

_INTERPOLATION = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


def read_hparams(path: Path, keys: dict[tuple[str, ...], str]) -> dict:
    """The values found in a NeMo-style YAML at ``keys`` (YAML key path -> field name), by field name.

    Whole-value interpolations like ``${model.mm_cfg.llm.model_type}`` are resolved (from the
    root, or relative to ``model``); unknown keys in the sections read are refused.
    """
    data = read_yaml(path, what="--hparams_file")
    if not isinstance(data, dict):
        raise ConfigError(f"--hparams_file {path}: expected a mapping at the top level")
    _check_sections(data, path)
    values = {}
    for key_path, name in keys.items():
        node = _lookup(data, key_path)
        if isinstance(node, str) and (match := _INTERPOLATION.match(node)):
            node = _resolve(data, match.group(1), path)
        if node is not None:
            values[name] = node
    return values


def _lookup(data, keys):
    node = data
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _resolve(data: dict, reference: str, path: Path):
    keys = tuple(reference.lstrip(".").split("."))
    for root in ((), ("model",)):
        value = _lookup(data, root + keys)
        if value is not None:
            return value
    raise ConfigError(f"--hparams_file {path}: ${{{reference}}} refers to nothing in the file")


def _check_sections(data: dict, path: Path) -> None:
    for section, known in NEMO_SECTION_KEYS.items():
        node = _lookup(data, section)
        if not isinstance(node, dict):
            continue
        for key in node:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(
                    f"--hparams_file {path}: unknown key {'.'.join(section)}.{key}{hint}; "
                    f"known: {', '.join(sorted(known))}"
                )


__all__ = ["NEMO_SECTION_KEYS", "read_hparams"]
