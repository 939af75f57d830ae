"""Megatron Bridge's packed SFT files, as its ``prepare_gpt_sft_packed_data`` writes them (text only).

    output_dir/training_<size>.npy                 np.save of an object array: one dict per pack
    output_dir/<size>_metadata.jsonl               one JSON list holding one dict: Bridge's packing metadata
    output_dir/packed_seq_dataset[_<size>].plan.npz  the plan table (which records, their real lengths)
    output_dir/packed_seq_dataset[_<size>].meta.json format "bridge": the two files above, checksums

    pack dict (plain Python ints and bools: Bridge unpickles them with a restricted unpickler)
      input_ids     each stored sample back to back: its ids plus its final next token
      loss_mask     aligned with the labels: True where the next token is trained, False at the end
      seq_start_id  where each stored sample starts (no end entry)

Bridge stores a sample as the ids it was tokenized to, one more than the positions it trains on;
its collate takes tokens ids[a:b-1] and labels ids[a+1:b]. Our packs hold next-token pairs
(labels = ids[1:] where trained), so a sample's stored ids are its tokens and its last label (the
pad id when that label is not trained), and its mask says which labels are trained::

    tokens [1 5 6 7], labels [-1 -1 7 2]  ->  input_ids [1 5 6 7 2], loss_mask [F F T T F]

A sample padded to a multiple (``--pad_to_multiple_of``, Bridge's ``pad_seq_to_mult``) is stored
with the padding after its final id, untrained, as Bridge pads it before packing (its mask values
then ints, as Bridge's are). Bridge pads with its tokenizer's EOS: ``--pad_id`` set to that id
gives Bridge's bytes. The meta, the plan table and the real lengths it keeps let our reader give
exactly the packs the other formats give; images cannot be stored (``holds_images`` is False).

The Parquet variant (``formats/bridge_parquet.py``) differs only in the rows' file: ``RowFile``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from neva_pack.core import InputError, parsing
from neva_pack.formats.base import Checkpoint, Limits, PrefixFiles, WriteSpec, publish, published_as
from neva_pack.formats.meta import PackedMeta, ReadPack, read_meta
from neva_pack.formats.trust import verify_hint
from neva_pack.files import OutputFile, open_output, regular_output
from neva_pack.packing import PlanTable, read_plan_table, real_positions, with_padding, write_plan_table
from neva_pack.files import (
    TMP_SUFFIX, checkpoint_paths, meta_path, pack_size_of, packed_prefix, plan_path, prefix_file, relative_name, tmp_prefix,
)  # fmt: skip

__all__ = [
    "FORMAT", "BridgeFormat", "NpyRows", "PreparedPacks", "Reader", "RowFile", "Rows", "Writer", "metadata_name", "read_rows",
    "write_rows",
]  # fmt: skip

IDS, MASK = ".bridge_ids.bin", ".bridge_mask.bin"
"""The writer's temporary files: int64 stored ids and uint8 mask of every pack, back to back."""
METADATA_TMP = ".bridge_metadata.jsonl"
METADATA_KEYS = ("dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency", "pack_size",
                 "min_packed_seqlen")  # fmt: skip


def metadata_name(size: int) -> str:
    """Bridge's metadata file of a pack size (``PackedSequenceSpecs.packed_metadata_path``)."""
    return f"{size}_metadata.jsonl"


