"""The llamafactory format: LLaMA-Factory's own neat-packed rows, a directory its ``tokenized_path`` loads.

    output_dir/packed_seq_dataset.llamafactory/              what ``tokenized_path`` names (``load_from_disk``)
        data-00000-of-00001.arrow                             the rows, an Arrow IPC stream, one row per pack
        dataset_info.json, state.json                         what ``datasets.load_from_disk`` reads beside it
    output_dir/packed_seq_dataset.llamafactory.index.npz     the plan table, and per image its size and tokens
    output_dir/packed_seq_dataset.meta.json                  format "llamafactory": cutoff_len, checksums

LLaMA-Factory loads a non-empty ``tokenized_path`` with ``load_from_disk``, ignoring its other data
arguments; with ``neat_packing: true`` its collator reads what its packing processor writes::

    input_ids        int32 (cutoff_len)       the samples' ids end to end, then pad ids
    attention_mask   int32                    sample k's positions k + 1 (1, 2, ...), padding 0
    position_ids     int32                    0, 1, ... restarting per sample, padding 0
    labels           int32                    Hugging Face's unshifted labels, -100 where not trained
    images           list<binary> | null      the pack's images in placeholder order, PNG bytes
    videos, audios   null
    packing_params   struct                   sequence_boundaries (cumulated sample lengths, padding
                                              as a last sub-sequence), image/video/audio_subseq_ids
                                              (sample of each item; [2**32] for none),
                                              right_padding_length

Ids. Our packs hold next-token pairs (tokens = ids[:-1], labels = ids[1:]); LLaMA-Factory's rows
hold a sample's ids and its labels unshifted (the model shifts them). A sample of n positions
becomes n + 1: its tokens, then its last id (its last label; the pad id when that label is not
trained: no position ever predicts it, its own prediction is the next sample's first label, -100),
then its alignment padding (--pad_to_multiple_of); labels -100, then our n labels, then -100 per
pad. The loss is the same next-token loss over the same targets, sample by sample. Each row is
padded to ``cutoff_len`` positions, at least one of them padding, as LLaMA-Factory's own rows are
(with ``packing`` it packs into cutoff_len - 1 positions and pads to cutoff_len): ``cutoff_len`` =
max_seq_length + the most samples a pack holds (each sample's one more position) + 1, rounded up
to a multiple of 8, recorded in the meta's layout; the training YAML's ``cutoff_len`` is that
value. The multiple of 8: LLaMA-Factory's sft collator pads a batch to a multiple of 8 when it
trains, and its per-sample mRoPE refuses a row whose sequence_boundaries end short of that.

Images are PNG bytes (lossless) of what the sample store holds: fixed crops at the encoder's size,
native-resolution images at the size the processor resized them to. Bytes, not paths, so the
directory trains wherever it is moved. LLaMA-Factory's collator re-runs the model's processor on
them: a processor resizing an image to the size it already has leaves it unchanged, so its
``pixel_values`` and ``image_grid_thw`` are those of the original image, and it recomputes mRoPE
per sample from its ``sequence_boundaries``. Its own pre-resize (``image_max_pixels``, default
768 * 768) must not shrink them again: a run whose --max_pixels exceeds that default says so in one
line (``resize_profile_warning``) with the YAML line that trains it. Anyres images (LLaVA-NeXT /
OneVision: two stored parts, no original left) are refused in one line.

The writer stages each pack's unpadded row (checkpointed like every format's); ``publish`` writes the
Arrow rows, padded to the length known only then.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.core import ConfigError, StoredImage, parsing
from neva_pack.files import file_checksum, meta_path, prefix_file, regular_output, relative_name
from neva_pack.formats.base import Checkpoint, Limits, PrefixFiles, WriteSpec, normalised_stack, prefix_files, publish, published_as
from neva_pack.formats.meta import PackedMeta, ReadPack, read_meta
from neva_pack.formats.png_images import png_bytes as _png, png_pixels as _unpng
from neva_pack.packing import PlanTable, padded_view, read_plan_table

__all__ = ["DATASET_SUFFIX", "FORMAT", "HF_IGNORE_INDEX", "INDEX_SUFFIX", "LlamaFactoryFormat", "Reader", "Writer",
           "dataset_path", "prepare", "resize_profile_warning"]  # fmt: skip

NAME = "llamafactory"
DATASET_SUFFIX = ".llamafactory"
"""The directory beside the meta: ``<prefix>.llamafactory/`` is the ``tokenized_path``."""
INDEX_SUFFIX = ".llamafactory.index.npz"
ARROW_NAME = "data-00000-of-00001.arrow"
DATASET_FILES = (ARROW_NAME, "dataset_info.json", "state.json")
STAGING_NAME = "rows.staging"
"""The writer's staging file inside the temporary directory (gone at publish)."""
HF_IGNORE_INDEX, NO_ITEM = -100, 2**32
"""LLaMA-Factory's ``MAX_SU_SEQ_IDX``: the subseq-id list of a row without items of a kind."""
LF_IMAGE_MAX_PIXELS, LF_IMAGE_MIN_PIXELS = 768 * 768, 32 * 32
"""LLaMA-Factory's defaults of ``image_max_pixels`` / ``image_min_pixels`` (hparams/model_args.py)."""
ROWS_PER_BATCH = 64
ROW_MULTIPLE = 8
"""Rows are a multiple of this long: the ``pad_to_multiple_of`` of LLaMA-Factory's sft collator."""
ID_DTYPE = np.dtype("<i4")
WARNED: set[str] = set()
"""The resize-profile warnings printed: said once a process, however many --pack_sizes (writers)."""
_PER_PACK = ("samples", "positions", "images")
_PER_SAMPLE = ("segment", "sample_images")
_PER_IMAGE = ("png_bytes", "width", "height", "tokens", "run_length")


