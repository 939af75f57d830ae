"""The compact format: int32 ids, uint8 images stored once, normalised when read.

    output_dir/packed_seq_dataset.tokens.bin    int32 token ids of every pack, back to back: no padding, and of
                                                each image run only its last position (see below)
    output_dir/packed_seq_dataset.labels.bin    int32 labels, aligned with the tokens
    output_dir/packed_seq_dataset.index.bin     the arrays below, back to back (names, dtypes, offsets in the meta)
    output_dir/packed_seq_dataset.meta.json     format "compact": the normalisation, the pool's parts, checksums
    output_dir/packed_seq_dataset/*.images      the image pool = the sample store's images (sample_store/image_pool.py;
                                                shard_*.images from a run, pool_*.images from convert); under
                                                --frame_compression each entry one zstd frame, sized by *.entry_sizes
                                                (the meta's pool parts name the codec; the reader decodes them)

    index arrays                       pack p
      pack_offsets   int64 (P + 1)     samples pack_offsets[p]:pack_offsets[p + 1] of the per-sample arrays
      token_offsets  int64 (P + 1)     tokens token_offsets[p]:token_offsets[p + 1]
      image_offsets  int64 (P + 1)     images image_offsets[p]:image_offsets[p + 1] of image_indices
      length         int32 (S)         real positions of each sample
      padded_length  int32 (S)         positions it takes in the pack (pad ids / ignore labels after it)
      record_index   int64 (S)         its input record
      num_images     int32 (S)         its images
      image_indices  int64 (I)         pool index of each image instance, in placeholder order
      image_starts   int64 (I)         where its run starts in the pack's (unpadded) positions
      image_lengths  int64 (I)         its run's length (dynamic images only: fixed crops' are the meta's image_positions)
      image_whole    int8 (I)          1: its run stored whole (a video clip's own ids); 0 (or absent): its last position

Images each at its own size (``images.StoredImage``, sample_store/image_pool.py): the meta's
``image_shape`` is null and its ``image_processor`` rebuilds the family; a run is [start] patch x
(L - delimiters) [end] of its image's own length L, its first L - 1 positions not stored either, but
for a video clip's run (its family's own ids), stored whole. The reader gives the pack's
``stored_images`` (no ``pixels``); ``neva_pack.reading.dataset`` makes the model's inputs of them.

An image run is the same ids every time ([start] patch x N [end], from the meta) and its labels are
the ignore value except at its last position (the next token may be trained: the plain template's
caption). So the first N - 1 positions of each run are not stored: 576 positions of an image cost
8 bytes here instead of 4,608 (as for the float32 pixels, the ids are a function of what is kept)::

    sample  [5 | S P P E | 9 2]       (run of 4 at position 1)   stored: [5 E 9 2], image_starts = [1]

An image used by several samples (the same path, or the same pixels under another name) is one
pool entry referenced several times. Reading pack p gives exactly what the nemo format's reader
gives for the same run: padding is re-created from the lengths, images are normalised with the
meta's normalisation (bit-identical to the processor), an image-less pack gets one zero image.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.core import InputError, parsing
from neva_pack.formats.base import Checkpoint, Limits, PrefixFiles, WriteSpec, prefix_files, publish, published_as
from neva_pack.formats.meta import PackedMeta, ReadPack, read_meta
from neva_pack.files import OutputFile, meta_path, prefix_file, regular_output
from neva_pack.packing import PlanTable, with_padding
from neva_pack.sample_store import ImagePool, PoolSegment

__all__ = ["FORMAT", "INDEX", "LABELS", "TOKENS", "CompactFormat", "PreparedPacks", "Reader", "Writer"]

NAME = "compact"
ID_DTYPE = np.dtype("<i4")
TOKENS, LABELS, INDEX = ".tokens.bin", ".labels.bin", ".index.bin"
SUFFIXES = (TOKENS, LABELS, INDEX)
"""Its files beside the meta; the index holds the plan table."""
ARRAYS = {
    "pack_offsets": "<i8",
    "token_offsets": "<i8",
    "image_offsets": "<i8",
    "length": "<i4",
    "padded_length": "<i4",
    "record_index": "<i8",
    "num_images": "<i4",
    "image_indices": "<i8",
    "image_starts": "<i8",
    "image_tokens": "<i8",
    "vision_cost": "<i8",
    "image_lengths": "<i8",
    "image_whole": "<i1",
}
_OPTIONAL = ("image_lengths", "image_whole")
"""Arrays of dynamic-resolution outputs only (image_whole: of those with a video clip); the reader fills them in."""
_PER_IMAGE = ("image_indices", "image_starts", "image_lengths", "image_whole")
_PER_PACK = ("samples", "tokens", "images")
_PER_SAMPLE = ("length", "padded_length", "record_index", "num_images")
_FROM_PLAN = ("image_tokens", "vision_cost")
"""Per-sample arrays taken from the plan table at publish; an index written before them lacks them."""


class Writer:
    """Appends packs to the tokens/labels files; the index arrays are written at publish.

    Checkpoints save the file sizes and the arrays so far; ``resume=True`` continues after the
    last one: the result is byte-identical to an uninterrupted run.
    """

    def __init__(self, prefix: Path, spec: WriteSpec, resume: bool = False):
        self.prefix = Path(prefix)
        self.spec = spec
        self._checkpoint = Checkpoint(self.prefix, spec.plan_digest)
        tmp = self._checkpoint.tmp
        self._paths = [prefix_file(tmp, TOKENS), prefix_file(tmp, LABELS)]
        state, sizes = self._checkpoint.start(self._paths, resume)
        self._lists: dict[str, list] = {name: [] for name in (*_PER_PACK, *_PER_SAMPLE, *_PER_IMAGE)}
        if state is None:
            self.num_packs = 0
        else:
            for name in self._lists:
                self._lists[name] = state[name].tolist()
            self.num_packs = int(state["packs"])
        # the tokens and labels, hashed as they are written (publish need not read them again)
        self._files = [OutputFile(path, resume_at=size, write_behind=True) for path, size in zip(self._paths, sizes)]

    def add(self, pack) -> None:
        self.add_prepared(prepare([pack], self.spec))

    def add_prepared(self, prepared: "PreparedPacks", pixels=None) -> None:
        """Packs as ``prepare`` gave them (compact stores no pixels: ``pixels`` is ignored)."""
        for f, values in zip(self._files, (prepared.tokens, prepared.labels)):
            f.write(values.data)
        for name, values in prepared.lists.items():
            self._lists[name] += values.tolist()
        self.num_packs += len(prepared.lists["samples"])

    def checkpoint(self) -> None:
        self._checkpoint.save(self._files, packs=np.int64(self.num_packs),
                              **{name: np.asarray(values, dtype=np.int64) for name, values in self._lists.items()})  # fmt: skip

    def _arrays(self, plan: PlanTable | None) -> dict[str, np.ndarray]:
        lists = self._lists
        offsets = {name: np.concatenate([[0], np.cumsum(lists[name], dtype=np.int64)]) for name in _PER_PACK}
        values = {
            "pack_offsets": offsets["samples"],
            "token_offsets": offsets["tokens"],
            "image_offsets": offsets["images"],
            **{name: lists[name] for name in (*_PER_SAMPLE, *_PER_IMAGE)},
            **{name: None if plan is None else getattr(plan, name) for name in _FROM_PLAN},
        }
        dynamic = self.spec.image_run.positions is None
        values["image_whole"] = values["image_whole"] if any(values["image_whole"]) else None  # none: the index as before
        written = {name: dtype for name, dtype in ARRAYS.items() if values[name] is not None and (dynamic or name not in _OPTIONAL)}
        return {name: np.asarray(values[name], dtype=dtype) for name, dtype in written.items()}

    def publish(self, plan: PlanTable, extra_files: list[Path], meta: PackedMeta) -> PackedMeta:
        """Write the index; rename the files into place; write the meta (with the pool's parts) last."""
        # the index holds the plan table (pack_offsets, record_index, length, ...)
        for f in self._files:
            f.close()
        tmp = self._checkpoint.tmp
        arrays, offset = {}, 0
        with open(prefix_file(tmp, INDEX), "wb") as f:
            for name, values in self._arrays(plan).items():
                f.write(values.data)
                arrays[name] = {"dtype": ARRAYS[name], "offset": offset, "count": len(values)}
                offset += values.nbytes
            f.flush()
            os.fsync(f.fileno())
        output_dir = self.prefix.parent
        parts = [part for part in self.spec.pool if part.count]
        layout = {"arrays": arrays, "pool": [part.layout(output_dir) for part in parts]}  # a compressed part names its codec
        renames = {prefix_file(self.prefix, suffix): prefix_file(tmp, suffix) for suffix in (TOKENS, LABELS, INDEX)}
        pool_files = [path for p in parts for path in p.files]
        meta = meta.replace(format=NAME, num_packs=self.num_packs, layout=layout, image_processor=self.spec.image_processor)
        written = {f.path: f.checksum() for f in self._files}
        for part in parts:  # the pool's parts hashed when the store wrote them
            written.update(part.known_checksums())
        meta = publish(self.prefix, renames, [*pool_files, *extra_files], meta, known=written)
        self._checkpoint.remove()
        return meta


class Reader:
    """Memory-maps the tokens, labels and pool; pack p costs a few slices and the pool reads."""

    def __init__(self, prefix: Path, meta: PackedMeta | None = None):
        self.prefix = Path(prefix)
        self.meta = meta if meta is not None else read_meta(meta_path(self.prefix))
        self.image_shape = None if self.meta.image_shape is None else tuple(self.meta.image_shape)
        output_dir = self.prefix.parent
        layout = self.meta.layout
        self.tokens = _map(prefix_file(self.prefix, TOKENS), ID_DTYPE)
        self.labels = _map(prefix_file(self.prefix, LABELS), ID_DTYPE)
        self.arrays = {}
        index = prefix_file(self.prefix, INDEX)
        for name, dtype in ARRAYS.items():
            spec = layout.get("arrays", {}).get(name)
            if spec is None and name in _OPTIONAL and (not self.meta.dynamic or name == "image_whole"):
                continue  # filled in below: the meta's run length; no run kept whole
            if spec is None and name in _FROM_PLAN:
                continue  # an index from before these arrays: their figures are unknown
            if spec is None:
                raise InputError(f"{meta_path(self.prefix)}: no array {name} in the layout (not this compact format)")
            if spec["dtype"] != dtype:
                raise InputError(f"{meta_path(self.prefix)}: array {name} of dtype {spec['dtype']}, expected {dtype}")
            with parsing(index):
                self.arrays[name] = np.fromfile(regular_output(index), dtype=dtype, count=int(spec["count"]), offset=int(spec["offset"]))
                if len(self.arrays[name]) != int(spec["count"]):
                    raise ValueError(f"array {name} is cut short")
        ends = self.arrays["token_offsets"][-1:]  # pack() slices the id files with these offsets
        for path, ids in ((prefix_file(self.prefix, TOKENS), self.tokens), (prefix_file(self.prefix, LABELS), self.labels)):
            if len(ends) != 1 or len(ids) != ends[0]:
                raise InputError(f"{path}: {len(ids)} ids, not the {ends.tolist()} that {index.name} lists (damaged)")
        if "image_lengths" not in self.arrays:
            self.arrays["image_lengths"] = np.full(len(self.arrays["image_starts"]), self.meta.image_positions, dtype=np.int64)
        self.arrays.setdefault("image_whole", np.zeros(len(self.arrays["image_starts"]), dtype=np.int8))  # absent: none is
        with parsing(meta_path(self.prefix)):
            parts = [PoolSegment.from_layout(part, output_dir) for part in layout["pool"]]
        if any(part.dynamic != self.meta.dynamic for part in parts):
            raise InputError(f"{meta_path(self.prefix)}: its pool's parts and its image_shape disagree on the images' kind")
        self.pool = ImagePool(parts, self.image_shape, mmap=True)
        self.pad_id = self.meta.pad_id
        self.ignore_index = self.meta.ignore_index
        self.image_run = self.meta.image_run
        self.elided = _elided_ids(self.image_run)

    def __getstate__(self):  # DataLoader workers (spawn) reopen the files instead of pickling the maps
        return {"prefix": self.prefix, "meta": self.meta}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["meta"])

    def __len__(self) -> int:
        return len(self.arrays["pack_offsets"]) - 1

    def plan_table(self) -> PlanTable:
        """The index's plan arrays; InputError naming the index if they do not describe packs."""
        a = self.arrays
        with parsing(prefix_file(self.prefix, INDEX)):
            return PlanTable.from_arrays({"offsets": a["pack_offsets"], "record_index": a["record_index"],
                                          "length": a["length"], "padded_length": a["padded_length"],
                                          "num_images": a["num_images"], **{name: a.get(name) for name in _FROM_PLAN}})  # fmt: skip

    def pack(self, p: int, images: bool = True) -> ReadPack:
        a = self.arrays
        first, last = int(a["pack_offsets"][p]), int(a["pack_offsets"][p + 1])
        t0, t1 = int(a["token_offsets"][p]), int(a["token_offsets"][p + 1])
        i0, i1 = int(a["image_offsets"][p]), int(a["image_offsets"][p + 1])
        lengths = a["length"][first:last].astype(np.int64)
        padded = a["padded_length"][first:last].astype(np.int64)
        starts = a["image_starts"][i0:i1]
        run_lengths = a["image_lengths"][i0:i1]
        whole = a["image_whole"][i0:i1].astype(bool)
        tokens = np.empty(int(lengths.sum()), dtype=np.int64)
        labels = np.empty(len(tokens), dtype=np.int64)
        keep = _stored_positions(len(tokens), starts[~whole], run_lengths[~whole])
        tokens[keep] = self.tokens[t0:t1]
        labels[keep] = self.labels[t0:t1]
        if len(starts) > whole.sum():
            tokens[~keep] = self.elided(run_lengths[~whole])
            labels[~keep] = self.ignore_index
        if not np.array_equal(lengths, padded):
            tokens = with_padding(tokens, lengths, padded, self.pad_id)
            labels = with_padding(labels, lengths, padded, self.ignore_index)
        indices = a["image_indices"][i0:i1]
        dynamic = self.pool.dynamic
        return ReadPack(
            cu_seqlens=np.concatenate([[0], np.cumsum(padded)]),
            cu_seqlens_unpadded=np.concatenate([[0], np.cumsum(lengths)]),
            tokens=tokens,
            labels=labels,
            pixels=self.pool.read(indices) if images and not dynamic else None,
            images=None,
            num_images=i1 - i0,
            image_lengths=run_lengths.astype(np.int64),
            stored_images=self.pool.read_stored(indices) if images and dynamic else None,
        )

    def images(self, p: int, device=None, dtype=None):
        """The pack's images as the model's input tensor: normalised here (NeMo stores them so)."""
        import torch

        if self.pool.dynamic:
            raise ValueError(f"{self.prefix}: dynamic-resolution images have no one tensor shape; read the pack's "
                             "stored_images and make the model's inputs with its processor (neva_pack.reading.dataset.PackedSeqDataset)")  # fmt: skip
        a = self.arrays
        indices = a["image_indices"][int(a["image_offsets"][p]) : int(a["image_offsets"][p + 1])]
        if len(indices) == 0:  # as NeMo's layout: one zero image, never an empty tensor
            return torch.zeros((1, *self.image_shape), dtype=dtype or torch.float32, device=device)
        normalisation = self.meta.normalisation
        if device is None or torch.device(device).type == "cpu":
            values = torch.from_numpy(normalisation.apply_views(self.pool.views(indices)))
            return values if dtype is None or dtype == torch.float32 else values.to(dtype)
        return normalisation.apply_torch(self.pool.read(indices), device=device, dtype=dtype)

    def close(self) -> None:
        self.pool.close()
        self.tokens = self.labels = None


