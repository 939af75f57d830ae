"""The formats contract: what an on-disk packed format is, in one place.

A format is one module of ``neva_pack/formats/`` exposing one object (``FORMAT``) that satisfies
``PackedFormat``, and one line in the registry (``formats.FORMATS``, keyed by the meta's
``format`` field). Nothing outside ``formats/`` names a format: the pipeline, convert, verify,
stats, config and --overwrite ask the registry's format object. Its three parts:

- ``PackedFormat``: what it is (name, whether its writer needs decoded pixels, whether it refers
  to the sample store's image pool, its limits and the check of a run's settings against them),
  the files it writes for a prefix (``PrefixFiles``) and which paths of an output directory are
  its own (``owns``), and the factories of its writer and reader, its ``prepare`` and ``check``.
- ``PackWriter``: packs in, under temporary names; ``checkpoint`` makes them durable (a writer made
  with ``resume=True`` for the same plan continues after it, byte-identical to a run never
  stopped); ``publish`` renames the files into place and writes the meta last.
- ``PackReader``: packs out, as ``ReadPack``s, and the plan table: what verify, stats, convert and
  ``PackedSeqDataset`` read through, never through file names.

Every format's prefix shares the names in ``neva_pack.files.paths`` (the prefix, ``<prefix>.meta.json``,
the temporary prefix, the writer's checkpoint) and the helpers below (``WriteSpec``, ``Checkpoint``,
``publish``, ``prefix_files``, ``Limits``). A format names its own files ``<prefix><suffix>`` (or
``<prefix>.<name>/`` for a directory), so that each prefix of a multi-size run finds its own.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from neva_pack.files import (
    TMP_SUFFIX, checkpoint_paths, file_checksum, meta_path, prefix_file, relative_name, tmp_prefix
)
from neva_pack.core import ConfigError, ImageRun, InputError
from neva_pack.formats.meta import Normalisation, PackedMeta, ReadPack
from neva_pack.sample_store import PoolSegment

if TYPE_CHECKING:
    from neva_pack.assembly import AssembledPack
    from neva_pack.packing import PlanTable

__all__ = [
    "Checkpoint", "Limits", "PackReader", "PackWriter", "PackedFormat", "PrefixFiles", "Problems", "WriteSpec",
    "meta_is_of", "pending_meta_path", "prefix_files", "publish", "published_as",
]  # fmt: skip

MIN_PACK = 2
"""The smallest pack any format holds: a token and the next one (its label)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What a format stores exactly; ``check`` refuses a run's settings beyond it, naming the flag."""

    max_pack: int
    """Largest pack, in positions, the format describes exactly (its sample boundaries)."""
    max_integer: int
    """Largest magnitude of a token id or a label it stores exactly (every id is below it)."""
    why: str
    """Why, one phrase for the error line (``"NeMo's format stores ... as float32"``)."""

    def check(self, *, max_seq_length: int | None = None, pack_sizes: Sequence[int] | None = None,
              ignore_index: int | None = None, vocab_size: int | None = None) -> None:  # fmt: skip
        """ConfigError, one line naming the flag, for the first setting given that the format cannot hold."""
        if max_seq_length is not None and not MIN_PACK <= max_seq_length <= self.max_pack:
            raise ConfigError(f"--max_seq_length {max_seq_length}: must be between {MIN_PACK} and {self.max_pack:,} ({self.why})")
        if pack_sizes is not None and (not pack_sizes or min(pack_sizes) < MIN_PACK or max(pack_sizes) > self.max_pack):
            raise ConfigError(f"--pack_sizes {list(pack_sizes)}: every size must be between {MIN_PACK} and {self.max_pack:,}")
        if ignore_index is not None and abs(ignore_index) > self.max_integer:
            raise ConfigError(f"--ignore_index {ignore_index}: labels must lie within ±{self.max_integer:,} ({self.why})")
        if vocab_size is not None and vocab_size > self.max_integer:
            raise ConfigError(f"--tokenizer_path: a vocabulary of {vocab_size:,} ids does not fit ({self.why})")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixFiles:
    """The paths a format's writer creates for one prefix (present or not)."""

    final: tuple[Path, ...]
    """What a published prefix consists of in the output directory, its meta included (the sample
    store's pool, which a format may refer to, is the run's, not the format's)."""
    plan_table: Path
    """The file among ``final`` that holds the plan table (what stats reads and checks of an output)."""
    temporary: tuple[Path, ...]
    """What its writer may leave while it writes, the checkpoint included; none outlives ``publish``."""
    checkpoint: Path
    """The writer's checkpoint (among ``temporary``): what --resume continues from."""

    @property
    def every(self) -> tuple[Path, ...]:
        return (*self.final, *self.temporary)


