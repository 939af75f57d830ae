"""Gemma 4 images: each image resized, keeping its aspect ratio, to fit a soft-token budget.

    size --fit to max_soft_tokens * 9 patches of 16 px, sides multiples of 48--> (H, W)
    tokens = (H / 16)(W / 16) / 9                    one <|image|> per 3 x 3 pooled patch
    RGB PIL --resize to (W, H), bicubic--> uint8 (3, H, W)          in workers, stored
    uint8 --rescale 1/255, patchify, pad to the budget--> float32 (max_patches, 768)   at read time

The resize is transformers' ``get_aspect_ratio_preserving_size``: the area scaled to the budget's
``max_soft_tokens * 9 * 16**2`` pixels, each side floored to a multiple of 48 (pooling 3 x patch 16);
a side that floors to 0 becomes 48 and the other ``floor(long / short) * 48``, at most
``max_soft_tokens * 48`` (the reference's refusals, both sides floored to 0 or the area over the
budget, are kept as it has them, though no real size reaches them). A 480 x 640 photo at the
default budget of 280 becomes 672 x 912: 42 x 57 patches, 266 soft tokens.

The model reads ``pixel_values`` (N, max_patches, 3 * 16 * 16), each image's patches (row-major, each
patch (row, column, channel)) then zeros to the budget's ``max_patches``; ``image_position_ids``
(N, max_patches, 2), each patch's (column, row), -1 on padding; ``num_soft_tokens_per_image`` (N,). No
normalisation: the checkpoints were trained on pixels in [0, 1]. Bit-identical to transformers'
``Gemma4ImageProcessorPil`` (tested over the image zoo); transformers is never imported.

Per token, the model reads ``mm_token_type_ids`` (1 on every ``<|image|>``, 0 elsewhere): its sliding
window layers attend bidirectionally inside each image's run of soft tokens
(``use_bidirectional_attention: "vision"``), which a packed row must keep inside its sample: the family
declares it (``attention``) and Hugging Face batches carry the masks that do (training/hf.py), while
causal-only kernels (Megatron's THD) refuse the family. Positions are 1-D, restarting at every sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from neva_pack.core import ConfigError, Normalisation
from neva_pack.families.base import AttentionNeeds, EncoderSpec, FamilyBase, FamilyOptions, Join, refuse_layout_options
from neva_pack.families.headers import StoredImage, planar_uint8
from neva_pack.families.settings_keys import MAX_PATCH, choice, whole

__all__ = ["BUDGETS", "Gemma4Family", "Gemma4Settings", "aspect_ratio_preserving_size"]

BUDGETS = (70, 140, 280, 560, 1120)
"""The soft-token budgets the processor accepts (``max_soft_tokens``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemma4Settings:
    """The numbers that decide a Gemma 4 image's size, tokens and pixels."""

    patch_size: int
    """Vision transformer patch side in pixels (16)."""
    pooling: int
    """Patches pooled per side into one soft token (3)."""
    max_soft_tokens: int
    """Soft tokens an image may take at most (one of ``BUDGETS``; the checkpoints' 280)."""
    resample: int
    """PIL resampling filter of the resize (3, bicubic)."""
    rescale_factor: float
    """Pixels are multiplied by it (1/255), nothing else."""

    @property
    def max_patches(self) -> int:
        """Patches of the budget: every image's rows are padded to it."""
        return self.max_soft_tokens * self.pooling**2


def aspect_ratio_preserving_size(height: int, width: int, patch_size: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """(height, width) the image is resized to: transformers' ``get_aspect_ratio_preserving_size``, the
    same float operations in the same order (ValueError where it raises)."""
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch_size
    target_height = int(math.floor(factor * height / side)) * side
    target_width = int(math.floor(factor * width / side)) * side
    if target_height == 0 and target_width == 0:
        raise ValueError(f"{width} x {height}: resizes to 0 x 0 (sides must be multiples of {side})")
    longest = (max_patches // pooling**2) * side
    if target_height == 0:
        target_height, target_width = side, min(int(math.floor(width / height)) * side, longest)
    elif target_width == 0:
        target_width, target_height = side, min(int(math.floor(height / width)) * side, longest)
    if target_height * target_width > target_px:
        raise ValueError(f"{width} x {height}: resizes to {target_width} x {target_height}, over {max_patches} patches")
    return target_height, target_width


class Gemma4Family(FamilyBase):
    """Gemma 4 images: counts from sizes, uint8 in workers, padded patch rows at read time."""

    family = "gemma4"
    image_tokens = ("<|image>", "<|image|>", "<image|>")
    """(start, patch, end): one ``<|image|>`` per soft token between ``<|image>`` and ``<image|>``."""
    models = "Gemma 4"
    option_names = ("max_soft_tokens",)
    """The family's own option (``--max_soft_tokens``), as ``options`` records it."""
    batch_keys = {"pixel_values": Join.IMAGES, "image_position_ids": Join.IMAGES,
                  "num_soft_tokens_per_image": Join.IMAGES, "mm_token_type_ids": Join.TOKENS}  # fmt: skip
    """Every image's padded rows and positions, its soft-token count, and each token's modality."""
    attention = AttentionNeeds(bidirectional_images=True, layer_types=("sliding_attention",), marks="mm_token_type_ids")
    """Sliding-window layers see each image's soft tokens both ways; full-attention layers stay causal."""
    settings_patch_size = True
    settings_keys = (whole("patch_size", 1, MAX_PATCH), whole("pooling_kernel_size", 1, 8, " (patches pooled per side: 3)"),
                     choice("max_soft_tokens", BUDGETS))  # fmt: skip
    """What the processor reads of a preprocessor_config.json beyond the common keys (settings_keys)."""

    def __init__(self, settings: Gemma4Settings):
        self.settings = settings
        self.normalisation = Normalisation(rescale_factor=settings.rescale_factor, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
        """core.Normalisation: the rescale only (mean 0, std 1), as an output records it."""

    @classmethod
    def from_options(cls, encoder: EncoderSpec, options: FamilyOptions) -> Gemma4Family:
        """``--max_soft_tokens`` over the encoder's settings."""
        refuse_layout_options(encoder, options)
        return cls.from_encoder(encoder, max_soft_tokens=options.max_soft_tokens)

    @classmethod
    def from_encoder(cls, encoder: EncoderSpec, *, max_soft_tokens: int | None = None) -> Gemma4Family:
        cfg = encoder.preprocessor_config
        if not cfg.get("do_resize", True) or not cfg.get("do_rescale", True) or cfg.get("do_normalize", False):
            raise ConfigError(f"--hf_vision_encoder {encoder.name}: do_resize and do_rescale must be on, do_normalize off (the model reads pixels in [0, 1])")
        budget = int(max_soft_tokens or cfg.get("max_soft_tokens", 280))
        if budget not in BUDGETS:
            raise ConfigError(f"--max_soft_tokens {budget}: the processor takes one of {', '.join(map(str, BUDGETS))}")
        settings = Gemma4Settings(
            patch_size=int(cfg.get("patch_size", encoder.patch_size)),
            pooling=int(cfg.get("pooling_kernel_size", 3)),
            max_soft_tokens=budget,
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        )
        return cls(settings)

    def options(self) -> dict:
        """``max_soft_tokens`` as resolved (the flag, or the encoder's settings)."""
        return {"max_soft_tokens": self.settings.max_soft_tokens}

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        s = self.settings
        return aspect_ratio_preserving_size(height, width, s.patch_size, s.max_patches, s.pooling)

    def tokens_for_size(self, width: int, height: int) -> int:
        """Soft tokens: the resized image's patches over pooling² (``_get_num_multimodal_tokens``)."""
        s = self.settings
        resized_height, resized_width = self.resized_size(width, height)
        return (resized_height // s.patch_size) * (resized_width // s.patch_size) // s.pooling**2

    def pixels_for_size(self, width: int, height: int) -> int:
        """Pixels of the resized image."""
        resized_height, resized_width = self.resized_size(width, height)
        return resized_height * resized_width

    def vision_cost_for_size(self, width: int, height: int) -> int:
        """The encoder attends over the budget's padded patches, whatever the image's own count."""
        return self.settings.max_patches**2

    def to_uint8(self, image: Image.Image) -> StoredImage:
        """RGB image -> the resized uint8 (3, H, W) (PIL's resize, as the processor's; none when the
        size is already the target, as the processor skips it)."""
        width, height = image.size
        resized_height, resized_width = self.resized_size(width, height)
        if (resized_width, resized_height) != (width, height):
            image = image.resize((resized_width, resized_height), resample=self.settings.resample)
        return StoredImage(size=(width, height), parts=(planar_uint8(image),), tokens=self.tokens_for_size(width, height))

    def model_inputs(self, images: list[StoredImage]) -> dict[str, np.ndarray]:
        """``pixel_values`` float32 (N, max_patches, 3 p²), ``image_position_ids`` int64 (N, max_patches, 2)
        and ``num_soft_tokens_per_image`` int64 (N,), as ``Gemma4ImageProcessorPil`` returns them.

        The processor multiplies the uint8 image in float64 by the factor, casts to float32 and
        patchifies; the rows here are the same products, cast straight into the padded array."""
        s = self.settings
        p, budget = s.patch_size, s.max_patches
        pixel_values = np.zeros((len(images), budget, 3 * p * p), dtype=np.float32)
        positions = np.full((len(images), budget, 2), -1, dtype=np.int64)
        counts = np.empty(len(images), dtype=np.int64)
        for k, image in enumerate(images):
            pixels = image.parts[0]
            _, height, width = pixels.shape
            rows, columns = height // p, width // p
            patches = pixels.reshape(3, rows, p, columns, p).transpose(1, 3, 2, 4, 0).reshape(rows * columns, -1)
            np.multiply(patches, s.rescale_factor, out=pixel_values[k, : rows * columns], dtype=np.float64, casting="same_kind")
            column, row = np.meshgrid(np.arange(columns), np.arange(rows), indexing="xy")
            positions[k, : rows * columns, 0] = column.reshape(-1)
            positions[k, : rows * columns, 1] = row.reshape(-1)
            counts[k] = rows * columns // s.pooling**2
        return {"pixel_values": pixel_values, "image_position_ids": positions, "num_soft_tokens_per_image": counts}

    def sample_extras(self, tokens, images, num_images, patch_id) -> dict[str, np.ndarray]:
        """``mm_token_type_ids`` (L,) int64: 1 on every soft token, as the processor marks them; the
        pack's soft tokens must be its images' (ValueError otherwise: the model would misplace them)."""
        marks = (np.asarray(tokens) == patch_id).astype(np.int64)
        expected = sum(image.tokens for image in images)
        if int(marks.sum()) != expected:
            raise ValueError(f"{int(marks.sum())} soft tokens in the pack for images of {expected}")
        return {"mm_token_type_ids": marks}