@dataclass(frozen=True, slots=True)
class PreparedPacks:
    """Packs as the compact files store them: what ``Writer.add_prepared`` writes. ``prepare``
    is pure, so that the processes that assemble the packs can run it."""

    tokens: np.ndarray
    """int32 stored positions of the packs, back to back (the tokens file's bytes)."""
    labels: np.ndarray
    """int32, aligned with the tokens."""
    lists: dict[str, np.ndarray]
    """The packs' entries of the index arrays, in ``Writer._lists``' names: int64 per pack
    (samples, tokens, images), per sample and per image."""


def prepare(packs, spec: WriteSpec) -> PreparedPacks:
    """The packs' bytes and index entries; an image run that is not the spec's image run with ignored
    labels (before its last position) raises ValueError."""
    elided = _elided_ids(spec.image_run)
    tokens, labels, run_lengths, wholes = [], [], [], []
    for pack in packs:
        pack_tokens, pack_labels = pack.tokens, pack.labels
        lengths = _run_lengths(pack, spec.image_run)
        whole = np.zeros(len(lengths), dtype=bool) if getattr(pack, "whole_runs", None) is None else np.asarray(pack.whole_runs, dtype=bool)
        if len(pack.image_starts) and np.any(lengths[~whole] > 1):  # first L - 1 positions not stored (a video clip's run: all)
            keep = _stored_positions(len(pack_tokens), pack.image_starts[~whole], lengths[~whole])
            if not (np.array_equal(pack_tokens[~keep], elided(lengths[~whole])) and np.all(pack_labels[~keep] == spec.ignore_index)):
                raise ValueError("an image run of the pack is not the image run's ids with ignored labels")
            pack_tokens, pack_labels = pack_tokens[keep], pack_labels[keep]
        for out, values in ((tokens, pack_tokens), (labels, pack_labels), (run_lengths, lengths), (wholes, whole.astype(np.int64))):
            out.append(values)

    def joined(arrays, dtype=np.int64) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate(arrays) if arrays else np.zeros(0), dtype=dtype)

    return PreparedPacks(
        tokens=joined(tokens, ID_DTYPE),
        labels=joined(labels, ID_DTYPE),
        lists={
            "samples": np.array([len(p.lengths) for p in packs], dtype=np.int64),
            "tokens": np.array([len(t) for t in tokens], dtype=np.int64),
            "images": np.array([len(p.image_indices) for p in packs], dtype=np.int64),
            "image_starts": joined([p.image_starts for p in packs]),
            "length": joined([p.lengths for p in packs]),
            "padded_length": joined([p.padded_lengths for p in packs]),
            "record_index": joined([p.record_indices for p in packs]),
            "num_images": joined([p.num_images for p in packs]),
            "image_indices": joined([p.image_indices for p in packs]),
            "image_lengths": joined(run_lengths),
            "image_whole": joined(wholes),
        },
    )