class Rows(Protocol):
    """Packs as stored: ``row(p)`` -> (input_ids int64, loss_mask bool, seq_start_id int64)."""

    def __len__(self) -> int: ...

    def row(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RowFile:
    """The file Bridge reads the packs from: its name, how rows are written and read back
    (module-level functions: a reader is pickled into DataLoader workers with it)."""

    name_template: str
    """The file of a pack size, ``{size}`` in it (``PackedSequenceSpecs.packed_train_data_path``)."""
    tmp_suffix: str
    """Its temporary name beside the temporary prefix."""
    write: Callable[[Path, list[dict]], None]
    read: Callable[[Path], Rows]

    def data_name(self, size: int) -> str:
        return self.name_template.format(size=size)


# --- the .npy file -------------------------------------------------------------------------------


def _empty_array(subtype, shape, dtype):
    """numpy's ``_reconstruct`` as ``np.save`` pickles it: an empty ndarray that the pickle's
    BUILD then fills from bytes or objects the file holds. The real one allocates any ``shape``
    it is handed: a file of a few bytes asking for 10**10 elements would take the memory first."""
    if subtype is not np.ndarray or tuple(shape) != (0,) or dtype != b"b":
        raise pickle.UnpicklingError(f"an array rebuilt as {getattr(subtype, '__name__', subtype)} {shape!r}, not as np.save writes one")
    return np.ndarray.__new__(np.ndarray, (0,), dtype)


_PLAIN_DTYPE = re.compile(r"[|<>=]?(?:b1|[iuf][1248]|O8|O4)")


def _plain_dtype(spec, align=False, copy=True):
    """``np.dtype`` for the plain dtypes a row array holds (objects, integers, floats, bools)."""
    if not isinstance(spec, str) or not _PLAIN_DTYPE.fullmatch(spec):
        raise pickle.UnpicklingError(f"dtype {spec!r} is not part of a packed SFT file")
    return np.dtype(spec, align, copy)


class _RowUnpickler(pickle.Unpickler):
    """Rebuilds an object array of dicts of lists, and nothing else: a pickle can run code (any
    global it names is called), so the only globals are numpy's array rebuild, bounded to what
    ``np.save`` writes (an empty array filled from the file, plain dtypes); dicts, lists, ints,
    strings and bools are pickle opcodes, not globals. Anything else is an ``UnpicklingError`` that
    the reader turns into one line naming the file."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"): _empty_array, ("numpy._core.multiarray", "_reconstruct"): _empty_array,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): _plain_dtype}  # fmt: skip

    def find_class(self, module, name):
        allowed = self.ALLOWED.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a packed SFT file")
        return allowed


def write_rows(path: Path, rows: list[dict]) -> None:
    """``training_<size>.npy``: as Bridge's ``np.save`` of its rows."""
    array = np.empty(len(rows), dtype=object)
    array[:] = rows
    with open(path, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: Path) -> "NpyRows":
    """The rows of a ``.npy``, unpickled with only what an object array of dicts needs."""
    with parsing(path), open_output(path) as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        if dtype != object or len(shape) != 1:
            raise ValueError(f"an array of {dtype} {shape}, not one dict per pack")
        try:  # from the bytes read: a frame's length (up to 2**63) then can only find the pickle cut short
            array = _RowUnpickler(io.BytesIO(f.read())).load()
        except (pickle.UnpicklingError, OverflowError) as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        keys = ("input_ids", "loss_mask", "seq_start_id")
        if not (isinstance(array, np.ndarray) and array.shape == tuple(shape)
                and all(isinstance(row, dict) and all(isinstance(row.get(k), list) for k in keys) for row in array)):  # fmt: skip
            raise ValueError(f"not {shape[0]} rows of Bridge's dicts of lists {', '.join(keys)}")
    return NpyRows(array)


class NpyRows:
    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def row(self, p: int):
        row = self.array[p]
        return (np.asarray(row["input_ids"], dtype=np.int64), np.asarray(row["loss_mask"], dtype=bool),
                np.asarray(row["seq_start_id"], dtype=np.int64))  # fmt: skip


NPY = RowFile(name_template="training_{size}.npy", tmp_suffix=".bridge.npy", write=write_rows, read=read_rows)


# --- writing ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreparedPacks:
    """Packs as Bridge stores them: what ``Writer.add_prepared`` appends. ``prepare`` is pure."""

    ids: np.ndarray
    """int64 stored ids of the packs, back to back."""
    mask: np.ndarray
    """uint8 loss mask, aligned with ``ids``."""
    lists: dict[str, np.ndarray]
    """int64 ``samples`` and ``stored`` per pack, ``starts`` (seq_start_id) per sample."""


def prepare(packs, spec: WriteSpec) -> PreparedPacks:
    """Each sample's stored ids and mask; ValueError for a pack with images, or labels that are
    not the next tokens (Bridge derives both from one list of ids)."""
    ids, mask, samples, stored, starts = [], [], [], [], []
    for pack in packs:
        if len(pack.image_indices):
            raise ValueError("Megatron Bridge's packed SFT files hold text only: a pack with images")
        bounds = np.concatenate([[0], np.cumsum(pack.lengths)]).tolist()
        at = 0
        for a, b, padded in zip(bounds[:-1], bounds[1:], pack.padded_lengths.tolist()):
            tokens, labels = pack.tokens[a:b].astype(np.int64), pack.labels[a:b].astype(np.int64)
            trained = labels != spec.ignore_index
            if np.any(trained[:-1] & (labels[:-1] != tokens[1:])):
                raise ValueError("a trained label that is not the next token: Bridge stores one list of ids")
            last = labels[-1] if trained[-1] else spec.pad_id
            pad = padded - (b - a)
            ids.append(np.concatenate([tokens, [last], np.full(pad, spec.pad_id, np.int64)]))
            mask.append(np.concatenate([trained, np.zeros(pad + 1, bool)]).astype(np.uint8))
            starts.append(at)
            at += padded + 1
        samples.append(len(pack.lengths))
        stored.append(at)

    def joined(arrays, dtype) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate(arrays) if arrays else np.zeros(0), dtype=dtype)

    return PreparedPacks(ids=joined(ids, "<i8"), mask=joined(mask, np.uint8),
                         lists={"samples": np.array(samples, np.int64), "stored": np.array(stored, np.int64),
                                "starts": np.array(starts, np.int64)})  # fmt: skip