def dataset_path(prefix: Path) -> Path:
    """The directory LLaMA-Factory's ``tokenized_path`` names."""
    return prefix_file(Path(prefix), DATASET_SUFFIX)


def resize_profile_warning(image_processor: dict | None) -> str | None:
    """One line when the run's resize bounds let LLaMA-Factory's collator resize the stored images
    again (its ``image_max_pixels`` / ``image_min_pixels`` defaults); None when they agree."""
    if not image_processor:
        return None
    high, low = image_processor.get("max_pixels"), image_processor.get("min_pixels")
    if high is not None and int(high) > LF_IMAGE_MAX_PIXELS:
        return (f"--output_format {NAME}: images up to {int(high):,} pixels (--max_pixels) exceed LLaMA-Factory's default "
                f"image_max_pixels {LF_IMAGE_MAX_PIXELS:,}, which would shrink them again; set `image_max_pixels: {int(high)}` "
                f"in its YAML, or run with --max_pixels {LF_IMAGE_MAX_PIXELS}")  # fmt: skip
    if low is not None and int(low) < LF_IMAGE_MIN_PIXELS:
        return (f"--output_format {NAME}: images down to {int(low):,} pixels (--min_pixels) are below LLaMA-Factory's default "
                f"image_min_pixels {LF_IMAGE_MIN_PIXELS:,}; set `image_min_pixels: {int(low)}` in its YAML")  # fmt: skip
    return None


@dataclass(frozen=True, slots=True)
class PreparedRow:
    """One pack in LLaMA-Factory's convention, unpadded (``prepare``; images are added when written)."""

    ids: np.ndarray
    """int32, each sample's tokens, its last id, its alignment padding."""
    labels: np.ndarray
    """int32 unshifted labels, -100 where not trained."""
    segment: np.ndarray
    """int64 positions of each sample in the row (its padded length + 1)."""
    sample_images: np.ndarray
    """int64 images of each sample."""
    run_length: np.ndarray
    """int64 run length of each image, placeholder order."""


