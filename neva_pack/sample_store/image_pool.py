"""The image pool: every distinct uint8 image once, in the order first seen, keyed by content.

    <segment>.images        raw uint8; fixed: image k = bytes [k * 3*H*W, (k + 1) * 3*H*W), (3, H, W) C-order;
                            dynamic: each image's parts (3, h, w) back to back, at the shapes below
    <segment>.image_keys    raw, 16 bytes per image of <segment>.images: BLAKE3-128 of its content
    <segment>.image_shapes  dynamic only: files.POOL_IMAGE_ROW per image (size, tokens, parts' shapes; a
                            video clip's frames and seconds per temporal patch)
    <segment>.entry_sizes   a compressed dynamic pool only (--frame_compression): int64 bytes of each
                            image's compressed frame in <segment>.images (frame_codec.py)

A pool is a list of segments (the sample store writes one beside each of its segments); pool
index = position in the concatenation of the segments. The key is the content hash (a fixed image:
its pixels; a dynamic one: its row -- size, tokens, shapes -- then its parts' pixels), so a repeated
path and a byte-identical copy under another name are stored once (a cryptographic hash: no
collision to fear between different images, even ones an adversary made; BLAKE3 rather than
BLAKE2b because the key is taken of every image instance in the workers, and BLAKE3 hashes a
336x336 image 7x faster: 0.05 ms against 0.34 ms, about 4% of an image's decode and resize). The sample store's pool segments ARE the compact format's image pool:
one copy on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

from neva_pack.files import OutputFile, relative_name
from neva_pack.sample_store.files import MAX_IMAGE_PARTS, POOL_IMAGE_ROW, pool_images_path, pool_keys_path, pool_shapes_path, pool_sizes_path
from neva_pack.sample_store.frame_codec import FRAME_CODECS, compress_entry, decompress_entry
from neva_pack.core import InputError, StoredImage

__all__ = [
    "KEY_BYTES", "ImagePool", "PoolSegment", "PoolWriter", "image_bytes", "image_key", "load_keys", "pool_row", "pool_segment",
    "read_shapes", "read_sizes", "stored_image",
]  # fmt: skip

KEY_BYTES = 16
SIZE_DTYPE = np.dtype("<i8")
"""A compressed entry's size in the .entry_sizes file."""


def image_key(image) -> bytes:
    """Content key of one uint8 (3, H, W) image, or of a StoredImage (its row, then its parts)."""
    if isinstance(image, StoredImage):
        digest = blake3(pool_row(image).tobytes())
        for part in image.parts:
            digest.update(np.ascontiguousarray(part, dtype=np.uint8).data)
        return digest.digest(KEY_BYTES)
    return blake3(np.ascontiguousarray(image).data).digest(KEY_BYTES)


