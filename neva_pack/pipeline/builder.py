"""What makes the samples: the sample builder from the config (every ConfigError surfaces here), the
settings fingerprint a resumed store must match, and what every pack of a size must satisfy."""

from __future__ import annotations

import sys
from pathlib import Path

from neva_pack import invariants
from neva_pack.config import PreprocessConfig
from neva_pack.encoders import resolve_encoder
from neva_pack.errors import ConfigError
from neva_pack.formats import output_format
from neva_pack.images import ImagePreprocessor, ImageSource
from neva_pack.packing.alignment import aligned_capacity
from neva_pack.records import RecordLimits
from neva_pack.samples import SampleBuilder, check_token_ids, image_run_for, missing_nemo_specials
from neva_pack.templates import load_template
from neva_pack.tokenizer import load_tokenizer

__all__ = ["build_sample_builder", "pack_spec"]


def build_sample_builder(config: PreprocessConfig) -> SampleBuilder:
    """Load tokenizer, template, encoder settings and image source: every ConfigError surfaces here."""
    tokenizer = load_tokenizer(config.tokenizer_path)
    template = load_template(config.conv_template, config.tokenization)
    encoder = resolve_encoder(config.hf_vision_encoder, config.patch_dim)
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
    output_format(config.output_format).check_settings(vocab_size=tokenizer.vocab_size)
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
        text_only=not output_format(config.output_format).holds_images,
    )


def pack_spec(config: PreprocessConfig, builder: SampleBuilder, size: int) -> invariants.PackSpec:
    """What every pack of this run must satisfy (checked before each is written)."""
    return invariants.PackSpec(
        max_seq_length=size,
        ignore_index=config.ignore_index,
        image_run=builder.image_run,
        pad_id=config.pad_id,
    )