def _run_lengths(pack, image_run) -> np.ndarray:
    """int64 run length of each image of an assembled pack (a fixed run: the run's positions)."""
    if pack.image_lengths is not None:
        return np.asarray(pack.image_lengths, dtype=np.int64)
    if image_run.positions is None:
        raise ValueError("a pack of dynamic-resolution images without its image run lengths (a bug)")
    return np.full(len(pack.image_starts), image_run.positions, dtype=np.int64)


def _elided_ids(image_run):
    """lengths -> the ids of the positions not stored (each run's first L - 1), concatenated."""
    if image_run.positions is not None:
        prefix = image_run.ids()[:-1]
        return lambda lengths: np.tile(prefix, len(lengths))

    def dynamic(lengths) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.full(int((lengths - 1).sum()), image_run.patch_id, dtype=np.int64)
        if image_run.start_id is not None and len(ids):
            ids[np.cumsum(lengths - 1) - (lengths - 1)] = image_run.start_id
        return ids

    return dynamic


def _stored_positions(length: int, image_starts: np.ndarray, run_lengths: np.ndarray) -> np.ndarray:
    """Mask of the positions stored: all but the first L - 1 positions of each image run (L its length)."""
    keep = np.ones(length, dtype=bool)
    if len(image_starts):
        starts = np.asarray(image_starts, dtype=np.int64)
        elided = np.asarray(run_lengths, dtype=np.int64) - 1
        ends = np.cumsum(elided)
        keep[starts.repeat(elided) + np.arange(int(ends[-1])) - np.repeat(ends - elided, elided)] = False
    return keep


