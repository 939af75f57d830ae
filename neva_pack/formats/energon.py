"""The energon format: a Megatron-Energon WebDataset dataset, one pack per sample, uint8 images.

    output_dir/packed_seq_dataset.energon/                the dataset (Energon's dataset path)
        shard_000000.tar, shard_000001.tar, ...            the packs, in order; a shard closes past SHARD_BYTES
        shard_000000.tar.idx, ...                          int64 byte offset of each sample, then the end of the last
        .nv-meta/dataset.yaml, sample_loader.py            sample type ``PackSample`` (below), loaded with ``decode``
        .nv-meta/split.yaml                                every shard in ``train``
        .nv-meta/.info.json                                samples per shard
        .nv-meta/index.sqlite, .nv-meta/index.uuid         Energon's sample and part index; a uuid of the content
    output_dir/packed_seq_dataset.energon.plan.npz        the plan table (stats reads it without the tars)
    output_dir/packed_seq_dataset.meta.json               format "energon", the normalisation, checksums

The ``.nv-meta/`` files are those ``energon prepare`` leaves for these tars (``--split-parts`` with
every shard in ``train``; formats/webdataset.py), with a ``dataset.yaml`` naming this module's
``PackSample`` and a ``sample_loader.py`` calling ``decode``: ``energon info`` and Energon's
``get_train_dataset``/``get_loader`` open the directory as it is and yield packs. Sample ``{pack:09d}`` (keys unique across shards) holds these ``.npy`` members, in this order::

    tokens.npy                int32 (T,)       padded tokens of the pack
    labels.npy                int32 (T,)       labels (the ignore value on padding)
    cu_seqlens.npy            int64 (n + 1,)   padded sample boundaries
    cu_seqlens_unpadded.npy   int64 (n + 1,)   real lengths, cumulated
    images.npy                uint8 (U, 3, H, W)  the images this pack is the first of its shard to use
    image_refs.npy            int64 (N, 2)     each image, in placeholder order: (pack whose images.npy
                                               holds it, its row there)

Dynamic-resolution images (Qwen2-VL native, LLaVA-NeXT / OneVision anyres; the meta's ``image_shape``
null, its ``image_processor`` the record that rebuilds the processor offline) are each stored at
their own shapes, as ``images.StoredImage``'s uint8 parts (formats/energon_samples.py), and each
image's run has its own length. Such a sample holds, after the four above::

    images.npy                uint8 (B,)       the parts of the U images this pack is the first of its
                                               shard to use, back to back, each (3, h, w) C-order
    image_refs.npy            int64 (N, 2)     as above: (carrying pack, image's row in its image_info)
    image_info.npy            int64 (U, 5)     per carried image: width, height (decoded size), tokens
                                               (language-model positions), parts (Qwen 1, anyres 2 or 1),
                                               frames (0; a video clip's, stacked in its one part)
    part_shapes.npy           int64 (Σ parts, 2)  (h, w) of each part of those images, in order
    image_seconds.npy         float64 (U,)     a clip's seconds per temporal patch (0 for an image)
    image_lengths.npy         int64 (N,)       each image's run length in positions, placeholder order
                                               ([start] patch x (L - delimiters) [end], the meta's ids;
                                               a clip's: its family's own ids, in tokens.npy as all are)

Energon's loaders then yield ``PackSample``s with ``stored_images`` (each image's uint8 parts, bit for
bit as the sample store held them) and ``image_lengths``, ``pixels`` None; the model's inputs are made
from them by the processor the meta records (``images.processor_from_record``, ``neva_pack.reading.dataset``).

Each distinct image (by content) is stored once per shard: the first pack of the shard that uses it
carries it, later packs of the shard refer to it by that pack's number. References never leave a
shard and are read by random access through what Energon offers for a prepared dataset: its
``WebdatasetFileStore`` fetches one member ``<key>.<part>`` at the offset ``index.sqlite``'s part index
gives (the store a ``@cooker(need_primary=True)`` cooker is handed as ``primary``). Members are
fetched whole, so reusing one image reads every image its carrier introduced; one member per image
would avoid that, but leave a pack without images without the image shape, and samples unlike.

``decode(sample, fetch)`` turns the raw dict Energon yields for a sample into the ``ReadPack`` our reader
gives (``reader.images`` normalises the uint8 pixels with the meta's normalisation, as compact does);
``fetch`` reads another sample's member by its full name: the dataset's ``sample_loader`` fetches
through Energon's ``WebdatasetFileStore`` of the sample's dataset, a cooker through its ``primary``.
The tars are byte-identical between runs: fixed member order, mtime 0, uid/gid 0, no user names,
mode 0644, ustar.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.core import StoredImage, parsing
from neva_pack.formats.base import Checkpoint, Limits, PrefixFiles, WriteSpec, normalised_stack, prefix_files, publish, published_as
from neva_pack.formats.energon_samples import (
    DYNAMIC_MEMBERS, IMAGE_LENGTHS_MEMBER, IMAGE_REFS_MEMBER, IMAGES_MEMBER, MEMBERS, carried_members, decode, fetch_from, image_key,
    pack_index, sample_fields,
)  # fmt: skip
from neva_pack.formats.meta import PackedMeta, ReadPack, read_meta
from neva_pack.formats.webdataset import (
    BLOCK, META_DIR, ShardIndex, ShardSamples, end_of_archive, member_header, npy_bytes, padded, sample_count, shard_name, write_nv_meta,
)  # fmt: skip
from neva_pack.packing import PlanTable, padded_view, read_plan_table, write_plan_table
from neva_pack.files import meta_path, prefix_file, relative_name

__all__ = [
    "DATASET_SUFFIX", "DYNAMIC_MEMBERS", "FORMAT", "IMAGES_MEMBER", "IMAGE_REFS_MEMBER", "MEMBERS", "SHARD_BYTES", "EnergonFormat", "PreparedPack", "Reader", "Writer", "dataset_path",
    "decode", "fetch_from", "pack_index", "sample_fields",
]  # fmt: skip

NAME = "energon"
DATASET_SUFFIX = ".energon"
"""The dataset directory beside the meta: ``<prefix>.energon/`` is what Energon is given."""
PLAN_SUFFIX = ".energon.plan.npz"
SHARD_BYTES = 1 << 30
"""A shard closes once it holds this many bytes (deterministic: a function of the packs only)."""
DATASET_YAML = f"""\
sample_type:
  __module__: {__name__}
  __class__: PackSample
