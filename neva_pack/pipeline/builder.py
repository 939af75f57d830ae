"""What makes the samples: the sample builder from the config (every ConfigError surfaces here), the
settings fingerprint a resumed store must match, and what every pack of a size must satisfy."""

from __future__ import annotations

import sys

from neva_pack.packing import invariants
from neva_pack.config import PackConfig, PreprocessConfig, SampleConfig
from neva_pack.families import resolve_encoder
from neva_pack.core import ConfigError
from neva_pack.formats import check_dynamic_images, output_format
from neva_pack.families import check_token_ids, dynamic_image_run, image_run_for, missing_nemo_specials
from neva_pack.core import ImageRun
from neva_pack.families import DynamicProcessor, ImagePreprocessor, ImageSource, dynamic_processor
from neva_pack.records import RecordLimits
from neva_pack.samples import SampleBuilder
from neva_pack.text import load_template
from neva_pack.text import load_tokenizer

__all__ = ["build_sample_builder", "pack_spec", "sample_builder_for"]


def build_sample_builder(config: PreprocessConfig) -> SampleBuilder:
    """Load tokenizer, template, encoder settings and image source: every ConfigError surfaces here."""
    return sample_builder_for(config.sample, config.pack, strict=config.strict)


def sample_builder_for(sample: SampleConfig, pack: PackConfig, *, strict: bool = False) -> SampleBuilder:
    """The sample builder of the settings that make a sample and the pack sizes it cuts them for
    (``neva-pack plan`` lays records out with it before there is any output). ``strict``: a NeMo
    convention without NeMo's image tokens is an error, not a warning."""
    tokenizer = load_tokenizer(sample.tokenizer_path)
    template = load_template(sample.conv_template, sample.tokenization)
    encoder = resolve_encoder(sample.hf_vision_encoder, sample.patch_dim)
    fmt = output_format(pack.output_format)
    if encoder.family == "fixed":
        preprocessor, image_run = _fixed_images(sample, pack.sizes, strict, tokenizer, template, encoder)
    else:
        preprocessor, image_run = _dynamic_images(sample, tokenizer, encoder, fmt)
    fmt.check_settings(vocab_size=tokenizer.vocab_size)
    check_token_ids(image_run, tokenizer.vocab_size, pad_id=pack.pad_id, ignore_index=sample.ignore_index)
    image_source = ImageSource(
        sample.image_folder, max_bytes=sample.max_image_bytes, allow_outside=sample.allow_outside_image_folder
    )
    return SampleBuilder(
        tokenizer=tokenizer,
        template=template,
        image_source=image_source,
        preprocessor=preprocessor,
        image_run=image_run,
        max_seq_length=pack.cut_length,
        truncate=sample.truncate,
        ignore_index=sample.ignore_index,
        system_prompt=sample.system_prompt,
        tokenization=sample.tokenization,
        record_limits=RecordLimits(max_bytes=sample.max_record_bytes, max_depth=sample.max_record_depth),
        max_conversation_chars=sample.max_conversation_chars,
        max_image_pixels=sample.max_image_pixels,
        max_image_decode_seconds=sample.max_image_decode_seconds,
        max_images_per_record=sample.max_images_per_record,
        text_only=not fmt.holds_images,
    )


def _fixed_images(
    sample: SampleConfig, sizes: tuple[int, ...], strict: bool, tokenizer, template, encoder
) -> tuple[ImagePreprocessor, ImageRun]:  # fmt: skip
    """A fixed-crop encoder (CLIP, SigLIP): one crop and one run length for every image."""
    if sample.min_pixels is not None or sample.max_pixels is not None:
        raise ConfigError(f"--min_pixels / --max_pixels: {encoder.name} is a fixed-crop encoder, not a Qwen2-VL one")
    if sample.crop_size is not None and tuple(sample.crop_size) != encoder.crop_size:
        raise ConfigError(
            f"crop_size {list(sample.crop_size)} disagrees with {encoder.name}'s processor ({list(encoder.crop_size)})"
        )
    preprocessor = ImagePreprocessor(encoder, sample.image_aspect_ratio, max_pixels=sample.max_image_pixels)
    image_run = image_run_for(
        tokenizer,
        encoder.image_tokens,
        use_im_start_end=sample.use_im_start_end,
        patch_id=sample.image_patch_id,
        start_id=sample.image_start_id,
        end_id=sample.image_end_id,
        tokenization=sample.tokenization,
        patch_token=template.image_patch_token,
    )
    problem = missing_nemo_specials(tokenizer, sample.tokenization, image_run)
    if problem is not None:
        if strict:
            raise ConfigError(f"--strict: {problem}")
        print(f"warning: {problem}", file=sys.stderr)
    if len(sizes) > 1 and sizes[0] < image_run.positions + 2:
        raise ConfigError(
            f"--pack_sizes {list(sizes)}: every size must hold an image run ({image_run.positions} positions) "
            "and a token more, or a sample cut for it could be left empty"
        )
    return preprocessor, image_run


def _dynamic_images(sample: SampleConfig, tokenizer, encoder, fmt) -> tuple[DynamicProcessor, ImageRun]:
    """A dynamic-resolution encoder (LLaVA-NeXT / OneVision anyres, Qwen2-VL native): each image its own
    size and run length, spelled with the model's image tokens; only outputs that hold such images."""
    check_dynamic_images(fmt.name, encoder.name)
    if sample.use_im_start_end or sample.image_aspect_ratio != "square":
        raise ConfigError(
            f"--use_im_start_end / --image_aspect_ratio: {encoder.name}'s processor decides how its images are laid out"
        )
    arithmetic = "llava" if sample.tokenization == "llava" else "transformers"  # LLaVA's llava_arch counts, or the HF models'
    processor = dynamic_processor(encoder, arithmetic=arithmetic, min_pixels=sample.min_pixels, max_pixels=sample.max_pixels)
    image_run = dynamic_image_run(
        tokenizer, encoder.family, patch_id=sample.image_patch_id, start_id=sample.image_start_id, end_id=sample.image_end_id
    )
    return processor, image_run


def pack_spec(pack: PackConfig, builder: SampleBuilder, size: int) -> invariants.PackSpec:
    """What every pack of this run must satisfy (checked before each is written)."""
    return invariants.PackSpec(
        max_seq_length=size,
        ignore_index=builder.ignore_index,
        image_run=builder.image_run,
        pad_id=pack.pad_id,
    )
