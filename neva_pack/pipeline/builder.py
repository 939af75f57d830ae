"""What makes the samples: the sample builder from the config (every ConfigError surfaces here), the
settings fingerprint a resumed store must match, and what every pack of a size must satisfy."""

from __future__ import annotations

import sys

from neva_pack.packing import invariants
from neva_pack.config import PackConfig, PreprocessConfig, SampleConfig
from neva_pack.core import ConfigError, ImageRun
from neva_pack.formats import check_dynamic_images, output_format
from neva_pack.families import (
    FamilyOptions, ImageSource, ModelFamily, RunRequest, VideoRequest, check_token_ids, missing_nemo_specials, model_family,
    resolve_encoder,
)  # fmt: skip
from neva_pack.records import RecordLimits
from neva_pack.samples import SampleBuilder
from neva_pack.text import load_template, load_tokenizer

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
    preprocessor, image_run = _family_images(sample, pack.sizes, strict, tokenizer, template, encoder, fmt)
    fmt.check_settings(vocab_size=tokenizer.vocab_size)
    check_token_ids(image_run, tokenizer.vocab_size, pad_id=pack.pad_id, ignore_index=sample.ignore_index,
                    specials={"BOS": tokenizer.bos_id, "EOS": tokenizer.eos_id})  # fmt: skip
    budgets = sample.budgets
    image_source = ImageSource(
        sample.image_folder, max_bytes=budgets.max_image_bytes, allow_outside=budgets.allow_outside_image_folder
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
        record_limits=RecordLimits(max_bytes=budgets.max_record_bytes, max_depth=budgets.max_record_depth),
        max_conversation_chars=budgets.max_conversation_chars,
        max_image_pixels=budgets.max_image_pixels,
        max_image_decode_seconds=budgets.max_image_decode_seconds,
        max_images_per_record=budgets.max_images_per_record,
        text_only=not fmt.holds_images,
    )


def _family_images(
    sample: SampleConfig, sizes: tuple[int, ...], strict: bool, tokenizer, template, encoder, fmt
) -> tuple[ModelFamily, ImageRun]:  # fmt: skip
    """The encoder's family with the command line's image options, and its image run for this
    tokenizer: one crop and one run length for every image, or each image its own size and run
    (only outputs that hold such images)."""
    options = FamilyOptions(
        aspect_ratio=sample.image_aspect_ratio,
        max_image_pixels=sample.budgets.max_image_pixels,
        crop_size=None if sample.crop_size is None else tuple(sample.crop_size),
        use_im_start_end=sample.use_im_start_end,
        tokenization=sample.tokenization,
        min_pixels=sample.min_pixels,
        max_pixels=sample.max_pixels,
        max_soft_tokens=sample.max_soft_tokens,
        reference=sample.image_reference,
    )
    family = model_family(encoder, options)
    if family.own_size:
        check_dynamic_images(fmt.name, encoder.name)
    if sample.frame_compression is not None:
        if not family.own_size:
            raise ConfigError(f"--frame_compression {sample.frame_compression}: {encoder.name} crops every image to one size "
                              "(a fixed pool, read in place); only a dynamic-resolution encoder's pool (its clips' frames, "
                              "its images) is compressed")  # fmt: skip
        if not fmt.uses_image_pool:
            raise ConfigError(f"--frame_compression {sample.frame_compression}: --output_format {fmt.name} writes its frames "
                              "into its own files as uint8; only a format reading the sample store's pool in place "
                              "(compact) reads it compressed")  # fmt: skip
    if sample.video_profile is not None:  # the family reads clips as asked (ConfigError: one that reads none)
        if not fmt.holds_videos:
            raise ConfigError(f"--video_profile: --output_format {fmt.name} holds no video clip (compact and energon do)")
        video = VideoRequest(profile=sample.video_profile, fps=sample.video_fps, max_frames=sample.video_max_frames)
        family = family.with_videos(video, tokenizer)
    request = RunRequest(
        patch_id=sample.image_patch_id,
        start_id=sample.image_start_id,
        end_id=sample.image_end_id,
        use_im_start_end=sample.use_im_start_end,
        tokenization=sample.tokenization,
        patch_token=template.image_patch_token,
    )
    image_run = family.image_run(tokenizer, request)
    if image_run.positions is not None:
        _check_fixed_run(image_run, sample, sizes, strict, tokenizer)
    return family, image_run


def _check_fixed_run(image_run: ImageRun, sample: SampleConfig, sizes: tuple[int, ...], strict: bool, tokenizer) -> None:
    """A run of one length for every image: NeMo's convention without NeMo's image tokens is a
    warning (an error under ``--strict``), and every pack size must hold a run and a token more."""
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


def pack_spec(pack: PackConfig, builder: SampleBuilder, size: int) -> invariants.PackSpec:
    """What every pack of this run must satisfy (checked before each is written)."""
    return invariants.PackSpec(
        max_seq_length=size,
        ignore_index=builder.ignore_index,
        image_run=builder.image_run,
        pad_id=pack.pad_id,
    )