def rows_of(ids: np.ndarray, mask: np.ndarray, lists: dict, int_masks: bool) -> list[dict]:
    """Bridge's rows: plain Python ints (and bools) in lists. ``int_masks``: each sample's mask
    values as ints with a final False, as Bridge's are once it pads samples to a multiple."""
    rows, at, first = [], 0, 0
    starts = lists["starts"]
    for samples, stored in zip(lists["samples"].tolist(), lists["stored"].tolist()):
        row_starts = starts[first : first + samples].tolist()
        row_mask = mask[at : at + stored].astype(bool).tolist()
        if int_masks:
            ends = set((np.asarray(row_starts[1:] + [stored]) - 1).tolist())
            row_mask = [False if k in ends else int(v) for k, v in enumerate(row_mask)]
        rows.append({"input_ids": ids[at : at + stored].tolist(), "loss_mask": row_mask, "seq_start_id": row_starts})
        at += stored
        first += samples
    return rows


def packing_metadata(lists: dict, pack_size: int) -> dict:
    """Bridge's metadata of the packs (its ``create_packing_strategy``'s figures), in its key order."""
    samples, stored, starts = lists["samples"], lists["stored"], lists["starts"]
    loads = stored - samples  # positions trained on: one stored id per sample is only a label
    firsts = np.concatenate([[0], np.cumsum(samples)]).tolist()
    runtime = [int(np.max(np.diff([*starts[a:b].tolist(), end]))) - 1
               for a, b, end in zip(firsts[:-1], firsts[1:], stored.tolist())]  # fmt: skip
    return dict(zip(METADATA_KEYS, (
        max(runtime, default=0),
        int(np.max(samples)) if len(samples) else 0,
        round(float(np.sum(samples)) / len(samples), 2) if len(samples) else 0.0,
        round(float(np.sum(loads)) / len(loads) / pack_size * 100, 2) if len(loads) else 0.0,
        int(pack_size),
        int(np.min(loads)) if len(loads) else 0,
    )))  # fmt: skip