def pool_row(image: StoredImage) -> np.ndarray:
    """The image's POOL_IMAGE_ROW (one record); ValueError for parts the pool cannot hold."""
    parts = image.parts
    if not 1 <= len(parts) <= MAX_IMAGE_PARTS or any(part.ndim != 3 or part.shape[0] != 3 or part.dtype != np.uint8 for part in parts):
        raise ValueError(f"a stored image must have 1 to {MAX_IMAGE_PARTS} uint8 (3, H, W) parts "
                         f"(got {[(part.shape, str(part.dtype)) for part in parts]})")  # fmt: skip
    row = np.zeros(1, dtype=POOL_IMAGE_ROW)
    row["width"], row["height"] = image.size
    row["tokens"] = image.tokens
    row["parts"] = len(parts)
    for k, part in enumerate(parts):
        row["shapes"][0, k] = part.shape[1:]
    if image.frames and (len(parts) != 1 or image.frames < 1 or parts[0].shape[1] % image.frames):
        raise ValueError(f"a video clip of {image.frames} frames must be one part of that many frames stacked (got {parts[0].shape})")
    row["frames"] = image.frames
    row["grid_seconds"] = image.grid_seconds
    return row


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSegment:
    images_file: Path
    """The segment's raw uint8 images."""
    keys_file: Path
    """The segment's 16-byte keys, one per image."""
    count: int
    """Images in the segment."""
    checksums: tuple[str, ...] | None = None
    """xxh3-128 (hex) of the images, of the keys file and (dynamic) of the shapes file, computed as
    they were written: a compact output, whose pool these files are, publishes them without reading
    GBs of pixels back. None where not known (a segment with no image, a store from an earlier version)."""
    shapes_file: Path | None = None
    """The segment's POOL_IMAGE_ROW per image: a dynamic pool's; None for a fixed one."""
    codec: str | None = None
    """A dynamic pool's entries compressed with this codec (frame_codec.FRAME_CODECS), one frame each;
    None: raw uint8."""
    sizes_file: Path | None = None
    """A compressed segment's int64 bytes of each entry in ``images_file``; None when raw."""

    @property
    def dynamic(self) -> bool:
        return self.shapes_file is not None

    @property
    def files(self) -> tuple[Path, ...]:
        """Its files (those a segment with images has), in the order of ``checksums``."""
        return (self.images_file, self.keys_file) + ((self.shapes_file,) if self.dynamic else ()) + ((self.sizes_file,) if self.codec else ())

    def layout(self, output_dir: Path) -> dict:
        """The segment as an output's meta lists it (a compact output's ``layout["pool"]`` entry): its files
        relative to ``output_dir``, its count, and a compressed segment's codec."""
        entry = {"images": relative_name(output_dir, self.images_file), "keys": relative_name(output_dir, self.keys_file), "count": self.count}
        if self.dynamic:
            entry["shapes"] = relative_name(output_dir, self.shapes_file)
        if self.codec is not None:
            entry.update(codec=self.codec, sizes=relative_name(output_dir, self.sizes_file))
        return entry

    @classmethod
    def from_layout(cls, entry: dict, output_dir: Path) -> "PoolSegment":
        """``layout``'s inverse; ValueError for a codec this neva_pack does not know."""
        codec = entry.get("codec")
        if codec is not None and (codec not in FRAME_CODECS or "shapes" not in entry or "sizes" not in entry):
            raise ValueError(f"a pool part compressed with {codec!r} (this neva_pack reads {FRAME_CODECS}, with shapes and sizes)")
        return cls(images_file=output_dir / entry["images"], keys_file=output_dir / entry["keys"], count=int(entry["count"]),
                   shapes_file=output_dir / entry["shapes"] if "shapes" in entry else None,
                   codec=codec, sizes_file=output_dir / entry["sizes"] if codec else None)  # fmt: skip

    def known_checksums(self) -> dict[Path, str]:
        """file -> checksum, for the files whose checksum the segment knows."""
        if self.checksums is None or not self.count:
            return {}
        return dict(zip(self.files, self.checksums))


def pool_segment(
    directory: Path, name: str, count: int, checksums: dict[str, str] | None = None, *, dynamic: bool = False,
    codec: str | None = None,
) -> PoolSegment:  # fmt: skip
    """``checksums``: ``PoolWriter.checksums()`` as the sample store keeps it ({"images", "keys"} and,
    dynamic, "shapes"; compressed, "sizes"). ``dynamic``: a pool of StoredImages (with a shapes file);
    ``codec``: its entries compressed (frame_codec.py; dynamic pools only)."""
    if codec is not None and (not dynamic or codec not in FRAME_CODECS):
        raise ValueError(f"frame codec {codec!r}: only a dynamic pool's entries are compressed, with one of {FRAME_CODECS}")
    names = ("images", "keys") + (("shapes",) if dynamic else ()) + (("sizes",) if codec else ())
    return PoolSegment(
        images_file=pool_images_path(directory, name), keys_file=pool_keys_path(directory, name), count=count,
        checksums=None if checksums is None else tuple(checksums[key] for key in names),
        shapes_file=pool_shapes_path(directory, name) if dynamic else None,
        codec=codec, sizes_file=pool_sizes_path(directory, name) if codec else None,
    )  # fmt: skip


