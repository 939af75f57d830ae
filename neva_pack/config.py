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

from neva_pack.errors import ConfigError
from neva_pack.formats import DEFAULT_FORMAT, FORMATS
from neva_pack.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS
from neva_pack.records import (
    DEFAULT_MAX_CONVERSATION_CHARS,
    DEFAULT_MAX_IMAGES_PER_RECORD,
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_MAX_RECORD_DEPTH,
    MAX_RECORD_DEPTH_LIMIT,
)
from neva_pack.untrusted import read_yaml

IMAGE_ASPECT_RATIOS = ("square", "pad")
MAX_SEED = 2**63 - 1
"""Seeds are non-negative int64 (numpy's generators refuse negative seeds)."""


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _default_workers() -> int:
    return min(8, _usable_cpus())


def max_workers() -> int:
    """More workers than this is refused: each holds a tokenizer, an image processor and a queue of
    samples, and hundreds of them exhaust memory long before they add speed."""
    return max(16, 4 * _usable_cpus())


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
    image_patch_id: int | None = None
    """Token id of image-embedding positions; default 0, or NeMo's <extra_id_3> id where NeMo's
    template leaves it (plain, llama_3, nvgpt, yi_34b under --tokenization nemo)."""
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
    # --- per-record budgets and confinement: what one record may cost ---
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Bytes of one record's JSON text; a longer record is skipped unparsed (record_too_large)."""
    max_record_depth: int = DEFAULT_MAX_RECORD_DEPTH
    """Nesting levels of one record; a deeper record is skipped unparsed (record_too_deep)."""
    max_conversation_chars: int = DEFAULT_MAX_CONVERSATION_CHARS
    """Characters of one conversation's text; more is skipped before tokenizing (conversation_too_long)."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Bytes read from one image file; a larger file is skipped unread (image_too_large)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Pixels of one image as decoded, padded or resized, checked before each (image_too_large)."""
    max_image_decode_seconds: float = DEFAULT_MAX_IMAGE_DECODE_SECONDS
    """CPU seconds to decode one image; a slower decode is stopped and skipped (image_too_slow)."""
    max_images_per_record: int = DEFAULT_MAX_IMAGES_PER_RECORD
    """Images (and <image> placeholders) of one record; more is skipped before any is read (too_many_images)."""
    allow_outside_image_folder: bool = False
    """Accept absolute image names, '..' and symlinks leading out of image_folder."""

    # --- training side: THD alignment and data-parallel balance ---
    pad_to_multiple_of: int | None = None
    """Pad every sample to a multiple of this (before packing); combined (lcm) with what
    context_parallel_size / tensor_parallel_size / sequence_parallel need."""
    context_parallel_size: int = 1
    """Megatron-Core CP size the packs are for: samples are padded to a multiple of 2·CP when > 1."""
    tensor_parallel_size: int = 1
    """Megatron-Core TP size; with sequence_parallel, samples are padded to a multiple of CP·TP."""
    sequence_parallel: bool = False
    """Megatron-Core sequence parallelism is on (see tensor_parallel_size)."""
    pad_id: int = 0
    """Token id of padding positions (their label is ignore_index)."""
    balance_data_parallel: int | None = None
    """Order packs so every N consecutive packs (one micro-step on N data-parallel ranks) cost alike."""
    # --- tokenization conventions ---
    tokenization: str = "nemo"
    """Convention the token ids follow, a name from templates.TOKENIZATIONS: nemo (NeMo NeVA's
    preprocessing, the default since the command line is NeMo's) or llava (LLaVA-1.5's)."""
    # --- output format ---
    output_format: str = DEFAULT_FORMAT
    """nemo: NeMo's float32 packed_seq_dataset (what data_prefix reads); compact: int32 ids and uint8
    images stored once (the sample store's pool), normalised when read (neva_pack.dataset)."""
    drop_store: bool = False
    """nemo only: remove the sample store once every prefix is published and verified (plan/stats
    then read the plan tables; re-packing needs a new run)."""

    # --- sharded preprocessing (issue 12; neva_pack.shards) -----------------------------------
    num_shards: int | None = None
    """Split the records into this many contiguous ranges, one per node (e.g. a SLURM job array)."""
    shard_index: int | None = None
    """Encode only this shard's range into its own store part; None with num_shards: the final step
    that joins the parts, packs and writes (the same bytes as a run without shards)."""

    def __post_init__(self):
        _check_types(self)
        for name in ("data_path", "output_dir", "tokenizer_path", "image_folder"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        if not self.data_path.is_file():
            what = "no such file" if not self.data_path.exists() else "not a regular file (a directory, device or FIFO)"
            raise ConfigError(f"--data_path {self.data_path}: {what}")
        if not self.tokenizer_path.exists():
            raise ConfigError(f"--tokenizer_path {self.tokenizer_path}: no such file or directory")
        if self.image_folder is not None and not self.image_folder.exists():
            raise ConfigError(f"--image_folder {self.image_folder}: no such directory or archive")
        output_format = FORMATS.get(self.output_format)  # an unknown one is refused below
        if output_format is not None:  # the format's limits: the largest pack, id and label it stores exactly
            output_format.check_settings(max_seq_length=self.max_seq_length)
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"--seed {self.seed}: must be between 0 and 2**63 - 1")
        if output_format is not None:
            output_format.check_settings(ignore_index=self.ignore_index)
        for name in ("max_record_bytes", "max_record_depth", "max_conversation_chars", "max_image_bytes",
                     "max_image_pixels", "max_images_per_record"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be >= 1")
        if not 0 < self.max_image_decode_seconds < float("inf"):
            raise ConfigError(f"--max_image_decode_seconds {self.max_image_decode_seconds}: must be a number above 0")
        if self.max_record_depth > MAX_RECORD_DEPTH_LIMIT:
            raise ConfigError(
                f"--max_record_depth {self.max_record_depth}: at most {MAX_RECORD_DEPTH_LIMIT} (the JSON parser recurses per level)"
            )
        from neva_pack.packing import ALGORITHMS  # light: numba kernels compile on first call only

        if self.packing_algorithm not in ALGORITHMS:
            raise ConfigError(
                f"--packing_algorithm {self.packing_algorithm!r}: choose one of {', '.join(sorted(ALGORITHMS))}"
            )
        if self.image_aspect_ratio not in IMAGE_ASPECT_RATIOS:
            raise ConfigError(
                f"--image_aspect_ratio {self.image_aspect_ratio!r}: choose one of {', '.join(IMAGE_ASPECT_RATIOS)}"
            )
        from neva_pack.templates import TOKENIZATIONS

        if self.tokenization not in TOKENIZATIONS:
            raise ConfigError(f"--tokenization {self.tokenization!r}: choose one of {', '.join(TOKENIZATIONS)}")
        if not 0 <= self.num_workers <= max_workers():
            raise ConfigError(
                f"--num_workers {self.num_workers}: must be between 0 and {max_workers()} "
                f"(4 per CPU, at least 16; this machine has {_usable_cpus()} CPU(s))"
            )
        if not 0 <= self.max_skip_fraction <= 1:
            raise ConfigError(f"--max_skip_fraction {self.max_skip_fraction}: must be between 0 and 1")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")
        for name in ("global_batch_size", "patch_dim", "max_samples_per_pack", "checkpoint_every",
                     "pad_to_multiple_of", "context_parallel_size", "tensor_parallel_size", "balance_data_parallel"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} {value}: must be >= 1")
        if output_format is None:
            raise ConfigError(f"--output_format {self.output_format!r}: choose one of {', '.join(sorted(FORMATS))}")
        if self.drop_store and output_format.uses_image_pool:
            raise ConfigError(f"--drop_store: the {self.output_format} output's images ARE the sample store's pool; nothing to drop")
        if self.num_shards is not None or self.shard_index is not None:
            from neva_pack.shards import resolve_shards

            resolve_shards(self.num_shards, self.shard_index, environ={})  # validates, no defaults here
        if self.crop_size is not None:
            object.__setattr__(self, "crop_size", tuple(int(v) for v in self.crop_size))
        if self.pack_sizes is not None:
            sizes = tuple(sorted({int(v) for v in self.pack_sizes}))
            output_format.check_settings(pack_sizes=list(self.pack_sizes))
            object.__setattr__(self, "pack_sizes", sizes)
            object.__setattr__(self, "max_seq_length", sizes[-1])
        if self.pad_id < 0:
            raise ConfigError(f"--pad_id {self.pad_id}: must be >= 0")
        if self.alignment > self.sizes[0]:
            raise ConfigError(
                f"samples padded to a multiple of {self.alignment} (--pad_to_multiple_of / parallel sizes) "
                f"cannot fit packs of {self.sizes[0]} positions"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The pack sizes to write, smallest first."""
        return self.pack_sizes or (self.max_seq_length,)

    @property
    def alignment(self) -> int:
        """M: every sample's packed length is a multiple of it (1: no padding)."""
        from neva_pack.packing.alignment import alignment_multiple

        return alignment_multiple(
            self.pad_to_multiple_of, self.context_parallel_size, self.tensor_parallel_size, self.sequence_parallel
        )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


_EXPECTED = {
    "Path": ("a path", lambda v: isinstance(v, (str, os.PathLike))),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple[int, int]": (
        "a list of 2 integers (height, width)",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_EXPECTED["int"][1](x) for x in v),
    ),
    "tuple[int, ...]": (
        "a list of integers",
        lambda v: isinstance(v, (list, tuple)) and all(_EXPECTED["int"][1](x) for x in v),
    ),
}
"""Annotation of a field -> (what it must be, in words; the test). Values from a YAML hparams file or
the Python API arrive untyped: a wrong type is refused here, naming the field, not deep in the run."""


def _check_types(config: PreprocessConfig) -> None:
    for spec in fields(config):
        value = getattr(config, spec.name)
        base = spec.type.removesuffix(" | None")
        if value is None and base != spec.type:
            continue
        words, test = _EXPECTED[base]
        if not test(value):
            raise ConfigError(f"{_setting_name(spec.name)} {value!r:.60}: expected {words}, got {type(value).__name__}")


HPARAMS_ONLY = {"crop_size"}
"""Fields set only from --hparams_file (no flag of their own)."""


def _setting_name(name: str) -> str:
    """How a user sets a field: its flag, and the NeMo hparams key that sets it too, if any."""
    key = next((".".join(keys) for keys, field_name in HPARAMS_KEYS.items() if field_name == name), None)
    if name in HPARAMS_ONLY and key:
        return f"hparams {key}"
    return f"--{name}" + (f" (or hparams {key})" if key else "")


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
    ("model", "context_parallel_size"): "context_parallel_size",
    ("model", "tensor_model_parallel_size"): "tensor_parallel_size",
    ("model", "sequence_parallel"): "sequence_parallel",
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
    data = read_yaml(path, what="--hparams_file")
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