def prepare(packs, spec: WriteSpec) -> list[PreparedRow]:
    """Each pack's row in LLaMA-Factory's convention (module docstring). Pure."""
    rows = []
    for pack in packs:
        tokens, labels = padded_view(pack, spec.pad_id, spec.ignore_index)
        lengths, padded = np.asarray(pack.lengths, np.int64), np.asarray(pack.padded_lengths, np.int64)
        ids, targets, start = [], [], 0
        for n, q in zip(lengths.tolist(), padded.tolist()):
            own, own_labels = tokens[start : start + q].astype(np.int64), labels[start : start + q].astype(np.int64)
            own_labels = np.where(own_labels == spec.ignore_index, HF_IGNORE_INDEX, own_labels)
            last = own_labels[n - 1] if own_labels[n - 1] != HF_IGNORE_INDEX else spec.pad_id
            ids.append(np.concatenate([own[:n], [last], own[n:]]))
            targets.append(np.concatenate([[HF_IGNORE_INDEX], own_labels[:n], np.full(q - n, HF_IGNORE_INDEX)]))
            start += q
        if pack.image_lengths is not None:
            runs = np.asarray(pack.image_lengths, np.int64)
        else:
            runs = np.full(len(pack.image_indices), spec.image_run.positions or 0, np.int64)
        rows.append(PreparedRow(ids=np.concatenate(ids).astype(ID_DTYPE), labels=np.concatenate(targets).astype(ID_DTYPE),
                                segment=padded + 1, sample_images=np.asarray(pack.num_images, np.int64), run_length=runs))  # fmt: skip
    return rows