def _map(path: Path, dtype) -> np.ndarray:
    path = regular_output(path)
    if (size := path.stat().st_size) % (width := np.dtype(dtype).itemsize):  # numpy's refusal would not name the file
        raise InputError(f"{path}: {size} bytes, not a whole number of {width}-byte ids (damaged)")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)


def check(reader: Reader, result) -> None:
    """The index is consistent with itself, the token files and the pool."""
    a = reader.arrays
    packs = len(reader)
    for name in ("pack_offsets", "token_offsets", "image_offsets"):
        offsets = a[name]
        if len(offsets) != packs + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            result.add(f"index: {name} is not {packs + 1} non-decreasing offsets from 0")
            return
    samples = int(a["pack_offsets"][-1])
    for name in ("length", "padded_length", "record_index", "num_images"):
        if len(a[name]) != samples:
            result.add(f"index: {name} has {len(a[name])} values for {samples} samples")
            return
    if any(len(a[name]) != a["image_offsets"][-1] for name in _PER_IMAGE):
        result.add("index: image_indices/image_starts/image_lengths/image_whole disagree with image_offsets")
        return
    if samples and packs:
        starts = a["pack_offsets"][:-1]
        if np.any(np.diff(a["pack_offsets"]) == 0):
            result.add("index: a pack without samples")
            return
        elided = np.concatenate([[0], np.cumsum((a["image_lengths"] - 1) * (a["image_whole"] == 0))])  # positions not stored, cumulated per image
        hidden = np.diff(elided[a["image_offsets"]])
        if not np.array_equal(np.add.reduceat(a["length"].astype(np.int64), starts) - hidden, np.diff(a["token_offsets"])):
            result.add("index: token_offsets disagree with the samples' lengths")
        if not np.array_equal(np.add.reduceat(a["num_images"].astype(np.int64), starts), np.diff(a["image_offsets"])):
            result.add("index: image_offsets disagree with the samples' image counts")
    if np.any(a["padded_length"] < a["length"]):
        result.add("index: a padded length shorter than its length")
    if len(reader.tokens) != a["token_offsets"][-1] or len(reader.labels) != a["token_offsets"][-1]:
        result.add(f"tokens/labels files hold {len(reader.tokens)}/{len(reader.labels)} ids, the index {a['token_offsets'][-1]}")
    if not reader.meta.dynamic and np.any(a["image_lengths"] != reader.meta.image_positions):
        result.add(f"index: an image run length other than the meta's {reader.meta.image_positions}")
    for p in range(packs):
        i0, i1 = a["image_offsets"][p], a["image_offsets"][p + 1]
        starts, total = a["image_starts"][i0:i1], int(a["length"][a["pack_offsets"][p] : a["pack_offsets"][p + 1]].sum())
        ends = starts + a["image_lengths"][i0:i1]
        if len(starts) and (starts[0] < 0 or np.any(ends <= starts) or np.any(starts[1:] < ends[:-1]) or ends[-1] > total):
            result.add(f"index: image runs of pack {p} overlap or leave the pack ({starts.tolist()})")
            return
    indices = a["image_indices"]
    if len(indices) and (indices.min() < 0 or indices.max() >= len(reader.pool)):
        result.add(f"index: image indices outside the pool of {len(reader.pool)} images")
    for k, segment in enumerate(reader.pool.segments):
        try:
            expected = reader.pool.expected_bytes(k)
        except (OSError, ValueError) as exc:
            result.add(f"{segment.shapes_file.name}: {exc}")
            continue
        if not segment.images_file.is_file() or segment.images_file.stat().st_size != expected:
            result.add(f"{segment.images_file.name}: not the {segment.count} images of {expected:,} bytes its pool describes")
        elif segment.codec is not None:  # every frame decoded within its row's size, to the pixels its key names
            problem = reader.pool.entries_problem(k)
            if problem is not None:
                result.add(problem)