class Writer:
    """Appends each pack's stored ids and mask to temporary files; ``publish`` writes Bridge's
    rows and metadata from them. Checkpoints save the files' sizes and the per-pack lists."""

    def __init__(self, prefix: Path, spec: WriteSpec, rows: RowFile, name: str, resume: bool = False):
        self.prefix = Path(prefix)
        self.spec = spec
        self.rows, self.name = rows, name
        self._checkpoint = Checkpoint(self.prefix, spec.plan_digest)
        tmp = self._checkpoint.tmp
        self._paths = [prefix_file(tmp, IDS), prefix_file(tmp, MASK)]
        state, sizes = self._checkpoint.start(self._paths, resume)
        self._lists: dict[str, list] = {"samples": [], "stored": [], "starts": []}
        if state is None:
            self.num_packs = 0
        else:
            self._lists = {name: state[name].tolist() for name in self._lists}
            self.num_packs = int(state["packs"])
        self._files = [OutputFile(path, resume_at=size, checksum=False) for path, size in zip(self._paths, sizes)]

    def add(self, pack) -> None:
        self.add_prepared(prepare([pack], self.spec))

    def add_prepared(self, prepared: PreparedPacks, pixels=None) -> None:
        """Packs as ``prepare`` gave them (no pixels: the format is text only)."""
        self._files[0].write(prepared.ids.data)
        self._files[1].write(prepared.mask.data)
        for name, values in prepared.lists.items():
            self._lists[name] += values.tolist()
        self.num_packs += len(prepared.lists["samples"])

    def checkpoint(self) -> None:
        self._checkpoint.save([f.file for f in self._files], packs=np.int64(self.num_packs),
                              **{name: np.asarray(values, dtype=np.int64) for name, values in self._lists.items()})  # fmt: skip

    def publish(self, plan: PlanTable, extra_files: list[Path], meta: PackedMeta) -> PackedMeta:
        """Bridge's rows file and metadata, the plan table; renamed into place; the meta last."""
        for f in self._files:
            f.close()
        tmp = self._checkpoint.tmp
        ids, mask = np.fromfile(self._paths[0], dtype="<i8"), np.fromfile(self._paths[1], dtype=np.uint8)
        lists = {name: np.asarray(values, dtype=np.int64) for name, values in self._lists.items()}
        size = meta.packing.max_seq_length
        self.rows.write(prefix_file(tmp, self.rows.tmp_suffix), rows_of(ids, mask, lists, (meta.packing.pad_to_multiple_of or 1) > 1))
        prefix_file(tmp, METADATA_TMP).write_text(json.dumps([packing_metadata(lists, size)]), encoding="utf-8")
        write_plan_table(plan_path(tmp), plan)
        output_dir = self.prefix.parent
        data, metadata = output_dir / self.rows.data_name(size), output_dir / metadata_name(size)
        renames = {plan_path(self.prefix): plan_path(tmp), data: prefix_file(tmp, self.rows.tmp_suffix),
                   metadata: prefix_file(tmp, METADATA_TMP)}  # fmt: skip
        layout = {"data": relative_name(output_dir, data), "metadata": relative_name(output_dir, metadata)}
        meta = meta.replace(format=self.name, num_packs=self.num_packs, layout=layout)
        meta = publish(self.prefix, renames, extra_files, meta)
        for path in self._paths:
            path.unlink(missing_ok=True)
        self._checkpoint.remove()
        return meta


# --- reading ---------------------------------------------------------------------------------------


