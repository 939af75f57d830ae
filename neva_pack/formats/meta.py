"""What every packed output says about itself: the typed meta, and a pack as a reader gives it.

The meta (``<prefix>.meta.json``) is written last and marks a complete output. It records
everything a reader needs, the processor's normalisation included, so that no reader ever
imports transformers. Its ``format`` field picks the reader (``formats.FORMATS``); a format
that has more to say keeps it in ``layout`` (parsed by that format only).

Pixels are normalised on read with the processor's own float ops: ``core.Normalisation``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from neva_pack.core import ImageRun, InputError, Normalisation

META_VERSION = 2
"""Version of the meta schema below (1: untyped dict, before formats/; refused)."""
CHECKSUM_ALGORITHM = "xxh3_128"


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageTokenIds:
    patch: int
    """Id of every image-embedding position."""
    start: int | None
    """Id opening an image run, or None."""
    end: int | None
    """Id closing an image run, or None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Counts:
    records: int
    """Input records read."""
    samples: int
    """Samples packed (records not skipped)."""
    skipped: int
    """Records skipped (listed in skipped.jsonl)."""
    truncated: int
    """Samples cut to max_seq_length."""
    packs: int
    """Packs written."""
    images: int
    """Image instances in the packs (an image used by two samples counts twice)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingSettings:
    """How the packs were made: what a reader, a trainer (alignment, budgets, rank balance) and a
    resume (which must pack the same way) need to know of the packing. The meta file keeps these as
    flat keys in this order (between ``pad_id`` and ``image_token_ids``): nesting them here changed no
    byte of it, so metas written before read as they always did."""

    pad_to_multiple_of: int
    """Each sample's positions are rounded up to a multiple of this (1: no padding)."""
    max_seq_length: int
    """Pack capacity in positions."""
    algorithm: str
    """Packing algorithm."""
    seed: int
    """Packing seed."""
    max_samples_per_pack: int | None
    """Cap on samples per pack, if any."""
    balance_data_parallel: int | None
    """Packs ordered so every N consecutive packs cost alike (--balance_data_parallel), if asked."""
    max_images_per_pack: int | None = None
    """Cap on images per pack, if any (--max_images_per_pack)."""
    max_image_tokens_per_pack: int | None = None
    """Cap on image tokens per pack, if any (--max_image_tokens_per_pack)."""
    max_video_tokens_per_pack: int | None = None
    """Cap on video tokens (positions of video clips' runs) per pack, if any (--max_video_tokens_per_pack)."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The meta keys these settings are written under, in the order they are written."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_json(cls, data: dict) -> "PackingSettings":
        """The settings among a flat mapping's keys (a meta file's, or the writing settings by meta key);
        a budget added within the meta's version may be absent (written without it: None)."""
        return cls(**{name: data[name] for name in cls.keys() if name not in _OPTIONAL_FIELDS or name in data})

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.keys() if name not in _WRITTEN_WHEN_SET or getattr(self, name) is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedMeta:
    """The contents of ``<prefix>.meta.json``."""

    format: str
    """Registry key of the on-disk format (``formats.FORMATS``): picks the reader."""
    version: int
    """META_VERSION when written; a reader refuses a newer one."""
    num_packs: int
    """Packs in the output."""
    image_shape: tuple[int, int, int] | None
    """(3, H, W) of every image; None (null) for dynamic-resolution images, each at its own size."""
    normalisation: Normalisation
    """The processor's rescale/mean/std: how uint8 pixels become the model's float input."""
    dataset: str
    """File name of the input records."""
    template: str
    """Conversation template name."""
    tokenization: str
    """Token convention (templates.TOKENIZATIONS): nemo or llava."""
    tokenizer: str
    """Tokenizer path given to the run."""
    vocab_size: int
    """Tokenizer vocabulary size."""
    encoder: str
    """Vision encoder name (its processor settings)."""
    image_aspect_ratio: str
    """square or pad."""
    image_positions: int | None
    """Sequence positions one image occupies; None for dynamic-resolution images (each its own run
    length, in the format's index)."""
    image_token_ids: ImageTokenIds
    """How an image run is spelled in the tokens."""
    ignore_index: int
    """Label of untrained positions (and of padding)."""
    pad_id: int
    """Token id of padding positions."""
    packing: PackingSettings
    """How the packs were made (written as flat keys: ``PackingSettings``)."""
    counts: Counts
    """What the run read, packed and skipped."""
    layout: dict = field(default_factory=dict)
    """Format-specific description of the files (parsed by that format's reader only)."""
    checksums: dict[str, str] = field(default_factory=dict)
    """Output-dir-relative file name -> xxh3-128 of every file the output consists of."""
    image_processor: dict | None = None
    """Dynamic-resolution images: what rebuilds their processor offline (``images.processor_from_record``):
    {"family", "encoder", "preprocessor_config", "arithmetic", "min_pixels", "max_pixels"} and the
    encoder's "processor", "model_config" and "patch_size". Absent (None) for fixed crops."""

    @property
    def dynamic(self) -> bool:
        """Whether the images are dynamic-resolution ones (no one shape)."""
        return self.image_shape is None

    @property
    def crop_size(self) -> tuple[int, int] | None:
        return None if self.image_shape is None else tuple(self.image_shape[1:])

    @property
    def image_run(self) -> ImageRun:
        """The image run the packs hold (the meta spells it as image_positions and image_token_ids)."""
        ids = self.image_token_ids
        positions = None if self.image_positions is None else int(self.image_positions)
        return ImageRun(positions=positions, patch_id=int(ids.patch), start_id=ids.start, end_id=ids.end)

    # The packing settings read through the meta, as when they were its own fields: readers of a meta
    # (reading/, training/) ask for ``meta.max_seq_length``; code that builds one says ``meta.packing``.
    @property
    def pad_to_multiple_of(self) -> int:
        return self.packing.pad_to_multiple_of

    @property
    def max_seq_length(self) -> int:
        return self.packing.max_seq_length

    @property
    def algorithm(self) -> str:
        return self.packing.algorithm

    @property
    def seed(self) -> int:
        return self.packing.seed

    @property
    def max_samples_per_pack(self) -> int | None:
        return self.packing.max_samples_per_pack

    @property
    def balance_data_parallel(self) -> int | None:
        return self.packing.balance_data_parallel

    @property
    def max_images_per_pack(self) -> int | None:
        return self.packing.max_images_per_pack

    @property
    def max_image_tokens_per_pack(self) -> int | None:
        return self.packing.max_image_tokens_per_pack

    @property
    def max_video_tokens_per_pack(self) -> int | None:
        return self.packing.max_video_tokens_per_pack

    def replace(self, **changes) -> "PackedMeta":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        data = {
            "format": self.format,
            "version": self.version,
            "num_packs": self.num_packs,
            "image_shape": None if self.image_shape is None else list(self.image_shape),
            "crop_size": None if self.crop_size is None else list(self.crop_size),
            "normalisation": self.normalisation.to_json(),
        }
        if self.image_processor is not None:  # absent for fixed crops: their metas stay as they were
            data["image_processor"] = self.image_processor
        for name in _PLAIN_FIELDS:
            data[name] = getattr(self, name)
        data.update(self.packing.to_json())
        data["image_token_ids"] = dataclasses.asdict(self.image_token_ids)
        data["counts"] = dataclasses.asdict(self.counts)
        data["layout"] = self.layout
        data["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "files": dict(self.checksums)}
        data["meta_checksum"] = _self_checksum(data)
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "meta") -> "PackedMeta":
        """Parse and check; InputError on anything this version does not understand."""
        if not isinstance(data, dict) or not isinstance(data.get("version"), int):
            raise InputError(f"{where}: not a neva_pack meta")
        if data["version"] > META_VERSION:
            raise InputError(f"{where}: version {data['version']} is newer than this neva_pack reads ({META_VERSION})")
        if data["version"] < META_VERSION:
            raise InputError(f"{where}: written by an older neva_pack (meta version {data['version']}); "
                             "run it again with --overwrite")  # fmt: skip
        known = {"crop_size", "meta_checksum", *PackingSettings.keys(), *(f.name for f in dataclasses.fields(cls))} - {"packing"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{where}: unknown field(s) {', '.join(unknown)}")
        try:
            checksums = data["checksums"]
            if checksums.get("algorithm") != CHECKSUM_ALGORITHM:
                raise InputError(f"{where}: checksum algorithm {checksums.get('algorithm')!r}, expected {CHECKSUM_ALGORITHM}")
            meta = cls(
                format=str(data["format"]),
                version=data["version"],
                num_packs=int(data["num_packs"]),
                image_shape=None if data["image_shape"] is None else tuple(int(v) for v in data["image_shape"]),
                normalisation=Normalisation.from_json(data["normalisation"]),
                image_token_ids=ImageTokenIds(**data["image_token_ids"]),
                counts=Counts(**data["counts"]),
                layout=dict(data["layout"]),
                checksums=dict(checksums["files"]),
                image_processor=None if data.get("image_processor") is None else dict(data["image_processor"]),
                packing=PackingSettings.from_json(data),
                **{name: data[name] for name in _PLAIN_FIELDS},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{where}: malformed ({exc.__class__.__name__}: {exc})") from None
        if meta.image_shape is None:
            if data.get("crop_size") is not None or meta.image_processor is None:
                raise InputError(f"{where}: image_shape null (dynamic-resolution images) needs crop_size null and image_processor")
        elif list(meta.crop_size) != list(data.get("crop_size", meta.crop_size) or ()) or len(meta.image_shape) != 3:
            raise InputError(f"{where}: crop_size {data.get('crop_size')} disagrees with image_shape {list(meta.image_shape)}")
        return meta


_PLAIN_FIELDS = (
    "dataset", "template", "tokenization", "tokenizer", "vocab_size", "encoder", "image_aspect_ratio", "image_positions",
    "ignore_index", "pad_id",
)  # fmt: skip
"""The meta's own fields written as they are, in this order; the packing settings' keys follow them."""


_OPTIONAL_FIELDS = ("max_images_per_pack", "max_image_tokens_per_pack", "max_video_tokens_per_pack")
"""Packing settings added within the meta's version: a meta without them was written without them (None)."""
_WRITTEN_WHEN_SET = ("max_video_tokens_per_pack",)
"""Packing settings written only when set: a meta without one is byte-identical to one written before it existed."""


def _self_checksum(data: dict) -> str:
    import xxhash

    body = {key: value for key, value in data.items() if key != "meta_checksum"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def meta_checksum_ok(data: dict) -> bool:
    """Whether the meta's own checksum matches its content (what verify checks of the meta file)."""
    return data.get("meta_checksum") == _self_checksum(data)


def checksum_problems(expected: dict[str, str], actual: dict[str, str | None]) -> list[str]:
    """The files whose checksum is not the meta's, one line each (what verify reports, what convert
    and stats refuse). ``expected``: the meta's checksums (or some of them); ``actual``: file name ->
    its checksum now, None when it is missing."""
    return [
        f"{name}: missing" if actual[name] is None else f"{name}: checksum mismatch (the file was changed or corrupted)"
        for name, checksum in expected.items()
        if actual[name] != checksum
    ]


def read_meta_json(path: Path) -> dict:
    """A meta file's JSON object, read as untrusted (a regular file, within a budget); InputError
    as one line naming it otherwise."""
    from neva_pack.files import MAX_OUTPUT_JSON_BYTES, read_json

    if not os.path.lexists(path):
        raise InputError(f"{path}: missing (the output is incomplete or not a neva_pack output)")
    value = read_json(path, what="", max_bytes=MAX_OUTPUT_JSON_BYTES, error=InputError)
    if not isinstance(value, dict):
        raise InputError(f"{path}: unreadable (not a JSON object)")
    return value


def read_meta(path: Path) -> PackedMeta:
    return PackedMeta.from_json(read_meta_json(path), where=str(path))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPack:
    """One pack as a reader returns it, before images are normalised (or after, for float formats)."""

    cu_seqlens: np.ndarray
    """int64 (n + 1): boundaries of the samples in the pack's buffer (padded lengths)."""
    cu_seqlens_unpadded: np.ndarray
    """int64 (n + 1): cumulative real lengths."""
    tokens: np.ndarray
    """int64 (cu_seqlens[-1],): padding positions hold pad_id."""
    labels: np.ndarray
    """int64: ignore_index on untrained and padding positions."""
    pixels: np.ndarray | None
    """uint8 (N, 3, H, W) when the format stores pixels (then ``images`` is None)."""
    images: np.ndarray | None
    """float32 (N, 3, H, W) when the format stores normalised values (then ``pixels`` is None)."""
    num_images: int
    """Real images of the pack (a zero image standing in for none is not counted)."""
    image_lengths: np.ndarray | None = None
    """int64 run length of each image instance, placeholder order."""
    stored_images: list | None = None
    """images.StoredImage of each image instance (dynamic families); then pixels and images are None."""