sample_loader: sample_loader.py:sample_loader
part_filter: sample_loader.py:part_filter
"""
SAMPLE_LOADER = f'''\
"""Energon's sample loader of a neva_pack energon dataset: each sample is one pack."""

from {__name__} import {{members}}, sample_fields


def sample_loader(raw: dict) -> dict:
    return sample_fields(raw)


def part_filter(part: str) -> bool:
    return part in {{members}}
'''
"""``.nv-meta/sample_loader.py``, ``members`` the name of the dataset's member tuple above."""


def dataset_path(prefix: Path) -> Path:
    """The Energon dataset directory of a prefix (what ``get_train_dataset`` is given)."""
    return prefix_file(Path(prefix), DATASET_SUFFIX)


def __getattr__(name: str):
    """``PackSample``, Energon's sample type of a pack: made on first use, so that neva_pack runs
    without megatron-energon (only Energon, reading the dataset, asks for it)."""
    if name != "PackSample":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron.energon import Sample, edataclass

    @edataclass
    class PackSample(Sample):
        """One pack as Energon's loaders yield it (``ReadPack``'s fields): ``pixels`` uint8 (fixed crops),
        or ``stored_images`` and ``image_lengths`` (dynamic-resolution images; then ``pixels`` is None)."""

        pack: int
        cu_seqlens: np.ndarray
        cu_seqlens_unpadded: np.ndarray
        tokens: np.ndarray
        labels: np.ndarray
        pixels: np.ndarray | None
        num_images: int
        image_lengths: np.ndarray | None = None
        stored_images: list | None = None

    PackSample.__module__, PackSample.__qualname__ = __name__, "PackSample"  # pickled by name (loader workers)
    globals()["PackSample"] = PackSample
    return PackSample


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedPack:
    """A pack as its sample stores it, but for the members carrying its images (made from its images when written)."""

    members: dict[str, bytes]
    """Member name -> its .npy bytes."""
    num_images: int
    """Image instances of the pack (the rows of its pixels)."""


def prepare(packs, spec: WriteSpec) -> list[PreparedPack]:
    """Each pack's members, images aside (``Writer.add_prepared`` stores each distinct one of its images). Pure."""
    prepared = []
    for pack in packs:
        tokens, labels = padded_view(pack, spec.pad_id, spec.ignore_index)
        members = {
            "tokens.npy": npy_bytes(np.asarray(tokens, dtype=np.int32)),
            "labels.npy": npy_bytes(np.asarray(labels, dtype=np.int32)),
            "cu_seqlens.npy": npy_bytes(np.concatenate([[0], np.cumsum(pack.padded_lengths, dtype=np.int64)])),
            "cu_seqlens_unpadded.npy": npy_bytes(np.concatenate([[0], np.cumsum(pack.lengths, dtype=np.int64)])),
        }
        if spec.image_shape is None:  # dynamic-resolution images: each run its own length
            lengths = np.asarray(pack.image_lengths if pack.image_lengths is not None else (), dtype=np.int64)
            if len(lengths) != len(pack.image_indices):
                raise ValueError(f"{len(lengths)} image run lengths for a pack of {len(pack.image_indices)} images")
            members[IMAGE_LENGTHS_MEMBER] = npy_bytes(lengths)
        prepared.append(PreparedPack(num_images=len(pack.image_indices), members=members))
    return prepared


class Writer:
    """Appends one sample per pack to the current shard (a plain ustar stream), a new shard past
    ``shard_bytes``; ``publish`` writes the indexes and ``.nv-meta/`` and renames the dataset into place.

    Each distinct image is stored by the first pack of its shard that uses it (``shard_images``: the
    open shard's images by content -> (carrying pack, row)). Checkpoints save the open shard's size,
    what the indexes need and ``shard_images``; ``resume=True`` cuts the open shard back to it and
    continues: byte-identical to a run never stopped.
    """

    def __init__(self, prefix: Path, spec: WriteSpec, resume: bool = False, shard_bytes: int = SHARD_BYTES):
        self.prefix = Path(prefix)
        self.spec = spec
        self.dynamic = spec.image_shape is None
        self.members = DYNAMIC_MEMBERS if self.dynamic else MEMBERS
        self.shard_bytes = shard_bytes
        self._checkpoint = Checkpoint(self.prefix, spec.plan_digest)
        self.directory = prefix_file(self._checkpoint.tmp, DATASET_SUFFIX)
        self._file = None
        self.shard_images: dict[bytes, tuple[int, int]] = {}
        state = self._resumable(self._checkpoint.load([])) if resume else None
        if state is None:
            self._checkpoint.remove()
            _remove(self.directory)
            self.directory.mkdir()
            self.num_packs = 0
            self.shard_counts: list[int] = []
            self.shard_sizes: list[int] = []
            self.sample_offsets: list[int] = []
            self.member_sizes: list[list[int]] = []
            return
        self.num_packs = int(state["packs"])
        self.shard_counts = state["shard_counts"].tolist()
        self.shard_sizes = state["shard_sizes"].tolist()
        self.sample_offsets = state["sample_offsets"].tolist()
        self.member_sizes = state["member_sizes"].reshape(-1, len(self.members)).tolist()
        digests, refs = state["shard_image_digests"].reshape(-1, 16), state["shard_image_refs"].reshape(-1, 2).tolist()
        self.shard_images = {digest.tobytes(): (int(pack), int(row)) for digest, (pack, row) in zip(digests, refs)}
        if len(state["bytes"]):  # the open shard: cut back to the checkpoint, continue after it
            self._file = open(self.directory / shard_name(len(self.shard_counts) - 1), "r+b")
            self._file.truncate(int(state["bytes"][0]))
            self._file.seek(0, os.SEEK_END)

    def _resumable(self, state: dict | None) -> dict | None:
        """The checkpoint, if the shards it describes are there: the closed ones whole, the open one at least as long."""
        if state is None or "shard_image_refs" not in state:  # none, or one of a layout before shared images
            return None
        closed = state["shard_sizes"].tolist()
        for shard, size in enumerate(closed):
            path = self.directory / shard_name(shard)
            if not path.is_file() or path.stat().st_size != size:
                return None
        if len(state["bytes"]):
            path = self.directory / shard_name(len(closed))
            if not path.is_file() or path.stat().st_size < int(state["bytes"][0]):
                return None
        return state

    def add(self, pack) -> None:
        self.add_prepared(prepare([pack], self.spec), [pack.pixels])

    def add_prepared(self, prepared: list[PreparedPack], pixels=None) -> None:
        """Packs as ``prepare`` gave them, with each pack's images (instances in placeholder order):
        uint8 (N, 3, H, W) pixels, or a list of ``images.StoredImage`` for dynamic-resolution images."""
        pixels = [None] * len(prepared) if pixels is None else pixels
        for pack, values in zip(prepared, pixels, strict=True):
            values = self._checked_images(values, pack.num_images)
            introduced, refs = [], []
            for image in values:
                digest = image_key(image)
                if digest not in self.shard_images:  # the first use in this shard: this pack carries it
                    self.shard_images[digest] = (self.num_packs, len(introduced))
                    introduced.append(image)
                refs.append(self.shard_images[digest])
            carried = carried_members(introduced, self.dynamic, self.spec.image_shape)
            refs = np.asarray(refs, dtype=np.int64).reshape(-1, 2)
            self._write_sample({**pack.members, **carried, IMAGE_REFS_MEMBER: npy_bytes(refs)})

    def _checked_images(self, values, count: int) -> list:
        """A pack's images as a list, once they are ``count`` images of the kind the spec says."""
        if self.dynamic:
            values = [] if values is None else list(values)
            if len(values) != count or not all(isinstance(image, StoredImage) for image in values):
                raise ValueError(f"{len(values)} images for a pack of {count} dynamic-resolution images (StoredImages)")
            return values
        values = np.zeros((0, *self.spec.image_shape), np.uint8) if values is None else np.asarray(values, dtype=np.uint8)
        if len(values) != count or values.shape[1:] != tuple(self.spec.image_shape):
            raise ValueError(f"images of shape {values.shape} for a pack of {count} images of {self.spec.image_shape}")
        return list(values)

    def _write_sample(self, members: dict[str, bytes]) -> None:
        if self._file is None:
            self._file = open(self.directory / shard_name(len(self.shard_counts)), "wb")
            self.shard_counts.append(0)
        key = f"{self.num_packs:09d}"
        self.sample_offsets.append(self._file.tell())
        self.member_sizes.append([len(members[name]) for name in self.members])
        for name in self.members:
            data = members[name]
            self._file.write(member_header(f"{key}.{name}", len(data)))
            self._file.write(data)
            self._file.write(bytes(padded(len(data)) - len(data)))
        self.shard_counts[-1] += 1
        self.num_packs += 1
        if self._file.tell() >= self.shard_bytes:
            self._close_shard()

    def _close_shard(self) -> None:
        """The end-of-archive blocks, padded to a whole record, as tarfile ends an archive."""
        f = self._file
        f.write(end_of_archive(f.tell()))
        f.flush()
        os.fsync(f.fileno())
        self.shard_sizes.append(f.tell())
        f.close()
        self._file = None
        self.shard_images = {}  # references never leave a shard

    def checkpoint(self) -> None:
        self._checkpoint.save([self._file] if self._file is not None else [], packs=np.int64(self.num_packs),
                              shard_counts=np.asarray(self.shard_counts, np.int64), shard_sizes=np.asarray(self.shard_sizes, np.int64),
                              sample_offsets=np.asarray(self.sample_offsets, np.int64),
                              member_sizes=np.asarray(self.member_sizes, np.int64).reshape(-1),
                              shard_image_digests=np.frombuffer(b"".join(self.shard_images), np.uint8),
                              shard_image_refs=np.asarray(list(self.shard_images.values()), np.int64).reshape(-1))  # fmt: skip

    def publish(self, plan: PlanTable, extra_files: list[Path], meta: PackedMeta) -> PackedMeta:
        """Close the last shard; write the tar indexes, ``.nv-meta/`` and the plan table; rename the
        dataset into place; write the meta last."""
        from neva_pack.files import file_checksum

        if self._file is not None:
            self._close_shard()
        shards = [shard_name(s) for s in range(len(self.shard_counts))]
        index = ShardIndex(shard_counts=self.shard_counts, sample_offsets=self.sample_offsets, parts=self.members,
                           member_sizes=np.asarray(self.member_sizes, np.int64).reshape(-1, len(self.members)),
                           keys=[f"{p:09d}" for p in range(self.num_packs)])  # fmt: skip
        index.write_tar_indexes(self.directory)
        checksums = {name: file_checksum(self.directory / name) for name in shards}
        content = uuid.UUID(bytes=hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).digest()[:16], version=4)
        loader = SAMPLE_LOADER.format(members="DYNAMIC_MEMBERS" if self.dynamic else "MEMBERS")
        _remove(self.directory / META_DIR)  # a publish killed while it wrote them left part of them (index.sqlite)
        write_nv_meta(self.directory / META_DIR, index, content, {"dataset.yaml": DATASET_YAML, "sample_loader.py": loader})
        tmp_plan = prefix_file(self._checkpoint.tmp, PLAN_SUFFIX)
        write_plan_table(tmp_plan, plan)
        final = dataset_path(self.prefix)
        if final.exists() and FORMAT.owns(final):  # an older dataset of this prefix (the meta goes last)
            shutil.rmtree(final)
        os.replace(self.directory, final)
        files = sorted(path for path in final.rglob("*") if path.is_file())
        output_dir = self.prefix.parent
        layout = {"dataset": relative_name(output_dir, final), "shards": shards, "shard_counts": self.shard_counts, "members": list(self.members)}
        meta = meta.replace(format=NAME, num_packs=self.num_packs, layout=layout, image_processor=self.spec.image_processor)
        known = {final / name: checksum for name, checksum in checksums.items()}
        meta = publish(self.prefix, {prefix_file(self.prefix, PLAN_SUFFIX): tmp_plan}, [*files, *extra_files], meta, known=known)
        self._checkpoint.remove()
        return meta

def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Reader:
    """Reads pack p from its shard at the offset the shard's ``.tar.idx`` gives."""

    def __init__(self, prefix: Path, meta: PackedMeta | None = None):
        self.prefix = Path(prefix)
        self.meta = meta if meta is not None else read_meta(meta_path(self.prefix))
        self.image_shape = None if self.meta.image_shape is None else tuple(self.meta.image_shape)
        self.dataset = dataset_path(self.prefix)
        self.samples = ShardSamples(self.dataset)

    def __getstate__(self):  # DataLoader workers reopen the shards
        return {"prefix": self.prefix, "meta": self.meta}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["meta"])

    def __len__(self) -> int:
        return len(self.samples)

    def plan_table(self) -> PlanTable:
        return read_plan_table(prefix_file(self.prefix, PLAN_SUFFIX))

    def sample(self, p: int) -> dict:
        """Pack p's sample as Energon yields it from a CrudeWebdataset: ``__key__`` and member bytes."""
        key, sample = self.samples.read(p)
        with parsing(self.samples.path_of(p)):
            if not key.isdigit() or int(key) != p:
                raise ValueError(f"the sample at pack {p}'s offset is {key!r}")
        return {**sample, "__key__": key}

    def member(self, name: str):
        """A member's content by its full name ``<key>.<part>`` (``decode``'s ``fetch``)."""
        key, _, part = name.partition(".")
        if not key.isdigit():
            raise KeyError(name)
        return self.sample(int(key))[part]

    def pack(self, p: int, images: bool = True) -> ReadPack:
        with parsing(self.samples.path_of(p)):
            pack = decode(self.sample(p), fetch=self.member)
        if images:
            return pack
        return ReadPack(**{**{name: getattr(pack, name) for name in ReadPack.__dataclass_fields__}, "pixels": None, "stored_images": None})

    def images(self, p: int, device=None, dtype=None):
        """The pack's images as the model's input tensor: normalised here, as compact does."""
        return normalised_stack(self, p, device, dtype)

    def close(self) -> None:
        self.samples.close()


def check(reader: Reader, result) -> None:
    """The shards, their indexes and ``.nv-meta/`` describe the same packs as the meta."""
    if len(reader) != reader.meta.num_packs:
        result.add(f"{META_DIR}/.info.json: {len(reader)} samples, the meta {reader.meta.num_packs} packs")
    samples = reader.samples
    for name, offsets, count in zip(samples.shards, samples.offsets, np.diff(samples.starts).tolist()):
        path = reader.dataset / name
        if len(offsets) != count + 1 or np.any(np.diff(offsets) <= 0) or not path.is_file() or offsets[-1] > path.stat().st_size:
            result.add(f"{name}.idx: not {count + 1} increasing offsets within {name}")
    meta_dir = reader.dataset / META_DIR
    for name in ("dataset.yaml", "sample_loader.py", "split.yaml", "index.sqlite", "index.uuid"):
        if not (meta_dir / name).is_file():
            result.add(f"{META_DIR}/{name} is missing")
    if (meta_dir / "index.sqlite").is_file():
        rows = sample_count(meta_dir / "index.sqlite")
        if rows != len(reader):
            result.add(f"{META_DIR}/index.sqlite: {rows} samples, not {len(reader)}")


class EnergonFormat:
    """A Megatron-Energon WebDataset dataset of the packs (``PackedFormat``)."""

    name = NAME
    description = "a Megatron-Energon WebDataset dataset, one pack per sample, uint8 images at any resolution (Energon's loaders)"
    needs_pixels = True
    """Each sample holds its pack's images (uint8)."""
    uses_image_pool = False
    holds_images = True
    """Images are stored (uint8) and normalised when read."""
    holds_dynamic_images = True
    """Its samples carry dynamic-resolution images as their uint8 parts, sizes, tokens and run lengths."""
    holds_videos = True
    limits = Limits(
        max_pack=(1 << 31) - BLOCK,
        max_integer=int(np.iinfo(np.int32).max),
        why="the energon format stores ids and labels as int32 in ustar members (under 8 GiB each)",
    )

    def check_settings(self, **settings) -> None:
        self.limits.check(**settings)

    def files(self, prefix: Path) -> PrefixFiles:
        return prefix_files(prefix, (DATASET_SUFFIX, PLAN_SUFFIX), plan_table_suffix=PLAN_SUFFIX)

    def trusted_files(self, prefix: Path, meta: PackedMeta) -> tuple[Path, ...]:
        """The plan table and every file of the dataset but its shards: the ``.tar.idx`` offsets and
        ``.nv-meta/`` (shard counts; Energon runs its ``sample_loader.py``)."""
        dataset = relative_name(Path(prefix).parent, dataset_path(prefix)) + "/"
        described = [name for name in meta.checksums if name.startswith(dataset) and not name.endswith(".tar")]
        return (prefix_file(prefix, PLAN_SUFFIX), *(Path(prefix).parent / name for name in sorted(described)))

    def owns(self, path: Path) -> bool:
        path = Path(path)
        if path.is_symlink():
            return False
        prefix = path.with_name(path.name.split(".", 1)[0])
        files = self.files(prefix)
        if path in files.temporary:
            return True  # its temporary names (the dataset directory while written among them)
        if path == dataset_path(prefix):  # by its content: only shards, their indexes and .nv-meta/
            return (path.is_dir() and (path / META_DIR / ".info.json").is_file()
                    and all(entry.name == META_DIR or entry.name.startswith("shard_") for entry in path.iterdir()))  # fmt: skip
        if path in files.final:
            return path.is_file() and published_as(prefix, NAME)
        return False

    # the contract's writer(prefix, spec, resume), reader(prefix, meta), prepare(packs, spec) and
    # check(reader, result) are this module's own
    writer = staticmethod(Writer)
    reader = staticmethod(Reader)
    prepare = staticmethod(prepare)
    check = staticmethod(check)

    def summary_line(self, data_prefix: str) -> str:
        return f"{data_prefix}{DATASET_SUFFIX} ({NAME}: a Megatron-Energon dataset; cook its samples with neva_pack.formats.energon.decode)"


FORMAT = EnergonFormat()