class Reader:
    """Bridge's rows, read back as every format's packs (the plan table gives the real lengths)."""

    def __init__(self, prefix: Path, meta: PackedMeta | None = None, rows: RowFile = NPY):
        self.prefix = Path(prefix)
        self.meta = meta if meta is not None else read_meta(meta_path(self.prefix))
        self.image_shape = tuple(self.meta.image_shape)
        self._row_file = rows
        layout = self.meta.layout
        if not isinstance(layout, dict) or not {"data", "metadata"} <= set(layout):
            raise InputError(f"{meta_path(self.prefix)}: its layout names no data/metadata file (not this format)")
        self.data_path = self.prefix.parent / layout["data"]
        self.metadata_path = self.prefix.parent / layout["metadata"]
        self.rows = rows.read(self.data_path)
        self.pad_id, self.ignore_index = self.meta.pad_id, self.meta.ignore_index
        self._plan: PlanTable | None = None

    def __getstate__(self):  # DataLoader workers (spawn) read the file again
        return {"prefix": self.prefix, "meta": self.meta, "rows": self._row_file}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["meta"], state["rows"])

    def __len__(self) -> int:
        return len(self.rows)

    def plan_table(self) -> PlanTable:
        if self._plan is None:
            self._plan = read_plan_table(plan_path(self.prefix))
        return self._plan

    def pack(self, p: int, images: bool = True) -> ReadPack:
        plan = self.plan_table()
        first, last = int(plan.offsets[p]), int(plan.offsets[p + 1])
        lengths, padded = plan.length[first:last].astype(np.int64), plan.padded_length[first:last].astype(np.int64)
        ids, mask, _ = self.rows.row(p)
        if len(ids) != len(mask) or len(ids) < int((padded + 1).sum()):  # a data file edited: the open hashes no data
            raise InputError(f"{self.data_path}: pack {p} holds {len(ids)} ids, its plan table {int((padded + 1).sum())}; {verify_hint(self.prefix.parent)}")
        at = real_positions(lengths, padded + 1)  # stored samples hold one id more than their positions
        tokens = ids[at]
        labels = np.where(mask[at], ids[at + 1], self.ignore_index)  # every stored sample ends with its final id
        return ReadPack(
            cu_seqlens=np.concatenate([[0], np.cumsum(padded)]),
            cu_seqlens_unpadded=np.concatenate([[0], np.cumsum(lengths)]),
            tokens=with_padding(tokens, lengths, padded, self.pad_id),
            labels=with_padding(labels, lengths, padded, self.ignore_index),
            pixels=np.zeros((0, *self.image_shape), np.uint8) if images else None, images=None, num_images=0,
        )

    def images(self, p: int, device=None, dtype=None):
        """One zero image, as every format gives for a pack without images."""
        import torch

        return torch.zeros((1, *self.image_shape), dtype=dtype or torch.float32, device=device)

    def close(self) -> None:
        self.rows = None


def check(reader: Reader, result) -> None:
    """The rows agree with the plan table (stored lengths, starts, untrained padding) and the metadata."""
    plan = reader.plan_table()
    if len(reader.rows) != len(plan.offsets) - 1:
        result.add(f"{reader.data_path.name}: {len(reader.rows)} packs, the plan table {len(plan.offsets) - 1}")
        return
    for p in range(len(reader.rows)):
        first, last = int(plan.offsets[p]), int(plan.offsets[p + 1])
        stored = plan.padded_length[first:last].astype(np.int64) + 1
        ids, mask, starts = reader.rows.row(p)
        expected = np.concatenate([[0], np.cumsum(stored)[:-1]])
        if len(ids) != int(stored.sum()) or len(mask) != len(ids) or not np.array_equal(starts, expected):
            result.add(f"{reader.data_path.name}: pack {p}'s samples disagree with the plan table's lengths")
            return
        tail = np.ones(len(ids), bool)
        tail[real_positions(plan.length[first:last], stored)] = False
        if np.any(mask[tail]):
            result.add(f"{reader.data_path.name}: pack {p} trains a padding position or a sample's final id")
            return
    try:
        with parsing(reader.metadata_path):
            metadata = json.loads(regular_output(reader.metadata_path).read_text(encoding="utf-8"))
            if not (isinstance(metadata, list) and metadata and set(metadata[-1]) == set(METADATA_KEYS)):
                raise ValueError("not a list of Bridge's packing metadata")
    except InputError as exc:
        result.add(str(exc))


# --- the format ------------------------------------------------------------------------------------