class PoolWriter:
    """Adds images to a pool segment, skipping any whose key the pool (any earlier segment) already holds."""

    def __init__(self, segment: PoolSegment, known: dict[bytes, int], first_index: int):
        self.segment = segment
        self.known = known
        self.next_index = first_index
        self.added = 0
        self._files: list[OutputFile] | None = None  # opened with the first new image: an empty segment has no files

    def add(self, image) -> tuple[bytes, int]:
        """(key, pool index) of the image (uint8 (3, H, W), or a StoredImage in a dynamic pool), storing it if new."""
        return self.add_keyed(image_key(image), image)

    def add_keyed(self, key: bytes, image) -> tuple[bytes, int]:
        """``add`` for an image whose key is already known (copied from another pool segment); a compressed
        pool's entry is compressed here (a run's workers send theirs compressed: ``add_entry``), to the
        same bytes: one codec, one level, whichever process runs it."""
        index = self.known.get(key)
        if index is not None:
            return key, index
        if isinstance(image, StoredImage) != self.segment.dynamic:
            raise ValueError(f"{self.segment.images_file.name}: a {'fixed' if self.segment.dynamic else 'dynamic'} "
                             "image for a pool of the other kind (a bug)")  # fmt: skip
        if self.segment.dynamic:
            row = pool_row(image)
            parts = [np.ascontiguousarray(part, dtype=np.uint8).data for part in image.parts]
            if self.segment.codec is None:
                return self.add_entry(key, row, *parts)
            return self.add_entry(key, row, compress_entry(self.segment.codec, b"".join(parts) if len(parts) > 1 else parts[0]))
        self._open_files()
        self._files[0].write(np.ascontiguousarray(image, dtype=np.uint8).data)
        return self._added(key)

    def add_entry(self, key: bytes, row: np.ndarray, *stored) -> tuple[bytes, int]:
        """Add one image of a dynamic pool as the segment stores it: its POOL_IMAGE_ROW and its bytes
        (buffers: its raw parts, or the codec's one frame of them): a join copies entries so, decoding nothing."""
        index = self.known.get(key)
        if index is not None:
            return key, index
        self._open_files()
        for data in stored:
            self._files[0].write(data)
        self._files[2].write(np.asarray(row, dtype=POOL_IMAGE_ROW).tobytes())
        if self.segment.codec is not None:
            self._files[3].write(np.array([sum(len(memoryview(data).cast("B")) for data in stored)], dtype=SIZE_DTYPE).tobytes())
        return self._added(key)

    def _open_files(self) -> None:
        if self._files is None:
            self._files = [OutputFile(self.segment.images_file, write_behind=True), OutputFile(self.segment.keys_file)]
            if self.segment.dynamic:
                self._files.append(OutputFile(self.segment.shapes_file))
            if self.segment.codec is not None:
                self._files.append(OutputFile(self.segment.sizes_file))

    def _added(self, key: bytes) -> tuple[bytes, int]:
        self._files[1].write(key)
        index = self.next_index
        self.known[key] = index
        self.next_index += 1
        self.added += 1
        return key, index

    def close(self) -> int:
        """Make the segment durable; the number of images it holds."""
        for file in self._files or ():
            file.close()
        return self.added

    def checksums(self) -> dict[str, str] | None:
        """What the segment's files hash to (``PoolSegment.checksums``), None when it holds no image."""
        if self._files is None:
            return None
        names = ("images", "keys") + (("shapes",) if self.segment.dynamic else ()) + (("sizes",) if self.segment.codec else ())
        return dict(zip(names, (file.checksum() for file in self._files)))


def load_keys(segments: list[PoolSegment]) -> dict[bytes, int]:
    """key -> pool index of every image of the segments."""
    known: dict[bytes, int] = {}
    index = 0
    for segment in segments:
        if segment.count == 0:
            continue
        data = segment.keys_file.read_bytes()
        for k in range(segment.count):
            known.setdefault(data[k * KEY_BYTES : (k + 1) * KEY_BYTES], index + k)
        index += segment.count
    return known


def read_shapes(segment: PoolSegment) -> np.ndarray:
    """The POOL_IMAGE_ROW records of a dynamic segment (ValueError when the file is not ``count`` of them)."""
    rows = np.fromfile(segment.shapes_file, dtype=POOL_IMAGE_ROW)
    if len(rows) != segment.count or segment.shapes_file.stat().st_size != segment.count * POOL_IMAGE_ROW.itemsize:
        raise ValueError(f"{segment.shapes_file.name}: not {segment.count} image rows")
    parts = rows["parts"]
    if np.any(parts < 1) or np.any(parts > MAX_IMAGE_PARTS) or np.any(rows["shapes"] < 0) or np.any(rows["frames"] < 0):
        raise ValueError(f"{segment.shapes_file.name}: an image row with impossible parts or shapes")
    return rows