class Writer:
    """Appends each pack's unpadded row and its PNG images to a staging file; ``publish`` writes the
    Arrow rows. Checkpoints save the staging file's size and the index lists; ``resume=True`` cuts the
    staging file back to the last one and continues, byte-identical to a run never stopped."""

    def __init__(self, prefix: Path, spec: WriteSpec, resume: bool = False):
        self.prefix = Path(prefix)
        self.spec = spec
        record = spec.image_processor or {}
        if record and record.get("family") != "native":
            raise ConfigError(f"--output_format {NAME}: cannot hold the images of {record.get('encoder')} ({record.get('family')}: "
                              "LLaMA-Factory's collator re-runs the model's processor on each original image, and a packed "
                              "output keeps only the image's stored parts); use a fixed-crop or native-resolution encoder, "
                              "or another --output_format")  # fmt: skip
        warning = resize_profile_warning(record)
        if warning and warning not in WARNED:  # once a process: a run of several --pack_sizes has a writer each
            WARNED.add(warning)
            print(f"warning: {warning}", file=sys.stderr)
        self._checkpoint = Checkpoint(self.prefix, spec.plan_digest)
        self.directory = prefix_file(self._checkpoint.tmp, DATASET_SUFFIX)
        staging = self.directory / STAGING_NAME
        state, sizes = self._checkpoint.start([staging], resume)
        self._lists: dict[str, list] = {name: [] for name in (*_PER_PACK, *_PER_SAMPLE, *_PER_IMAGE)}
        if state is None:
            if self.directory.is_dir() and not self.directory.is_symlink():  # a stale run's
                shutil.rmtree(self.directory)
            else:  # a file or a link left under its name
                self.directory.unlink(missing_ok=True)
            self.directory.mkdir()
            self._file = open(staging, "wb")  # noqa: SIM115 -- open across add/checkpoint calls, closed by publish
            self.num_packs = 0
            return
        for name in self._lists:
            self._lists[name] = state[name].tolist()
        self.num_packs = int(state["packs"])
        self._file = open(staging, "r+b")  # noqa: SIM115 -- as above
        self._file.truncate(sizes[0])
        self._file.seek(0, os.SEEK_END)

    def add(self, pack) -> None:
        self.add_prepared(prepare([pack], self.spec), [pack.pixels])

    def add_prepared(self, prepared: list[PreparedRow], pixels=None) -> None:
        """Rows as ``prepare`` gave them, with each pack's images: uint8 (N, 3, H, W) fixed crops, or
        a list of ``StoredImage`` (one part each)."""
        pixels = [None] * len(prepared) if pixels is None else pixels
        for row, values in zip(prepared, pixels, strict=True):
            images = [] if values is None else list(values)
            if len(images) != len(row.run_length):
                raise ValueError(f"{len(images)} images for a pack of {len(row.run_length)} images")
            encoded = []
            for image, run in zip(images, row.run_length.tolist()):
                if isinstance(image, StoredImage):
                    if len(image.parts) != 1:
                        raise ValueError(f"an image of {len(image.parts)} stored parts: the {NAME} format holds one per image")
                    part, (width, height), tokens = image.parts[0], image.size, image.tokens
                else:
                    part = np.asarray(image, np.uint8)
                    width, height, tokens = part.shape[2], part.shape[1], run
                encoded.append(_png(part))
                for name, value in zip(_PER_IMAGE, (len(encoded[-1]), width, height, tokens, run)):
                    self._lists[name].append(int(value))
            for data in (row.ids.tobytes(), row.labels.tobytes(), *encoded):
                self._file.write(data)
            lists = self._lists
            lists["samples"].append(len(row.segment))
            lists["positions"].append(len(row.ids))
            lists["images"].append(len(encoded))
            lists["segment"] += row.segment.tolist()
            lists["sample_images"] += row.sample_images.tolist()
            self.num_packs += 1

    def checkpoint(self) -> None:
        self._checkpoint.save([self._file], packs=np.int64(self.num_packs),
                              **{name: np.asarray(values, dtype=np.int64) for name, values in self._lists.items()})  # fmt: skip

    def publish(self, plan: PlanTable, extra_files: list[Path], meta: PackedMeta) -> PackedMeta:
        """Write the rows (padded to ``cutoff_len``), ``dataset_info.json``, ``state.json`` and the
        index; rename them into place; write the meta last."""
        self._file.close()
        staging = self.directory / STAGING_NAME
        arrays = {name: np.asarray(values, np.int64) for name, values in self._lists.items()}
        cutoff_len = -(-(int(meta.packing.max_seq_length) + int(arrays["samples"].max(initial=0)) + 1) // ROW_MULTIPLE) * ROW_MULTIPLE
        _write_rows(self.directory / ARROW_NAME, staging, arrays, cutoff_len, self.spec.pad_id)
        staging.unlink()
        arrow_checksum = file_checksum(self.directory / ARROW_NAME)
        (self.directory / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "homepage": "", "license": ""}, indent=2))
        state = {"_data_files": [{"filename": ARROW_NAME}], "_fingerprint": arrow_checksum.split(":")[-1][:16], "_format_columns": None,
                 "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}  # fmt: skip
        (self.directory / "state.json").write_text(json.dumps(state, indent=2))
        tmp_index = prefix_file(self._checkpoint.tmp, INDEX_SUFFIX)
        with open(tmp_index, "wb") as f:
            np.savez(f, **plan.to_arrays(), **{f"lf_{name}": values for name, values in arrays.items()})
        final = dataset_path(self.prefix)
        if final.exists() and FORMAT.owns(final):  # an older dataset of this prefix (the meta goes last)
            shutil.rmtree(final)
        os.replace(self.directory, final)
        layout = {"dataset": relative_name(self.prefix.parent, final), "cutoff_len": cutoff_len}
        meta = meta.replace(format=NAME, num_packs=self.num_packs, layout=layout, image_processor=self.spec.image_processor)
        files = [final / name for name in DATASET_FILES]
        meta = publish(self.prefix, {prefix_file(self.prefix, INDEX_SUFFIX): tmp_index}, [*files, *extra_files], meta,
                       known={final / ARROW_NAME: arrow_checksum})  # fmt: skip
        self._checkpoint.remove()
        return meta


def _schema():
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    subseq = pa.list_(pa.int64())
    params = pa.struct([("sequence_boundaries", subseq), ("image_subseq_ids", subseq), ("video_subseq_ids", subseq),
                        ("audio_subseq_ids", subseq), ("right_padding_length", pa.int64())])  # fmt: skip
    return pa.schema([("input_ids", ids), ("attention_mask", ids), ("position_ids", ids), ("labels", ids),
                      ("images", pa.list_(pa.binary())), ("videos", pa.null()), ("audios", pa.null()), ("packing_params", params)])  # fmt: skip


def _write_rows(path: Path, staging: Path, a: dict, cutoff_len: int, pad_id: int) -> None:
    """The Arrow stream of the rows, read pack by pack from the staging file (``ROWS_PER_BATCH`` a batch)."""
    import pyarrow as pa

    schema = _schema()
    data = np.memmap(staging, np.uint8, mode="r") if staging.stat().st_size else np.zeros(0, np.uint8)
    sample_at = np.concatenate([[0], np.cumsum(a["samples"])])
    image_at = np.concatenate([[0], np.cumsum(a["images"])])
    length = cutoff_len
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as stream:
        columns: dict[str, list] = {name: [] for name in schema.names}
        offset = 0
        for p in range(len(a["samples"])):
            n = int(a["positions"][p])
            ids = np.frombuffer(data[offset : offset + 4 * n], ID_DTYPE)
            labels = np.frombuffer(data[offset + 4 * n : offset + 8 * n], ID_DTYPE)
            offset += 8 * n
            images = []
            for size in a["png_bytes"][image_at[p] : image_at[p + 1]].tolist():
                images.append(bytes(data[offset : offset + size]))
                offset += size
            segment = a["segment"][sample_at[p] : sample_at[p + 1]]
            counts = a["sample_images"][sample_at[p] : sample_at[p + 1]]
            pad = length - n
            if pad < 1:
                raise ValueError(f"pack {p}: {n} positions, more than cutoff_len {cutoff_len} (a bug)")
            columns["input_ids"].append(np.concatenate([ids, np.full(pad, pad_id, ID_DTYPE)]))
            columns["labels"].append(np.concatenate([labels, np.full(pad, HF_IGNORE_INDEX, ID_DTYPE)]))
            columns["attention_mask"].append(np.concatenate([np.repeat(np.arange(1, len(segment) + 1, dtype=ID_DTYPE), segment),
                                                             np.zeros(pad, ID_DTYPE)]))  # fmt: skip
            starts = np.repeat(np.concatenate([[0], np.cumsum(segment)[:-1]]), segment)
            columns["position_ids"].append(np.concatenate([np.arange(n) - starts, np.zeros(pad)]).astype(ID_DTYPE))
            columns["images"].append(images or None)
            columns["videos"].append(None)
            columns["audios"].append(None)
            image_subseq = np.repeat(np.arange(len(segment)), counts).tolist()
            columns["packing_params"].append({"sequence_boundaries": [0, *np.cumsum(segment).tolist(), length],
                                              "image_subseq_ids": image_subseq or [NO_ITEM], "video_subseq_ids": [NO_ITEM],
                                              "audio_subseq_ids": [NO_ITEM], "right_padding_length": pad})  # fmt: skip
            if len(columns["input_ids"]) == ROWS_PER_BATCH or p + 1 == len(a["samples"]):
                stream.write_batch(pa.record_batch([pa.array(columns[f.name], f.type) for f in schema], schema=schema))
                columns = {name: [] for name in schema.names}
    del data


class Reader:
    """The rows (memory-mapped Arrow) and the index: pack p back in our convention."""

    def __init__(self, prefix: Path, meta: PackedMeta | None = None):
        import pyarrow as pa

        self.prefix = Path(prefix)
        self.meta = meta if meta is not None else read_meta(meta_path(self.prefix))
        self.image_shape = None if self.meta.image_shape is None else tuple(self.meta.image_shape)
        self.dataset = dataset_path(self.prefix)
        arrow = self.dataset / ARROW_NAME
        with parsing(arrow):
            mapped = pa.memory_map(str(regular_output(arrow)))
            try:  # the file is open: what fails now is its content (pyarrow names a bad stream an IOError)
                self.table = pa.ipc.open_stream(mapped).read_all()
                # every offset within its buffer before a row is read: pyarrow's reads trust them (an edited
                # offset aborted the process, SIGABRT, in as_py); cost: a pass over the offsets, not the data
                self.table.validate(full=True)
            except (pa.ArrowException, OSError) as exc:
                raise ValueError(" ".join(f"not the Arrow stream LLaMA-Factory reads ({exc})".split())) from None
            if self.table.schema.names != _schema().names:
                raise ValueError(f"columns {self.table.schema.names}, not LLaMA-Factory's packed rows")
        index = prefix_file(self.prefix, INDEX_SUFFIX)
        self.plan = read_plan_table(index)
        with parsing(index), np.load(index) as stored:
            self.arrays = {name[3:]: stored[name] for name in stored.files if name.startswith("lf_")}
            for name in (*_PER_PACK, *_PER_SAMPLE, *_PER_IMAGE):
                if name not in self.arrays:
                    raise ValueError(f"no array lf_{name}")
        a = self.arrays
        self.sample_at = np.concatenate([[0], np.cumsum(a["samples"])])
        self.image_at = np.concatenate([[0], np.cumsum(a["images"])])

    def __getstate__(self):  # DataLoader workers reopen the files
        return {"prefix": self.prefix, "meta": self.meta}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["meta"])

    def __len__(self) -> int:
        return self.table.num_rows

    def plan_table(self) -> PlanTable:
        return self.plan

    def row(self, p: int) -> dict:
        """Row p as LLaMA-Factory reads it (lists and, for images, bytes)."""
        return {name: self.table.column(name)[p].as_py() for name in self.table.schema.names}

    def pack(self, p: int, images: bool = True) -> ReadPack:
        plan = self.plan
        first, last = int(plan.offsets[p]), int(plan.offsets[p + 1])
        lengths, padded = plan.length[first:last], plan.padded_length[first:last]
        ids = self.table.column("input_ids")[p].values.to_numpy()
        lf_labels = self.table.column("labels")[p].values.to_numpy()
        keep = np.ones(len(ids), bool)
        keep[np.cumsum(padded + 1)[: len(padded)] - 1 - (padded - lengths)] = False  # each sample's last id
        keep[int(np.sum(padded + 1)) :] = False  # the row's padding
        shifted = np.concatenate([lf_labels[1:], [HF_IGNORE_INDEX]])  # position i's target sits at i
        tokens = ids[keep].astype(np.int64)
        labels = np.where(shifted[keep] == HF_IGNORE_INDEX, self.meta.ignore_index, shifted[keep]).astype(np.int64)
        real = np.concatenate([np.ones(q, bool) if q == n else np.arange(q) < n for n, q in zip(lengths, padded)]) if len(padded) else keep[:0]
        labels[~real] = self.meta.ignore_index
        i0, i1 = int(self.image_at[p]), int(self.image_at[p + 1])
        pixels = stored = None
        if images:
            shape = None if self.image_shape is None else self.image_shape[1:]
            data = [_unpng(b, shape, self.dataset / ARROW_NAME) for b in (self.table.column("images")[p].as_py() or [])]
            if self.image_shape is None:
                a = self.arrays
                stored = [StoredImage(size=(int(a["width"][i]), int(a["height"][i])), parts=(part,), tokens=int(a["tokens"][i]))
                          for i, part in zip(range(i0, i1), data)]  # fmt: skip
            else:
                pixels = np.stack(data) if data else np.zeros((0, *self.image_shape), np.uint8)
        return ReadPack(cu_seqlens=np.concatenate([[0], np.cumsum(padded)]), cu_seqlens_unpadded=np.concatenate([[0], np.cumsum(lengths)]),
                        tokens=tokens, labels=labels, pixels=pixels, images=None, num_images=i1 - i0,
                        image_lengths=self.arrays["run_length"][i0:i1].astype(np.int64), stored_images=stored)  # fmt: skip

    def images(self, p: int, device=None, dtype=None):
        """The pack's images as the model's input tensor: normalised here, as compact does."""
        return normalised_stack(self, p, device, dtype)

    def close(self) -> None:
        self.table = None


