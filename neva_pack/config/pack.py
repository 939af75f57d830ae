"""What makes a pack: its sizes, the packing algorithm and seed, the alignment padding, the pad id,
the output format and the pack order. Change any of these and the prefixes are written again from
the same sample store; a --resume compares them (``PreprocessConfig.write_settings``)."""

from __future__ import annotations

from dataclasses import dataclass

from neva_pack.config.options import NEMO, TRAINING, check_fields, option
from neva_pack.core import ConfigError, PAD_ID
from neva_pack.formats import DEFAULT_FORMAT, FORMATS
from neva_pack.packing import (
    ALGORITHMS, AUTO, DEFAULT_ALGORITHM, RECOMMENDED_ALGORITHM, aligned_capacity, alignment_multiple, step_cost_model
)

MAX_SEED = 2**63 - 1
"""Seeds are non-negative int64 (numpy's generators refuse negative seeds)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackConfig:
    max_seq_length: int = option(
        4096, help="pack capacity in positions (default {default})", group=NEMO,
        hparams=("model", "encoder_seq_length"), written_as="max_seq_length",
    )  # fmt: skip
    """Pack capacity in positions (text + image); longer samples are truncated (or skipped). Unused
    when ``pack_sizes`` is given (see ``sizes``)."""
    pack_sizes: tuple[int, ...] | None = option(
        None, help="write one prefix per size (packed_seq_dataset_<size>); replaces --max_seq_length"
    )
    """Several pack sizes: one prefix per size (packed_seq_dataset_<size>) from one sample store,
    whose samples are cut for the largest; each size cuts them further as needed."""
    packing_algorithm: str = option(
        DEFAULT_ALGORITHM, group=NEMO, choices=lambda: sorted(ALGORITHMS), written_as="algorithm",
        help=f"packing algorithm (default {{default}}, NeMo's; recommended: {RECOMMENDED_ALGORITHM})",
    )  # fmt: skip
    """A name from neva_pack.packing.ALGORITHMS."""
    seed: int = option(
        0, help="seed of the packing algorithm (default {default})", group=NEMO, minimum=0, maximum=MAX_SEED,
        maximum_words="2**63 - 1", written_as="seed",
    )  # fmt: skip
    """Seed of the packing algorithm's random generator (and of the pack order's, with balance)."""
    global_batch_size: int | None = option(
        None, help="unpacked GBS, to print the packed GBS to train with", hparams=("model", "global_batch_size"),
        minimum=1, written_as="",
    )  # fmt: skip
    """Unpacked global batch size, to print the packed equivalent (GBS / samples per pack); the
    stats file's advice depends on it."""
    max_samples_per_pack: int | None = option(
        None, help="cap on samples per pack", minimum=1, written_as="max_samples_per_pack"
    )
    """Cap on samples per pack (for fixed-size cu_seqlens buffers)."""
    max_images_per_pack: int | None = option(
        None, help="cap on images per pack (a sample with more is skipped)", minimum=1, written_as="max_images_per_pack"
    )
    """Cap on images per pack (the vision encoder's batch); a sample with more images alone is
    skipped at that pack size (``over_image_budget``)."""
    max_image_tokens_per_pack: int | None = option(
        None, help="cap on image tokens per pack (a sample with more is skipped)", minimum=1,
        written_as="max_image_tokens_per_pack",
    )  # fmt: skip
    """Cap on image tokens (positions of image runs) per pack: with dynamic-resolution encoders the
    vision encoder's memory follows them; a sample with more alone is skipped (``over_image_budget``)."""
    max_video_tokens_per_pack: int | None = option(
        None, help="cap on video tokens (positions of video clips' runs) per pack (a sample with more is skipped)",
        minimum=1, written_as="max_video_tokens_per_pack",
    )  # fmt: skip
    """Cap on video tokens (positions of video clips' runs, which count as image tokens too) per pack;
    a sample with more alone is skipped (``over_image_budget``)."""
    output_format: str = option(
        DEFAULT_FORMAT, choices=lambda: sorted(FORMATS), written_as="format",
        help=lambda: "; ".join(f"{name}: {fmt.description}" for name, fmt in FORMATS.items()) + "; default {default}",
    )  # fmt: skip
    """The on-disk format of the packed output: a name of the registry (``formats.FORMATS``), each
    format's ``description`` its line of the help."""
    # --- training side: THD alignment and data-parallel balance ---
    pad_to_multiple_of: int | None = option(
        None, help="pad every sample to a multiple of M before packing", group=TRAINING, minimum=1,
        written_as="pad_to_multiple_of",
    )  # fmt: skip
    """Pad every sample to a multiple of this (before packing); combined (lcm) with what
    context_parallel_size / tensor_parallel_size / sequence_parallel need. Written: ``alignment``."""
    context_parallel_size: int = option(
        1, help="CP size: samples padded to a multiple of 2*CP", group=TRAINING, minimum=1,
        hparams=("model", "context_parallel_size"),
    )  # fmt: skip
    """Megatron-Core CP size the packs are for: samples are padded to a multiple of 2·CP when > 1."""
    tensor_parallel_size: int = option(
        1, help="TP size (with --sequence_parallel: multiple of CP*TP)", group=TRAINING, minimum=1,
        hparams=("model", "tensor_model_parallel_size"),
    )  # fmt: skip
    """Megatron-Core TP size; with sequence_parallel, samples are padded to a multiple of CP·TP."""
    sequence_parallel: bool = option(
        False, help="Megatron sequence parallelism is on", group=TRAINING, hparams=("model", "sequence_parallel")
    )
    """Megatron-Core sequence parallelism is on (see tensor_parallel_size)."""
    pad_id: int = option(
        PAD_ID, help="token id of padding positions (default {default})", group=TRAINING, minimum=0, written_as="pad_id"
    )
    """Token id of padding positions (their label is ignore_index)."""
    balance_data_parallel: int | None = option(
        None, help="order packs so every N consecutive packs cost alike", group=TRAINING, metavar="N", minimum=1,
        written_as="balance_data_parallel",
    )  # fmt: skip
    """Order packs so every N consecutive packs (one micro-step on N data-parallel ranks) cost alike."""
    step_cost_model: str = option(
        AUTO, help="what --balance_data_parallel balances: the modelled step time of a preset (auto: the run's "
        "model; see docs/training.md), a JSON file of one, or 'attention' (sum of squares, the order of old)",
        group=TRAINING, metavar="PRESET", written_as="",
    )  # fmt: skip
    """The step cost model ``balance_data_parallel`` orders by (``packing.step_cost_model``): ``auto``,
    a preset name, a JSON file, or ``attention``. Recorded in the stats file's balance report."""

    def __post_init__(self):
        check_fields(self)
        try:
            step_cost_model(self.step_cost_model)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        # the format's limits: the largest pack it describes exactly
        FORMATS[self.output_format].check_settings(max_seq_length=self.max_seq_length, pack_sizes=self.pack_sizes)
        if self.alignment > self.sizes[0]:
            raise ConfigError(
                f"samples padded to a multiple of {self.alignment} (--pad_to_multiple_of / parallel sizes) "
                f"cannot fit packs of {self.sizes[0]} positions"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The pack sizes to write, smallest first: --pack_sizes, or else --max_seq_length."""
        return tuple(sorted(set(self.pack_sizes))) if self.pack_sizes else (self.max_seq_length,)

    @property
    def alignment(self) -> int:
        """M: every sample's packed length is a multiple of it (1: no padding)."""
        return alignment_multiple(
            self.pad_to_multiple_of, self.context_parallel_size, self.tensor_parallel_size, self.sequence_parallel
        )

    @property
    def cut_length(self) -> int:
        """The length samples are cut to when encoded: the longest that fits the largest size once padded."""
        return aligned_capacity(self.sizes[-1], self.alignment)


__all__ = ["MAX_SEED", "PackConfig"]