@runtime_checkable
class Problems(Protocol):
    """Where ``PackedFormat.check`` reports what is wrong (verify's result)."""

    def add(self, problem: str) -> None:
        """One problem, one line."""


@runtime_checkable
class PackWriter(Protocol):
    """Writes one prefix under temporary names; nothing is in place before ``publish``."""

    num_packs: int
    """Packs written so far (after a resume: those the checkpoint holds); the next pack's number."""

    def add(self, pack: AssembledPack) -> None:
        """One assembled pack (``prepare`` of it, then ``add_prepared``)."""

    def add_prepared(self, prepared: Any, pixels: Iterable[np.ndarray | None] | None = None) -> None:
        """Packs as the format's ``prepare`` gave them, and (``needs_pixels``) each pack's uint8 pixels,
        an iterable read pack by pack."""

    def checkpoint(self) -> None:
        """Make every pack added so far durable (the files and the checkpoint, fsynced)."""

    def publish(self, plan: PlanTable, extra_files: list[Path], meta: PackedMeta) -> PackedMeta:
        """Finish the files, rename them into place, write the meta last (with ``format``, ``num_packs``,
        ``layout`` and the checksums of its files and of ``extra_files``); the meta written."""


@runtime_checkable
class PackReader(Protocol):
    """Reads a published prefix pack by pack, whatever the format stores."""

    prefix: Path
    meta: PackedMeta
    image_shape: tuple[int, int, int]

    def __len__(self) -> int:
        """Packs in the prefix."""

    def plan_table(self) -> PlanTable:
        """Which records each pack holds; InputError naming the file if it is damaged."""

    def pack(self, p: int, images: bool = True) -> ReadPack:
        """Pack ``p``: padded tokens and labels, cu_seqlens, and its images (``pixels`` or ``images``)."""

    def images(self, p: int, device=None, dtype=None) -> Any:
        """Pack ``p``'s images as the model's input: a normalised (N, 3, H, W) torch tensor, one zero
        image for a pack without any."""

    def close(self) -> None:
        """Release the files (a reader is not used after)."""


@runtime_checkable
class PackedFormat(Protocol):
    """One on-disk packed format (``formats.FORMATS[name]``)."""

    name: str
    """The meta's ``format`` field, the --output_format and ``convert --to`` value."""
    description: str
    """One line for --output_format's help: what it stores and what reads it."""
    needs_pixels: bool
    """Its writer stores image values: assembly reads each pack's uint8 pixels for it. False: it
    refers to images by pool index only (assembly reads no pixel)."""
    uses_image_pool: bool
    """Its output refers to the sample store's image pool (so --drop_store cannot drop the store)."""
    holds_images: bool
    """Its files can hold images. False (text only): a run skips records with images (reason
    ``images_not_held``) and convert refuses an output with images."""
    holds_dynamic_images: bool
    """Its files can hold dynamic-resolution images (each at its own size and run length,
    ``images.StoredImage``). A format that cannot (one crop shape, or text only) refuses an encoder of
    such images in one line before any record is read (``formats.check_dynamic_images``)."""
    holds_videos: bool
    """Its files can hold video clips (a StoredImage of stacked frames, its run kept whole: the family's
    own ids). A run reading clips (--video_profile) into any other format is refused in one line."""
    limits: Limits
    """What it stores exactly (largest pack, largest id or label)."""

    def check_settings(self, *, max_seq_length: int | None = None, pack_sizes: Sequence[int] | None = None,
                       ignore_index: int | None = None, vocab_size: int | None = None) -> None:  # fmt: skip
        """ConfigError naming the flag when a setting given is beyond what the format holds."""

    def files(self, prefix: Path) -> PrefixFiles:
        """Every path its writer creates for ``prefix``: the final files, the plan table, the temporaries."""

    def trusted_files(self, prefix: Path, meta: PackedMeta) -> tuple[Path, ...]:
        """The small files among the meta's checksums that its reader believes to find the data (the
        plan table, index files; never the data files): checked on every open (``formats/trust.py``)."""

    def owns(self, path: Path) -> bool:
        """Whether ``path`` (one of ``files(...).every``) is recognisably this format's own, by its
        content: what --overwrite may delete (a user's file under one of its names is not)."""

    def writer(self, prefix: Path, spec: WriteSpec, resume: bool = False) -> PackWriter:
        """A writer of ``prefix``; ``resume``: continue after the checkpoint of the same plan, if any."""

    def reader(self, prefix: Path, meta: PackedMeta | None = None) -> PackReader:
        """The reader of a published ``prefix`` (``meta``: its meta, already read)."""

    def prepare(self, packs: Sequence[AssembledPack], spec: WriteSpec) -> Any:
        """The packs turned into what ``PackWriter.add_prepared`` writes. Pure and picklable: the
        processes that assemble the packs run it (a format with nothing to prepare returns the packs)."""

    def check(self, reader: PackReader, result: Problems) -> None:
        """Its own structural checks of a prefix (verify runs them before the invariants every pack
        must hold, which it checks through the reader); each problem to ``result.add``."""

    def summary_line(self, data_prefix: str) -> str:
        """Where the output is, for the run's summary (``output  <this>``)."""