def check(reader: Reader, result) -> None:
    """The rows are LLaMA-Factory's layout of the index's packs: lengths, segments, masks, positions, images."""
    a, plan = reader.arrays, reader.plan
    if len(reader) != reader.meta.num_packs or len(a["samples"]) != len(reader) or len(plan.offsets) - 1 != len(reader):
        result.add(f"{ARROW_NAME}: {len(reader)} rows, the index {len(a['samples'])} packs, the meta {reader.meta.num_packs}")
        return
    length = int(reader.meta.layout.get("cutoff_len", -1))
    for p in range(len(reader)):
        row = reader.row(p)
        first, last = int(plan.offsets[p]), int(plan.offsets[p + 1])
        segment = plan.padded_length[first:last] + 1
        bounds = [0, *np.cumsum(segment).tolist()]
        params = row["packing_params"]
        mask = np.repeat(np.arange(1, len(segment) + 1), segment)
        positions = np.concatenate([np.arange(s) for s in segment]) if len(segment) else np.zeros(0, np.int64)
        if any(len(row[name]) != length for name in ("input_ids", "attention_mask", "position_ids", "labels")):
            result.add(f"{ARROW_NAME}: row {p} is not of cutoff_len = {length} positions")
        elif params["sequence_boundaries"] != [*bounds, length] or params["right_padding_length"] != length - bounds[-1]:
            result.add(f"{ARROW_NAME}: row {p}'s sequence_boundaries disagree with its samples' lengths")
        elif row["attention_mask"][: bounds[-1]] != mask.tolist() or any(row["attention_mask"][bounds[-1] :]):
            result.add(f"{ARROW_NAME}: row {p}'s attention_mask is not its samples' segment ids")
        elif row["position_ids"][: bounds[-1]] != positions.tolist() or any(np.asarray(row["labels"])[bounds[:-1]] != HF_IGNORE_INDEX):
            result.add(f"{ARROW_NAME}: row {p}'s position_ids or labels do not restart per sample")
        elif len(row["images"] or []) != int(plan.num_images[first:last].sum()):
            result.add(f"{ARROW_NAME}: row {p} holds {len(row['images'] or [])} images, its samples {int(plan.num_images[first:last].sum())}")
    for name in DATASET_FILES[1:]:
        if not (reader.dataset / name).is_file():
            result.add(f"{relative_name(reader.prefix.parent, reader.dataset / name)} is missing")