def read_sizes(segment: PoolSegment) -> np.ndarray:
    """int64 bytes of each entry of a compressed segment (ValueError when the file is not ``count`` of
    them, or one is not a possible frame's size)."""
    sizes = np.fromfile(segment.sizes_file, dtype=SIZE_DTYPE)
    if len(sizes) != segment.count or segment.sizes_file.stat().st_size != segment.count * SIZE_DTYPE.itemsize:
        raise ValueError(f"{segment.sizes_file.name}: not {segment.count} entry sizes")
    if np.any(sizes < 1):
        raise ValueError(f"{segment.sizes_file.name}: an entry of {int(sizes.min())} bytes")
    return sizes


def stored_offsets(segment: PoolSegment, rows: np.ndarray) -> np.ndarray:
    """int64 byte offsets (count + 1) of each entry in a dynamic segment's images file: its parts'
    sizes from the rows (raw), or the sizes file (compressed)."""
    sizes = image_bytes(rows) if segment.codec is None else read_sizes(segment)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def stored_image(row, data: np.ndarray) -> StoredImage:
    """The StoredImage of one POOL_IMAGE_ROW and its parts' uint8 bytes (``image_bytes`` of them)."""
    parts, at = [], 0
    for height, width in row["shapes"][: int(row["parts"])].tolist():
        parts.append(data[at : at + 3 * height * width].reshape(3, height, width))
        at += 3 * height * width
    return StoredImage(size=(int(row["width"]), int(row["height"])), parts=tuple(parts), tokens=int(row["tokens"]),
                       frames=int(row["frames"]), grid_seconds=float(row["grid_seconds"]))  # fmt: skip


def image_bytes(rows: np.ndarray) -> np.ndarray:
    """int64 bytes of each dynamic image (its parts' pixels) of POOL_IMAGE_ROW records."""
    shapes = rows["shapes"].astype(np.int64)
    used = np.arange(MAX_IMAGE_PARTS)[None, :] < rows["parts"][:, None]
    return (3 * shapes[:, :, 0] * shapes[:, :, 1] * used).sum(axis=1)