class BridgeFormat:
    """Megatron Bridge's packed SFT rows (``PackedFormat``); ``rows``: the file they are stored in."""

    needs_pixels = False
    uses_image_pool = False
    holds_images = False
    holds_dynamic_images = False
    """Text only: an encoder of images at their own sizes is refused up front (a fixed-crop run's image
    records are skipped, as the text-only format it is)."""
    holds_videos = False
    limits = Limits(max_pack=2**31 - 1, max_integer=2**63 - 1, why="Megatron Bridge's files store Python ints")

    def __init__(self, name: str, rows: RowFile, description: str):
        self.name = name
        self.rows = rows
        self.description = description

    def check_settings(self, **settings) -> None:
        self.limits.check(**settings)

    def files(self, prefix: Path) -> PrefixFiles:
        """Beside our meta and plan table, Bridge's two files named by pack size: the prefix's own
        (``packed_seq_dataset_<size>``) or, for the plain prefix, its meta's max_seq_length."""
        prefix = Path(prefix)
        size = pack_size_of(prefix)
        if size is None:
            size = _meta_size(meta_path(prefix))
        tmp = tmp_prefix(prefix)
        checkpoint, staging = checkpoint_paths(prefix)
        meta = meta_path(prefix)
        bridge = () if size is None else (prefix.parent / self.rows.data_name(size), prefix.parent / metadata_name(size))
        return PrefixFiles(
            final=(meta, plan_path(prefix), *bridge),
            plan_table=plan_path(prefix),
            temporary=(prefix_file(tmp, IDS), prefix_file(tmp, MASK), prefix_file(tmp, self.rows.tmp_suffix),
                       prefix_file(tmp, METADATA_TMP), plan_path(tmp), checkpoint, staging,
                       meta.with_name(meta.name + TMP_SUFFIX)),  # fmt: skip
            checkpoint=checkpoint,
        )

    def trusted_files(self, prefix: Path, meta: PackedMeta) -> tuple[Path, ...]:
        """The plan table (each sample's real length) and Bridge's metadata file; not the rows."""
        metadata = meta.layout.get("metadata") if isinstance(meta.layout, dict) else None
        return (plan_path(prefix), *((Path(prefix).parent / metadata,) if isinstance(metadata, str) else ()))

    def owns(self, path: Path) -> bool:
        path = Path(path)
        if path.is_symlink() or not path.is_file():
            return False
        candidates = [path.with_name(path.name.split(".", 1)[0])]
        match = re.fullmatch(r"(?:training_(\d+)\..*|(\d+)_metadata\.jsonl)", path.name)
        if match:
            size = int(match.group(1) or match.group(2))
            candidates += [packed_prefix(path.parent, size), packed_prefix(path.parent)]
        for prefix in candidates:
            files = self.files(prefix)
            if path in files.temporary:
                return True
            if path in files.final and published_as(prefix, self.name):
                return True
        return False

    def writer(self, prefix: Path, spec: WriteSpec, resume: bool = False) -> Writer:
        return Writer(prefix, spec, self.rows, self.name, resume=resume)

    def reader(self, prefix: Path, meta: PackedMeta | None = None) -> Reader:
        return Reader(prefix, meta, self.rows)

    def prepare(self, packs: Sequence, spec: WriteSpec) -> PreparedPacks:
        return prepare(packs, spec)

    def check(self, reader: Reader, result) -> None:
        check(reader, result)

    def summary_line(self, data_prefix: str) -> str:
        return f"{data_prefix} ({self.name}: Megatron Bridge's PackedSequenceSpecs reads the files its meta names)"


def _meta_size(path: Path) -> int | None:
    """max_seq_length of a meta, if there is one that says it."""
    from neva_pack.files import MAX_OUTPUT_JSON_BYTES, read_json

    try:
        size = read_json(path, what="", max_bytes=MAX_OUTPUT_JSON_BYTES, error=InputError).get("max_seq_length")
    except (InputError, AttributeError):
        return None
    return size if type(size) is int else None


FORMAT = BridgeFormat("bridge", NPY, "Megatron Bridge's packed SFT .npy, text only (Bridge's packed SFT dataset)")
