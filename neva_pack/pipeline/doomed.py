"""Runs refused up front, before any record is encoded, because no record could make a sample: one
line each, where encoding everything would only end in a skip of every record (or, with
``--max_skip_fraction 1``, an exit 0 that dropped every image sample).

The refusals are exact: each is made only when every record is known, from its parsed JSON (no
tokenizer, no image), to be skipped; the records are read once, and the read stops at the first
record that could make a sample (a text-only record, an answer before the first image, ...), so a
run that can go on pays for a few records only.
"""

from __future__ import annotations

from pathlib import Path

from neva_pack.core import InputError
from neva_pack.formats import FORMATS
from neva_pack.records import (
    IMAGE_PLACEHOLDER,
    RecordError,
    iter_raw_records,
    parse_record,
)
from neva_pack.samples import SampleBuilder

__all__ = ["images_not_held_error", "refuse_doomed_run", "smallest_image_run"]


def refuse_doomed_run(data_path: Path, builder: SampleBuilder, output_format: str, encoder: str) -> None:
    """InputError, one line, when no record of ``data_path`` could make a sample:

    - the output holds text only and every record parses and has images (each would be skipped as
      ``images_not_held``);
    - the smallest image run the encoder's family can make (``smallest_image_run``) is longer than the
      sequence (``builder.max_seq_length``: the largest pack size's cut), so that no image run fits
      wherever it starts (a run is never split: truncation cuts the tokens before it), and every record
      is one that the cut leaves nothing to train on: it fails to parse (skipped anyway), or it has an
      image and, with truncation, its first ``<image>`` is in a turn before its first answer (every
      trained label comes after the cut), without (``--no_truncate``) any image at all (``too_long``).
      At least one record must have an image; a record without images, or one whose first answer comes
      before its first image (trained with the image cut away), lets the run go on.
    """
    if builder.text_only:
        if _every(data_path, builder, lambda conversation: bool(conversation.images), parsed_only=True):
            raise images_not_held_error(data_path, output_format)
        return
    run = smallest_image_run(builder)
    if run <= builder.max_seq_length:
        return
    doomed = (lambda c: bool(c.images)) if not builder.truncate else _image_before_any_answer
    if _every(data_path, builder, doomed, parsed_only=False):
        why = "has an image" if not builder.truncate else "has an image before its first answer"
        fate = "would be too long (--no_truncate)" if not builder.truncate else "would be cut before its image and train nothing"
        raise InputError(
            f"--max_seq_length {builder.max_seq_length}: shorter than the smallest image run of {encoder} ({run:,} positions), "
            f"and every record of {data_path} {why}: each {fate}; use a --max_seq_length above {run:,}"
        )


def smallest_image_run(builder: SampleBuilder) -> int:
    """Positions of the shortest image run any image can make: a fixed run's, or the family's fewest
    tokens and the run's delimiters."""
    image_run = builder.image_run
    if image_run.positions is not None:
        return image_run.positions
    return builder.preprocessor.fewest_tokens() + image_run.delimiters


def images_not_held_error(data_path: Path, output_format: str) -> InputError:
    """The one line of a run whose every record has images, for an output that holds text only."""
    holding = " or ".join(name for name, fmt in FORMATS.items() if fmt.holds_images)
    return InputError(f"every record of {data_path} has images, which --output_format {output_format} "
                      f"cannot hold (text only): use --output_format {holding}")  # fmt: skip


def _image_before_any_answer(conversation) -> bool:
    """The record has an image, and its first ``<image>`` is in a turn before its first answer."""
    for turn in conversation.turns:
        if turn.role == "assistant":
            return False
        if IMAGE_PLACEHOLDER in turn.text:
            return bool(conversation.images)
    return False


def _every(data_path: Path, builder: SampleBuilder, doomed, *, parsed_only: bool) -> bool:
    """Whether ``doomed`` holds of every record (one that fails to parse counts as doomed unless
    ``parsed_only``), and at least one record parses; stops at the first record that is not."""
    seen = False
    for raw in iter_raw_records(data_path, builder.record_limits):
        try:
            conversation = parse_record(raw, builder.max_conversation_chars, builder.max_images_per_record)
        except RecordError:
            if parsed_only:
                return False
            continue
        if not doomed(conversation):
            return False
        seen = True
    return seen