class ImagePool:
    """Reads images by pool index from the segments; ``mmap=False`` reads with file reads (bounded RSS).

    ``image_shape`` None: a dynamic pool (``read_stored``); else every image is that (3, H, W) (``read``)."""

    def __init__(self, segments: list[PoolSegment], image_shape, mmap: bool = True):
        self.segments = [segment for segment in segments if segment.count]
        self.image_shape = None if image_shape is None else tuple(image_shape)
        self.image_bytes = None if image_shape is None else int(np.prod(self.image_shape))
        self.starts = np.cumsum([0] + [segment.count for segment in self.segments]).astype(np.int64)
        self._mmap = mmap
        self._maps: dict[int, np.ndarray] = {}
        self._files: dict[int, int] = {}
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # dynamic: segment -> (rows, byte offsets)

    @property
    def dynamic(self) -> bool:
        return self.image_shape is None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _located(self, indices) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"image index outside the pool of {len(self)} images")
        segments = np.searchsorted(self.starts, indices, side="right") - 1
        return segments, indices - self.starts[segments]

    def read(self, indices) -> np.ndarray:
        """uint8 (len(indices), 3, H, W) of a fixed pool."""
        if self.dynamic:
            raise ValueError("a dynamic-resolution pool's images have no one shape: read them with read_stored")
        segments, local = self._located(indices)
        out = np.empty((len(segments), *self.image_shape), dtype=np.uint8)
        for k, (segment, at) in enumerate(zip(segments.tolist(), local.tolist())):
            if self._mmap:
                out[k] = self._map(segment)[at]
            else:
                data = os.pread(self._file(segment), self.image_bytes, at * self.image_bytes)
                out[k] = np.frombuffer(data, dtype=np.uint8).reshape(self.image_shape)
        return out

    def views(self, indices) -> list[np.ndarray]:
        """Read-only (1, 3, H, W) views into the memory-mapped segments of a fixed pool, one per index (no copy)."""
        if self.dynamic:
            raise ValueError("a dynamic-resolution pool's images have no one shape: read them with read_stored")
        segments, local = self._located(indices)
        return [self._map(segment)[at:][:1] for segment, at in zip(segments.tolist(), local.tolist())]

    def stored_rows(self, indices) -> np.ndarray:
        """POOL_IMAGE_ROW of each image of a dynamic pool (size, tokens, shapes: no pixel read)."""
        segments, local = self._located(indices)
        out = np.zeros(len(segments), dtype=POOL_IMAGE_ROW)
        for k, (segment, at) in enumerate(zip(segments.tolist(), local.tolist())):
            out[k] = self._segment_rows(segment)[0][at]
        return out

    def read_for_writer(self, indices):
        """What a format's writer takes for these images: their StoredImages in a pool of images each at
        its own size, else one uint8 array of the crops (``read``)."""
        return self.read_stored(indices) if self.dynamic else self.read(indices)

    def read_stored(self, indices) -> list:
        """images.StoredImage of each index of a dynamic pool, its parts copied out of the files."""
        if not self.dynamic:
            raise ValueError("a fixed pool's images are arrays: read them with read")
        segments, local = self._located(indices)
        images = []
        for segment, at in zip(segments.tolist(), local.tolist()):
            rows, offsets = self._segment_rows(segment)
            row = rows[at]
            first, end = int(offsets[at]), int(offsets[at + 1])
            if self._mmap:
                data = np.array(self._map(segment)[first:end])
            else:
                data = np.frombuffer(os.pread(self._file(segment), end - first, first), dtype=np.uint8)
            if len(data) != end - first:
                raise ValueError(f"{self.segments[segment].images_file.name}: ends inside image {at}")
            images.append(stored_image(row, self._decoded(segment, at, row, data)))
        return images

    def _decoded(self, segment: int, at: int, row, data: np.ndarray) -> np.ndarray:
        """An entry's raw uint8 bytes (``data`` as stored); a compressed entry decoded within its row's size
        (InputError, one line, for a damaged one: a reader refuses it, never decodes past its row)."""
        codec = self.segments[segment].codec
        if codec is None:
            return data
        try:
            raw = decompress_entry(codec, data.tobytes(), int(image_bytes(row[None])[0]))
        except ValueError as exc:
            raise InputError(f"{self.segments[segment].images_file}: image {at}: {exc}") from None
        return np.frombuffer(raw, dtype=np.uint8)

    def entries_problem(self, segment: int) -> str | None:
        """What is wrong with a compressed segment's entries (``segment`` an index into ``segments``): each
        decoded within its row's size and its content key compared with the keys file's (what verify
        checks: the frames decode to exactly what was stored). None when all agree, or the pool is raw."""
        part = self.segments[segment]
        if part.codec is None:
            return None
        keys = part.keys_file.read_bytes()
        start = int(self.starts[segment])
        for at in range(part.count):
            try:
                (image,) = self.read_stored([start + at])
            except (ValueError, InputError) as exc:
                return str(exc)
            if image_key(image) != keys[at * KEY_BYTES : (at + 1) * KEY_BYTES]:
                return f"{part.images_file.name}: image {at} decodes to other pixels than its key's"
        return None

    def expected_bytes(self, segment: int) -> int:
        """What the images file of ``segment`` (an index into ``segments``) must hold."""
        if not self.dynamic:
            return self.segments[segment].count * self.image_bytes
        return int(self._segment_rows(segment)[1][-1])

    def _segment_rows(self, segment: int) -> tuple[np.ndarray, np.ndarray]:
        if segment not in self._rows:
            rows = read_shapes(self.segments[segment])
            self._rows[segment] = rows, stored_offsets(self.segments[segment], rows)
        return self._rows[segment]

    def _map(self, segment: int) -> np.ndarray:
        """The segment's images file mapped: (count, 3, H, W) for a fixed pool, flat bytes for a dynamic one."""
        if segment not in self._maps:
            shape = None if self.dynamic else (self.segments[segment].count, *self.image_shape)
            self._maps[segment] = np.memmap(self.segments[segment].images_file, dtype=np.uint8, mode="r", shape=shape)
        return self._maps[segment]

    def _file(self, segment: int) -> int:
        if segment not in self._files:
            self._files[segment] = os.open(self.segments[segment].images_file, os.O_RDONLY)
        return self._files[segment]

    def close(self) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()
        self._maps.clear()

    def __del__(self):
        self.close()