class CompactFormat:
    """int32 ids, uint8 images in the sample store's pool, normalised on read (``PackedFormat``)."""

    name = NAME
    description = "int32 ids, uint8 images stored once (the sample store's pool), normalised when read (PackedSeqDataset)"
    needs_pixels = False
    """Packs reference the pool by index: assembly never reads a pixel, so re-packing takes seconds."""
    uses_image_pool = True
    holds_images = True
    holds_dynamic_images = True
    """Each image at its own size in the pool (images.StoredImage), each run's length in the index."""
    holds_videos = True
    limits = Limits(
        max_pack=int(np.iinfo(ID_DTYPE).max),
        max_integer=int(np.iinfo(ID_DTYPE).max),
        why="the compact format stores ids, labels and lengths as int32",
    )

    def check_settings(self, **settings) -> None:
        self.limits.check(**settings)

    def files(self, prefix: Path) -> PrefixFiles:
        return prefix_files(prefix, SUFFIXES, plan_table_suffix=INDEX)

    def trusted_files(self, prefix: Path, meta: PackedMeta) -> tuple[Path, ...]:
        """The index (offsets and the plan), and the pool's shape files of dynamic images (where each
        image's parts lie) and sizes files of a compressed pool (where each entry lies, and so how much a
        frame may decode to); not the ids or the pool's pixels."""
        shapes = [part[key] for part in meta.layout.get("pool", ()) if isinstance(part, dict) for key in ("shapes", "sizes") if key in part]
        return (prefix_file(prefix, INDEX), *(Path(prefix).parent / name for name in shapes))

    def owns(self, path: Path) -> bool:
        path = Path(path)
        if path.is_symlink() or not path.is_file():
            return False
        prefix = path.with_name(path.name.split(".", 1)[0])
        files = self.files(prefix)
        if path in files.temporary:
            return True  # its temporary names
        if path in files.final:  # the meta, or a file the compact meta beside it describes
            return published_as(prefix, NAME)
        return False

    # the contract's writer(prefix, spec, resume), reader(prefix, meta), prepare(packs, spec) and
    # check(reader, result) are this module's own
    writer = staticmethod(Writer)
    reader = staticmethod(Reader)
    prepare = staticmethod(prepare)
    check = staticmethod(check)

    def summary_line(self, data_prefix: str) -> str:
        return f"{data_prefix} ({NAME}: read it with neva_pack.reading.dataset.PackedSeqDataset)"


FORMAT = CompactFormat()
