"""What one record may cost, and where its images may be: the per-record budgets and the image
folder's confinement, a group of ``SampleConfig`` (its ``budgets``) with a flag each.

A record over a budget is skipped with its reason, never decoded past it. The group's fields keep
their order: it is the order of the sample fingerprint's ``budgets`` list, which a resumed store
compares (so a store made before the group existed resumes as it did).
"""

from __future__ import annotations

from dataclasses import dataclass

from neva_pack.config.options import BUDGETS, check_fields, option
from neva_pack.core import ConfigError
from neva_pack.families import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_DECODE_SECONDS, DEFAULT_MAX_IMAGE_PIXELS
from neva_pack.records import (
    DEFAULT_MAX_CONVERSATION_CHARS,
    DEFAULT_MAX_IMAGES_PER_RECORD,
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_MAX_RECORD_DEPTH,
    MAX_RECORD_DEPTH_LIMIT,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordBudgets:
    """The fields' order is the order of the fingerprint's ``budgets`` list."""

    max_record_bytes: int = option(
        DEFAULT_MAX_RECORD_BYTES, group=BUDGETS, minimum=1, fingerprint="budgets",
        help=f"bytes of one record's JSON text (default {DEFAULT_MAX_RECORD_BYTES >> 20} MiB)",
    )  # fmt: skip
    """Bytes of one record's JSON text; a longer record is skipped unparsed (record_too_large)."""
    max_record_depth: int = option(
        DEFAULT_MAX_RECORD_DEPTH, group=BUDGETS, minimum=1, fingerprint="budgets",
        help=f"nesting levels of one record (default {{default}}, at most {MAX_RECORD_DEPTH_LIMIT})",
    )  # fmt: skip
    """Nesting levels of one record; a deeper record is skipped unparsed (record_too_deep)."""
    max_conversation_chars: int = option(
        DEFAULT_MAX_CONVERSATION_CHARS, group=BUDGETS, minimum=1, fingerprint="budgets",
        help=f"characters of one conversation's text (default {DEFAULT_MAX_CONVERSATION_CHARS:,})",
    )  # fmt: skip
    """Characters of one conversation's text; more is skipped before tokenizing (conversation_too_long)."""
    max_image_bytes: int = option(
        DEFAULT_MAX_IMAGE_BYTES, group=BUDGETS, minimum=1, fingerprint="budgets",
        help=f"bytes of one image file (default {DEFAULT_MAX_IMAGE_BYTES >> 20} MiB)",
    )  # fmt: skip
    """Bytes read from one image file; a larger file is skipped unread (image_too_large)."""
    max_image_pixels: int = option(
        DEFAULT_MAX_IMAGE_PIXELS, group=BUDGETS, minimum=1, fingerprint="budgets",
        help=f"pixels of one image as decoded, padded or resized (default {DEFAULT_MAX_IMAGE_PIXELS:,})",
    )  # fmt: skip
    """Pixels of one image as decoded, padded or resized, checked before each (image_too_large)."""
    allow_outside_image_folder: bool = option(
        False, group=BUDGETS, fingerprint="budgets",
        help="accept absolute image paths, '..' and symlinks that lead out of --image_folder",
    )  # fmt: skip
    """Accept absolute image names, '..' and symlinks leading out of image_folder."""
    max_image_decode_seconds: float = option(
        DEFAULT_MAX_IMAGE_DECODE_SECONDS, group=BUDGETS, fingerprint="budgets",
        help="CPU seconds to decode one image; a slower one is stopped and skipped as image_too_slow (default {default})",
    )  # fmt: skip
    """CPU seconds to decode one image; a slower decode is stopped and skipped (image_too_slow)."""
    max_images_per_record: int = option(
        DEFAULT_MAX_IMAGES_PER_RECORD, group=BUDGETS, minimum=1, fingerprint="budgets",
        help=f"images of one record, checked before any is read (default {DEFAULT_MAX_IMAGES_PER_RECORD:,})",
    )  # fmt: skip
    """Images (and <image> placeholders) of one record; more is skipped before any is read (too_many_images)."""

    def __post_init__(self):
        check_fields(self)
        if not 0 < self.max_image_decode_seconds < float("inf"):
            raise ConfigError(f"--max_image_decode_seconds {self.max_image_decode_seconds}: must be a number above 0")
        if self.max_record_depth > MAX_RECORD_DEPTH_LIMIT:
            raise ConfigError(
                f"--max_record_depth {self.max_record_depth}: at most {MAX_RECORD_DEPTH_LIMIT} (the JSON parser recurses per level)"
            )


__all__ = ["RecordBudgets"]