def prefix_files(prefix: Path, suffixes: Sequence[str], plan_table_suffix: str) -> PrefixFiles:
    """The files of a format whose writer writes ``<prefix>.tmp<suffix>`` for each suffix, with the
    shared checkpoint, and ``publish`` renames them to ``<prefix><suffix>`` beside the meta."""
    tmp = tmp_prefix(prefix)
    checkpoint, staging = checkpoint_paths(prefix)
    meta = meta_path(prefix)
    return PrefixFiles(
        final=(meta, *(prefix_file(prefix, suffix) for suffix in suffixes)),
        plan_table=prefix_file(prefix, plan_table_suffix),
        temporary=(*(prefix_file(tmp, suffix) for suffix in suffixes), checkpoint, staging, pending_meta_path(prefix)),
        checkpoint=checkpoint,
    )



def normalised_stack(reader, p: int, device=None, dtype=None):
    """Pack ``p``'s fixed-size uint8 images (``reader.pack(p).pixels``) as the model's input tensor,
    normalised with the output's own processor values: what ``PackReader.images`` is for a format
    that keeps each pack's crops itself (energon, llamafactory). An image-less pack gives one zero
    image (NeMo's layout, never an empty tensor); images each at their own size have no one shape."""
    import torch

    if reader.image_shape is None:
        raise ValueError(f"{reader.prefix}: dynamic-resolution images have no one tensor shape; read the pack's "
                         "stored_images and make the model's inputs with its processor (neva_pack.reading.dataset.PackedSeqDataset)")  # fmt: skip
    pixels = reader.pack(p).pixels
    if len(pixels) == 0:
        return torch.zeros((1, *reader.image_shape), dtype=dtype or torch.float32, device=device)
    normalisation = reader.meta.normalisation
    if device is None or torch.device(device).type == "cpu":
        values = torch.from_numpy(normalisation.apply(pixels))
        return values if dtype is None or dtype == torch.float32 else values.to(dtype)
    return normalisation.apply_torch(pixels, device=device, dtype=dtype)

def meta_is_of(path: Path, name: str) -> bool:
    """Whether ``path`` is a meta whose ``format`` field is ``name`` (by what it says, unchecked)."""
    from neva_pack.files import MAX_OUTPUT_JSON_BYTES, read_json

    try:
        value = read_json(path, what="", max_bytes=MAX_OUTPUT_JSON_BYTES, error=InputError)
    except InputError:
        return False
    return isinstance(value, dict) and value.get("format") == name


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteSpec:
    """What a writer needs to know before the first pack."""

    image_shape: tuple[int, int, int] | None
    """(3, H, W) of every image; None for dynamic-resolution images (each its own size)."""
    normalisation: Normalisation
    """How uint8 pixels become the model's float input (formats storing floats apply it)."""
    pad_id: int
    """Token id written on padding positions."""
    ignore_index: int
    """Label written on padding positions."""
    pool: tuple[PoolSegment, ...]
    """The image pool the packs' image indices refer to (the sample store's parts)."""
    plan_digest: str
    """Identifies the plan and the settings it is written with: a checkpoint of another is not resumed
    (the pipeline's digest is JSON, ``{"plan": ..., "settings": ...}``, so that a resume can name the
    setting that differs)."""
    image_run: ImageRun
    """The token ids of one image's run of positions (formats may store it once instead of per image;
    ``positions`` None: each image's run is its own length, ``AssembledPack.image_lengths``)."""
    image_processor: dict | None = None
    """Dynamic-resolution images: the record that rebuilds their processor (``images.processor_record``)."""


