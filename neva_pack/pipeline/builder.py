"""What makes the samples: the sample builder from the config (every ConfigError surfaces here), the
settings fingerprint a resumed store must match, and what every pack of a size must satisfy."""

from __future__ import annotations

import sys

from neva_pack import invariants
from neva_pack.config import PreprocessConfig
from neva_pack.encoders import resolve_encoder
from neva_pack.errors import ConfigError
from neva_pack.formats import FORMATS, output_format
from neva_pack.image_ids import check_token_ids, dynamic_image_run, image_run_for, missing_nemo_specials
from neva_pack.image_run import ImageRun
from neva_pack.images import DynamicProcessor, ImagePreprocessor, ImageSource, dynamic_processor
from neva_pack.records import RecordLimits
from neva_pack.samples import SampleBuilder
from neva_pack.templates import load_template
from neva_pack.tokenizer import load_tokenizer

__all__ = ["build_sample_builder", "pack_spec"]


def build_sample_builder(config: PreprocessConfig) -> SampleBuilder:
    """Load tokenizer, template, encoder settings and image source: every ConfigError surfaces here."""
    tokenizer = load_tokenizer(config.tokenizer_path)
    template = load_template(config.conv_template, config.tokenization)
    encoder = resolve_encoder(config.hf_vision_encoder, config.patch_dim)
    fmt = output_format(config.output_format)
    if encoder.family == "fixed":
        preprocessor, image_run = _fixed_images(config, tokenizer, template, encoder)
    else:
        preprocessor, image_run = _dynamic_images(config, tokenizer, encoder, fmt)
    fmt.check_settings(vocab_size=tokenizer.vocab_size)
    check_token_ids(image_run, tokenizer.vocab_size, pad_id=config.pad_id, ignore_index=config.ignore_index)
    image_source = ImageSource(
        config.image_folder, max_bytes=config.max_image_bytes, allow_outside=config.allow_outside_image_folder
    )
    return SampleBuilder(
        tokenizer=tokenizer,
        template=template,
        image_source=image_source,
        preprocessor=preprocessor,
        image_run=image_run,
        max_seq_length=config.cut_length,
        truncate=config.truncate,
        ignore_index=config.ignore_index,
        system_prompt=config.system_prompt,
        tokenization=config.tokenization,
        record_limits=RecordLimits(max_bytes=config.max_record_bytes, max_depth=config.max_record_depth),
        max_conversation_chars=config.max_conversation_chars,
        max_image_pixels=config.max_image_pixels,
        max_image_decode_seconds=config.max_image_decode_seconds,
        max_images_per_record=config.max_images_per_record,
        text_only=not fmt.holds_images,
    )


def _fixed_images(config: PreprocessConfig, tokenizer, template, encoder) -> tuple[ImagePreprocessor, ImageRun]:
    """A fixed-crop encoder (CLIP, SigLIP): one crop and one run length for every image."""
    if config.min_pixels is not None or config.max_pixels is not None:
        raise ConfigError(f"--min_pixels / --max_pixels: {encoder.name} is a fixed-crop encoder, not a Qwen2-VL one")
    if config.crop_size is not None and tuple(config.crop_size) != encoder.crop_size:
        raise ConfigError(
            f"crop_size {list(config.crop_size)} disagrees with {encoder.name}'s processor ({list(encoder.crop_size)})"
        )
    preprocessor = ImagePreprocessor(encoder, config.image_aspect_ratio, max_pixels=config.max_image_pixels)
    image_run = image_run_for(
        tokenizer,
        encoder.image_tokens,
        use_im_start_end=config.use_im_start_end,
        patch_id=config.image_patch_id,
        start_id=config.image_start_id,
        end_id=config.image_end_id,
        tokenization=config.tokenization,
        patch_token=template.image_patch_token,
    )
    problem = missing_nemo_specials(tokenizer, config.tokenization, image_run)
    if problem is not None:
        if config.strict:
            raise ConfigError(f"--strict: {problem}")
        print(f"warning: {problem}", file=sys.stderr)
    if len(config.sizes) > 1 and config.sizes[0] < image_run.positions + 2:
        raise ConfigError(
            f"--pack_sizes {list(config.sizes)}: every size must hold an image run ({image_run.positions} positions) "
            "and a token more, or a sample cut for it could be left empty"
        )
    return preprocessor, image_run


def _dynamic_images(config: PreprocessConfig, tokenizer, encoder, fmt) -> tuple[DynamicProcessor, ImageRun]:
    """A dynamic-resolution encoder (LLaVA-NeXT / OneVision anyres, Qwen2-VL native): each image its own
    size and run length, spelled with the model's image tokens; only outputs that hold such images."""
    if fmt.holds_images and not getattr(fmt, "holds_dynamic_images", False):
        able = sorted(name for name, other in FORMATS.items() if getattr(other, "holds_dynamic_images", False))
        raise ConfigError(
            f"--output_format {fmt.name}: holds fixed-size images only, and {encoder.name}'s images each have their "
            f"own size; use --output_format {' or '.join(able) if able else 'compact'}"
        )
    if config.use_im_start_end or config.image_aspect_ratio != "square":
        raise ConfigError(
            f"--use_im_start_end / --image_aspect_ratio: {encoder.name}'s processor decides how its images are laid out"
        )
    arithmetic = "llava" if config.tokenization == "llava" else "transformers"  # LLaVA's llava_arch counts, or the HF models'
    processor = dynamic_processor(encoder, arithmetic=arithmetic, min_pixels=config.min_pixels, max_pixels=config.max_pixels)
    image_run = dynamic_image_run(
        tokenizer, encoder.family, patch_id=config.image_patch_id, start_id=config.image_start_id, end_id=config.image_end_id
    )
    return processor, image_run


def pack_spec(config: PreprocessConfig, builder: SampleBuilder, size: int) -> invariants.PackSpec:
    """What every pack of this run must satisfy (checked before each is written)."""
    return invariants.PackSpec(
        max_seq_length=size,
        ignore_index=config.ignore_index,
        image_run=builder.image_run,
        pad_id=config.pad_id,
    )