class LlamaFactoryFormat:
    """LLaMA-Factory's neat-packed rows, a ``tokenized_path`` directory (``PackedFormat``)."""

    name = NAME
    description = ("LLaMA-Factory's neat-packed rows (tokenized_path + neat_packing: true), images as PNG bytes "
                   "(fixed crops, native-resolution images)")  # fmt: skip
    needs_pixels = True
    """Each row holds its pack's images (PNG bytes of the stored uint8)."""
    uses_image_pool = False
    holds_images = True
    holds_dynamic_images = True
    """Qwen-VL images, one stored part each (anyres images are refused by the writer, in one line)."""
    holds_videos = False
    limits = Limits(max_pack=int(np.iinfo(ID_DTYPE).max) // 2, max_integer=int(np.iinfo(ID_DTYPE).max),
                    why="the llamafactory format stores ids, labels and positions as int32")  # fmt: skip

    def check_settings(self, **settings) -> None:
        self.limits.check(**settings)

    def files(self, prefix: Path) -> PrefixFiles:
        return prefix_files(prefix, (DATASET_SUFFIX, INDEX_SUFFIX), plan_table_suffix=INDEX_SUFFIX)

    def trusted_files(self, prefix: Path, meta: PackedMeta) -> tuple[Path, ...]:
        """The index (the plan table, each image's size and tokens); not the Arrow rows."""
        return (prefix_file(prefix, INDEX_SUFFIX),)

    def owns(self, path: Path) -> bool:
        path = Path(path)
        if path.is_symlink():
            return False
        prefix = path.with_name(path.name.split(".", 1)[0])
        files = self.files(prefix)
        if path in files.temporary:
            return True  # its temporary names (the directory while written among them)
        if path == dataset_path(prefix):  # by its content: exactly what load_from_disk reads
            return path.is_dir() and {entry.name for entry in path.iterdir()} == set(DATASET_FILES)
        if path in files.final:
            return path.is_file() and published_as(prefix, NAME)
        return False

    writer = staticmethod(Writer)
    reader = staticmethod(Reader)
    prepare = staticmethod(prepare)
    check = staticmethod(check)

    def summary_line(self, data_prefix: str) -> str:
        return f"{data_prefix}{DATASET_SUFFIX} ({NAME}: LLaMA-Factory's tokenized_path, with neat_packing: true)"


FORMAT = LlamaFactoryFormat()