class Checkpoint:
    """The writer's checkpoint file: durable state arrays next to the temporary prefix."""

    def __init__(self, prefix: Path, plan_digest: str):
        self.tmp = tmp_prefix(prefix)
        self.path, self.staging = checkpoint_paths(prefix)
        self.plan_digest = plan_digest

    def load(self, files: list[Path]) -> dict | None:
        """The saved state, if it belongs to this plan and every file is at least as long as saved."""
        if not self.path.is_file() or not all(f.is_file() for f in files):
            return None
        with self._opened() as f, np.load(f) as state:
            if str(state["plan_digest"]) != self.plan_digest:
                return None
            data = {key: state[key] for key in state.files}
        for k, f in enumerate(files):
            if f.stat().st_size < int(data["bytes"][k]):
                return None
        return data

    def start(self, files: list[Path], resume: bool) -> tuple[dict | None, list[int | None]]:
        """Where a writer of ``files`` starts: with ``resume`` and a checkpoint ``load`` accepts, its
        state and each file's size at it (the files are cut back to them); else None and no sizes,
        any checkpoint left removed (it must not outlive the files it describes)."""
        state = self.load(files) if resume else None
        if state is None:
            self.remove()
            return None, [None] * len(files)
        return state, [int(size) for size in state["bytes"]]

    def saved_digest(self) -> str | None:
        """The digest the checkpoint was saved with; None without a checkpoint, or an unreadable one."""
        if not self.path.is_file():
            return None
        try:
            with self._opened() as f, np.load(f) as state:
                return str(state["plan_digest"])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, InputError):
            return None

    def _opened(self):
        """The checkpoint file opened as untrusted (a regular file within a budget)."""
        from neva_pack.files import MAX_OUTPUT_TABLE_BYTES, open_file

        return open_file(self.path, what="", max_bytes=MAX_OUTPUT_TABLE_BYTES, error=InputError)

    def save(self, open_files: list, **arrays) -> None:
        sizes = []
        for f in open_files:
            f.flush()
            os.fsync(f.fileno())
            sizes.append(f.tell())
        np.savez(self.staging, bytes=np.asarray(sizes, dtype=np.int64), plan_digest=np.str_(self.plan_digest), **arrays)
        os.replace(self.staging, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def publish(
    prefix: Path, renames: dict[Path, Path], checksummed: list[Path], meta: PackedMeta, known: dict[Path, str] | None = None
) -> PackedMeta:  # fmt: skip
    """Checksum, rename the temporary files into place, write the meta last. Returns the meta written.

    Crash-safe at every step: the meta is first written under its temporary name (``pending_meta_path``),
    then the files are renamed, then the meta is renamed into place. A run killed before the last
    rename has published nothing (no meta); the files already renamed stay recognisably the format's
    own by the pending meta, so that --resume (or --overwrite) replaces them.

    ``renames``: final path -> temporary path; ``checksummed``: other files the output consists of;
    ``known``: (temporary or other) path -> checksum computed while it was written (not read again).
    """
    output_dir = Path(prefix).parent
    known = known or {}
    checksums = {relative_name(output_dir, final): known.get(tmp) or file_checksum(tmp) for final, tmp in renames.items()}
    checksums.update({relative_name(output_dir, path): known.get(path) or file_checksum(path) for path in checksummed})
    meta = meta.replace(checksums=checksums)
    pending = pending_meta_path(prefix)
    with open(pending, "w", encoding="utf-8") as f:  # first, durably: what the renames below are of
        f.write(json.dumps(meta.to_json(), indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for final, tmp in renames.items():
        os.replace(tmp, final)
    os.replace(pending, meta_path(prefix))
    return meta


def pending_meta_path(prefix: Path) -> Path:
    """Where ``publish`` writes the meta before it renames the files into place (its temporary name,
    among every format's temporaries): while it is there, the final files beside it are the format's
    own (``published_as``), so that a run killed between two renames resumes, or is overwritten."""
    meta = meta_path(prefix)
    return meta.with_name(meta.name + TMP_SUFFIX)


def published_as(prefix: Path, name: str) -> bool:
    """Whether ``prefix`` is published, or being published, as format ``name``: its meta, or the meta
    its publish wrote before renaming the files into place, says so (unchecked)."""
    return meta_is_of(meta_path(prefix), name) or meta_is_of(pending_meta_path(prefix), name)
