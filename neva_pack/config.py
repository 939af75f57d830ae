"""Every knob of a preprocess run in one dataclass, validated at construction.

Built from NeMo's flags, our own flags, and/or a NeMo-style YAML hparams file
(``model.data.*``, ``model.mm_cfg.*``): NeMo's defaults < hparams file < explicit flags.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from neva_pack.errors import ConfigError

IMAGE_ASPECT_RATIOS = ("square", "pad")


def _default_workers() -> int:
    return min(8, os.cpu_count() or 1)


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    data_path: Path
    """LLaVA-format JSON list or JSONL."""
    output_dir: Path
    """Where packed_seq_dataset.{bin,idx}, its meta, stats.json and skipped.jsonl go."""
    tokenizer_path: Path
    """SentencePiece .model file or Hugging Face tokenizer directory."""
    image_folder: Path | None = None
    """Directory or .tar archive the records' image paths are relative to."""
    max_seq_length: int = 4096
    """Pack capacity in positions (text + image); longer samples are truncated (or skipped)."""
    packing_algorithm: str = "first_fit_shuffle"
    """A name from neva_pack.packing.ALGORITHMS."""
    hf_vision_encoder: str = "openai/clip-vit-large-patch14-336"
    """A shipped encoder name or a local directory with preprocessor_config.json."""
    conv_template: str = "plain"
    """A template name from templates/ or a path to a template YAML."""
    image_aspect_ratio: str = "square"
    """square: resize + centre crop; pad: pad to a square with the mean colour first (LLaVA-1.5)."""
    seed: int = 0
    """Seed of the packing algorithm's random generator."""
    num_workers: int = field(default_factory=_default_workers)
    """DataLoader worker processes for tokenization and image preprocessing (0 = in process)."""
    global_batch_size: int | None = None
    """Unpacked global batch size, to print the packed equivalent (GBS / samples per pack)."""
    use_im_start_end: bool = False
    """NeMo's mm_cfg.use_im_start_end: image run = start + N patches + end instead of N positions."""
    patch_dim: int | None = None
    """Override of the encoder's patch size (positions per image = (crop / patch)^2)."""
    crop_size: tuple[int, int] | None = None
    """Expected (H, W) from a NeMo config; must agree with the encoder's processor."""
    image_patch_id: int = 0
    """Token id of image-embedding positions (NeMo: 0)."""
    image_start_id: int | None = None
    """Token id opening an image run; default: the tokenizer's <extra_id_4> if any."""
    image_end_id: int | None = None
    """Token id closing an image run; default: the tokenizer's <extra_id_5> if any."""
    ignore_index: int = -1
    """Label value of untrained positions (NeMo's collate masks -1)."""
    truncate: bool = True
    """Cut samples longer than max_seq_length (NeMo); False: skip them as too_long."""
    system_prompt: str | None = None
    """Replaces the template's default system prompt."""
    max_samples_per_pack: int | None = None
    """Cap on samples per pack (for fixed-size cu_seqlens buffers)."""
    strict: bool = False
    """Fail the run (exit 1) when any record was skipped, after writing the report."""
    max_skip_fraction: float = 0.5
    """Abort (after writing the report so far) when more than this fraction of the records is
    skipped, checked from 1,000 records on and at the end; 1 disables it."""
    overwrite: bool = False
    """Replace an existing output in output_dir (only the files a run writes are removed)."""
    resume: bool = False
    """Continue an interrupted run in output_dir; the result is byte-identical to an uninterrupted run."""
    pack_sizes: tuple[int, ...] | None = None
    """Several pack sizes: one prefix per size (packed_seq_dataset_<size>) from one sample store,
    built with max_seq_length = the largest; samples are truncated per size as needed."""
    checkpoint_every: int = 10_000
    """Records per committed store shard (and every tenth of that, packs per writer checkpoint):
    at most this much work is redone after a crash."""

    # --- sharded preprocessing (issue 12; neva_pack.shards) -----------------------------------
    num_shards: int | None = None
    """Split the records into this many contiguous ranges, one per node (e.g. a SLURM job array)."""
    shard_index: int | None = None
    """Encode only this shard's range into its own store part; None with num_shards: the final step
    that joins the parts, packs and writes (the same bytes as a run without shards)."""

    def __post_init__(self):
        for name in ("data_path", "output_dir", "tokenizer_path", "image_folder"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        if not self.data_path.is_file():
            raise ConfigError(f"--data_path {self.data_path}: no such file")
        if not self.tokenizer_path.exists():
            raise ConfigError(f"--tokenizer_path {self.tokenizer_path}: no such file or directory")
        if self.image_folder is not None and not self.image_folder.exists():
            raise ConfigError(f"--image_folder {self.image_folder}: no such directory or archive")
        if self.max_seq_length < 2:
            raise ConfigError(f"--max_seq_length {self.max_seq_length}: must be >= 2")
        from neva_pack.packing import ALGORITHMS  # light: numba kernels compile on first call only

        if self.packing_algorithm not in ALGORITHMS:
            raise ConfigError(
                f"--packing_algorithm {self.packing_algorithm!r}: choose one of {', '.join(sorted(ALGORITHMS))}"
            )
        if self.image_aspect_ratio not in IMAGE_ASPECT_RATIOS:
            raise ConfigError(
                f"--image_aspect_ratio {self.image_aspect_ratio!r}: choose one of {', '.join(IMAGE_ASPECT_RATIOS)}"
            )
        if self.num_workers < 0:
            raise ConfigError(f"--num_workers {self.num_workers}: must be >= 0")
        if not 0 <= self.max_skip_fraction <= 1:
            raise ConfigError(f"--max_skip_fraction {self.max_skip_fraction}: must be between 0 and 1")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")
        for name in ("global_batch_size", "patch_dim", "max_samples_per_pack", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} {value}: must be >= 1")
        if self.num_shards is not None or self.shard_index is not None:
            from neva_pack.shards import resolve_shards

            resolve_shards(self.num_shards, self.shard_index, environ={})  # validates, no defaults here
        if self.crop_size is not None:
            object.__setattr__(self, "crop_size", tuple(int(v) for v in self.crop_size))
        if self.pack_sizes is not None:
            sizes = tuple(sorted({int(v) for v in self.pack_sizes}))
            if not sizes or sizes[0] < 2:
                raise ConfigError(f"--pack_sizes {list(self.pack_sizes)}: every size must be >= 2")
            object.__setattr__(self, "pack_sizes", sizes)
            object.__setattr__(self, "max_seq_length", sizes[-1])

    @property
    def sizes(self) -> tuple[int, ...]:
        """The pack sizes to write, smallest first."""
        return self.pack_sizes or (self.max_seq_length,)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


HPARAMS_KEYS = {
    # NeMo YAML path -> PreprocessConfig field
    ("model", "data", "data_path"): "data_path",
    ("model", "data", "image_folder"): "image_folder",
    ("model", "data", "conv_template"): "conv_template",
    ("model", "data", "image_aspect_ratio"): "image_aspect_ratio",
    ("model", "encoder_seq_length"): "max_seq_length",
    ("model", "global_batch_size"): "global_batch_size",
    ("model", "mm_cfg", "use_im_start_end"): "use_im_start_end",
    ("model", "mm_cfg", "vision_encoder", "from_pretrained"): "hf_vision_encoder",
    ("model", "mm_cfg", "vision_encoder", "patch_dim"): "patch_dim",
    ("model", "mm_cfg", "vision_encoder", "crop_size"): "crop_size",
    ("model", "tokenizer", "model"): "tokenizer_path",
}
"""The keys of a NeMo NeVA config this tool uses; the rest of a NeMo config is ignored."""

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


def read_hparams(path: Path) -> dict:
    """Values of HPARAMS_KEYS found in a NeMo-style YAML, as PreprocessConfig field values.

    Whole-value interpolations like ``${model.mm_cfg.llm.model_type}`` are resolved (from the
    root, or relative to ``model``); unknown keys in the sections read are refused.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--hparams_file {path}: no such file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--hparams_file {path}: unreadable YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hparams_file {path}: expected a mapping at the top level")
    _check_sections(data, path)
    values = {}
    for keys, name in HPARAMS_KEYS.items():
        node = _lookup(data, keys)
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
