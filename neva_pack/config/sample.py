"""What makes a sample: the input, the tokenizer and template, the image encoder, the token ids and
the per-record budgets. Change any of these and the sample store must be built again; a --resume
compares them (``fingerprint``) before continuing one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neva_pack.config.budgets import RecordBudgets
from neva_pack.config.options import NEMO, check_fields, nested, option, options, value_of
from neva_pack.core import ConfigError, IGNORE_INDEX, VERSION
from neva_pack.families import IMAGE_REFERENCES
from neva_pack.sample_store import FRAME_CODECS
from neva_pack.text import DEFAULT_TOKENIZATION, TOKENIZATIONS
from neva_pack.files import is_remote

IMAGE_ASPECT_RATIOS = ("square", "pad")
MODEL = ("model",)
MM = ("model", "mm_cfg")
ENCODER = ("model", "mm_cfg", "vision_encoder")


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleConfig:
    """The fields' order is the sample fingerprint's key order (the sample store records it)."""

    data_path: Path = option(
        help="LLaVA-format JSON list or JSONL (or an s3:// URL)", group=NEMO, hparams=(*MODEL, "data", "data_path"),
        location=True, remote=True,
    )
    """LLaVA-format JSON list or JSONL."""
    image_folder: Path | None = option(
        None, help="image directory or .tar archive (or an s3:// prefix or .tar)", group=NEMO,
        hparams=(*MODEL, "data", "image_folder"), location=True, remote=True,
    )
    """Directory or .tar archive the records' image paths are relative to."""
    tokenizer_path: Path = option(
        help="SentencePiece .model file or Hugging Face tokenizer directory", group=NEMO,
        hparams=(*MODEL, "tokenizer", "model"), location=True,
    )  # fmt: skip
    """SentencePiece .model file or Hugging Face tokenizer directory."""
    conv_template: str = option(
        "plain", help="conversation template name or YAML file (default {default})", group=NEMO,
        hparams=(*MODEL, "data", "conv_template"), location=True,
    )  # fmt: skip
    """A template name from templates/ or a path to a template YAML."""
    hf_vision_encoder: str = option(
        "openai/clip-vit-large-patch14-336", group=NEMO, hparams=(*ENCODER, "from_pretrained"), location=True,
        help="shipped encoder name or local directory with preprocessor_config.json (default {default})",
    )  # fmt: skip
    """A shipped encoder name or a local directory with preprocessor_config.json."""
    image_aspect_ratio: str = option(
        "square", help="default {default}", group=NEMO, hparams=(*MODEL, "data", "image_aspect_ratio"),
        choices=lambda: IMAGE_ASPECT_RATIOS,
    )  # fmt: skip
    """square: resize + centre crop; pad: pad to a square with the mean colour first (LLaVA-1.5)."""
    truncate: bool = option(True, help="skip over-long samples instead", flag="--no_truncate")
    """Cut samples longer than the largest pack size (NeMo); False: skip them as too_long."""
    ignore_index: int = option(IGNORE_INDEX, help="label of untrained positions (default {default})", written_as="ignore_index")
    """Label value of untrained positions (NeMo's collate masks -1). The samples' labels carry it."""
    use_im_start_end: bool = option(False, help="NeMo mm_cfg.use_im_start_end", hparams=(*MM, "use_im_start_end"))
    """NeMo's mm_cfg.use_im_start_end: image run = start + N patches + end instead of N positions."""
    patch_dim: int | None = option(
        None, help="override the encoder's patch size", hparams=(*ENCODER, "patch_dim"), minimum=1
    )
    """Override of the encoder's patch size (positions per image = (crop / patch)^2)."""
    image_patch_id: int | None = option(
        None, help="token id of image positions (default 0, or <extra_id_3> where NeMo keeps it)", fingerprint="image_ids"
    )
    """Token id of image-embedding positions; default 0, or NeMo's <extra_id_3> id where NeMo's
    template leaves it (plain, llama_3, nvgpt, yi_34b under --tokenization nemo)."""
    image_start_id: int | None = option(
        None, help="token id opening an image (default <extra_id_4> if any)", fingerprint="image_ids"
    )
    """Token id opening an image run; default: the tokenizer's <extra_id_4> if any."""
    image_end_id: int | None = option(
        None, help="token id closing an image (default <extra_id_5> if any)", fingerprint="image_ids"
    )
    """Token id closing an image run; default: the tokenizer's <extra_id_5> if any."""
    system_prompt: str | None = option(None, help="replace the template's system prompt")
    """Replaces the template's default system prompt."""
    tokenization: str = option(
        DEFAULT_TOKENIZATION, choices=lambda: TOKENIZATIONS,
        help="token convention (default {default}): " + "; ".join(f"{t.name}: {t.description}" for t in TOKENIZATIONS.values()),
    )  # fmt: skip
    """Convention the token ids follow, a name from templates.TOKENIZATIONS: nemo (NeMo NeVA's
    preprocessing, the default since the command line is NeMo's) or llava (LLaVA-1.5's)."""
    min_pixels: int | None = option(
        None, minimum=1, fingerprint_when_set=True,
        help="native-resolution encoders: smallest resized image area in pixels (default: the encoder's preprocessor_config)",
    )  # fmt: skip
    """Native-resolution encoders (Qwen2-VL): the smallest area an image is resized to (smart_resize)."""
    max_pixels: int | None = option(
        None, minimum=1, fingerprint_when_set=True,
        help="native-resolution encoders: largest resized image area in pixels (default: the encoder's preprocessor_config)",
    )  # fmt: skip
    """Native-resolution encoders (Qwen2-VL): the largest area an image is resized to (the released
    checkpoints' 12,845,056; transformers' class default 1,003,520)."""
    max_soft_tokens: int | None = option(
        None, minimum=1, fingerprint_when_set=True,
        help="soft-token budget per image, for families that resize each image to one (default: the encoder's preprocessor_config)",
    )  # fmt: skip
    """Families whose processor resizes each image to fit a feature-token budget: the most tokens one
    image may take (the family checks the values its processor accepts)."""
    video_profile: str | None = option(
        None, fingerprint_when_set=True,
        help="read <video> clips (encoders whose family reads video), sampled and sized as this reference does: hf "
        "(transformers' video processors), hf_cap (theirs with cap_pixels_per_frame), or another reference's "
        "own code (docs/video.md: the model authors', LLaMA-Factory's); without it a record with a clip is skipped (videos_not_read)",
    )  # fmt: skip
    """Whose arithmetic samples and sizes video clips (the family's profiles); None: clips are not read."""
    video_fps: float | None = option(
        None, fingerprint_when_set=True, help="frames sampled per second of video (default: the profile's)"
    )  # fmt: skip
    """Frames sampled per second of a clip; None: the profile's default (2)."""
    video_max_frames: int | None = option(
        None, minimum=1, fingerprint_when_set=True, help="frames sampled from one clip at most (default: the profile's)"
    )  # fmt: skip
    """Frames sampled from one clip at most; None: the profile's default."""
    frame_compression: str | None = option(
        None, choices=lambda: ("none", *FRAME_CODECS), fingerprint_when_set=True,
        help="store the resized frames of video clips (and the images of the same dynamic-resolution pool) "
        "compressed, losslessly: zstd (read back bit-identical; compact only; docs/video.md), or none (default: raw uint8)",
    )  # fmt: skip
    """The codec the sample store's dynamic image pool (every clip's frames, every image at its own size)
    is compressed with (sample_store/frame_codec.py); None (or "none"): raw uint8, as before the flag."""
    image_reference: str | None = option(
        None, choices=lambda: IMAGE_REFERENCES, fingerprint_when_set=True,
        help=lambda: "whose image preprocessing the counts and pixels follow, for families that offer a choice: transformers "
                     f"(the Hugging Face processor, the default) or another's own code ({', '.join(IMAGE_REFERENCES[1:])})",
    )  # fmt: skip
    """Families offering a choice (``ModelFamily.references``): the reference their image sizes, token
    counts and pixels follow; None: the Hugging Face processor. Recorded with the output (its image
    processor's ``arithmetic``)."""
    budgets: RecordBudgets = nested(RecordBudgets)
    """What one record may cost, and where its images may be (config/budgets.py): each a flag of its own
    (--max_record_bytes, ...), in the fingerprint's ``budgets`` list in their order."""
    crop_size: tuple[int, int] | None = option(None, help=None, hparams=(*ENCODER, "crop_size"), fingerprint="")
    """Expected (H, W) from a NeMo config; must agree with the encoder's processor (a check: the
    encoder, which decides the pixels, is in the fingerprint)."""

    def __post_init__(self):
        if self.frame_compression == "none":  # the default spelled out: the same run, the same fingerprint
            object.__setattr__(self, "frame_compression", None)
        if not isinstance(self.budgets, RecordBudgets):
            raise ConfigError(f"budgets {self.budgets!r:.60}: expected a RecordBudgets, got {type(self.budgets).__name__}")
        check_fields(self)
        if is_remote(self.data_path):
            pass  # copied into the staging directory when a run starts (pipeline/staging.py), or refused then
        elif not self.data_path.is_file():
            what = "no such file" if not self.data_path.exists() else "not a regular file (a directory, device or FIFO)"
            raise ConfigError(f"--data_path {self.data_path}: {what}")
        if not self.tokenizer_path.exists():
            raise ConfigError(f"--tokenizer_path {self.tokenizer_path}: no such file or directory")
        if self.image_folder is not None and not is_remote(self.image_folder) and not self.image_folder.exists():
            raise ConfigError(f"--image_folder {self.image_folder}: no such directory or archive")
        if self.video_fps is not None and not 0 < self.video_fps < float("inf"):
            raise ConfigError(f"--video_fps {self.video_fps}: must be a number above 0")
        if self.video_profile is None and (self.video_fps, self.video_max_frames) != (None, None):
            raise ConfigError("--video_fps / --video_max_frames need --video_profile (hf)")

    def fingerprint(self, cut_length: int) -> dict:
        """Everything that decides the samples, as the sample store records it: every setting in
        field order (a nested group's, such as the budgets, in its place), paths resolved (the data file with its size and mtime), fields sharing a key
        (``Option.fingerprint``) gathered in one list, the length samples are cut to before
        ``truncate``, and this package's version. A resumed run must match it exactly."""
        out: dict = {}
        for spec, opt in options(self):
            value = value_of(self, spec.name)
            if opt.fingerprint == "" or (opt.fingerprint_when_set and value is None):
                continue
            if spec.name == "truncate":
                out["max_seq_length"] = cut_length
            if isinstance(value, Path):
                value = str(value.resolve())
            if opt.fingerprint is not None:
                out.setdefault(opt.fingerprint, []).append(value)
            else:
                out[spec.name] = value
            if spec.name == "data_path" and not is_remote(self.data_path):
                stat = self.data_path.resolve().stat()
                out["data_size"], out["data_mtime_ns"] = stat.st_size, stat.st_mtime_ns
        out["neva_pack"] = VERSION
        return out

    @classmethod
    def location_keys(cls) -> tuple[str, ...]:
        """Fingerprint keys naming a file or a setting by location or name (the data file's size and
        mtime included): a sharded run's content fingerprint replaces them by content digests."""
        names = tuple(spec.name for spec, opt in options(cls) if opt.location)
        return names[:1] + ("data_size", "data_mtime_ns") + names[1:]


__all__ = ["IMAGE_ASPECT_RATIOS", "RecordBudgets", "SampleConfig"]
