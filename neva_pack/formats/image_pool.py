"""The image pool: every distinct uint8 image once, in the order first seen, keyed by content.

    part.images       raw uint8, image k = bytes [k * 3*H*W, (k + 1) * 3*H*W), (3, H, W) C-order
    part.image_keys   raw, 16 bytes per image of part.images: BLAKE2b-128 of its pixels

A pool is a list of parts (the sample store writes one per shard); pool index = position in the
concatenation of the parts. The key is the pixels' content hash, so a repeated path and a
byte-identical copy under another name are stored once (BLAKE2b: no collision to fear between
different images). The sample store's parts ARE the compact format's image pool: one copy on disk.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.formats.output_file import OutputFile
from neva_pack.paths import pool_images_path, pool_keys_path

KEY_BYTES = 16


def image_key(image: np.ndarray) -> bytes:
    """Content key of one uint8 (3, H, W) image."""
    return hashlib.blake2b(np.ascontiguousarray(image).data, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPart:
    images_file: Path
    """The part's raw uint8 images."""
    keys_file: Path
    """The part's 16-byte keys, one per image."""
    count: int
    """Images in the part."""
    checksums: tuple[str, str] | None = None
    """xxh3-128 (hex) of the images and of the keys file, computed as they were written: a compact
    output, whose pool these files are, publishes them without reading GBs of pixels back. None
    where not known (a part with no image, a store from an earlier version)."""

    def known_checksums(self) -> dict[Path, str]:
        """file -> checksum, for the files whose checksum the part knows."""
        if self.checksums is None or not self.count:
            return {}
        return dict(zip((self.images_file, self.keys_file), self.checksums))


def pool_part(directory: Path, name: str, count: int, checksums: dict[str, str] | None = None) -> PoolPart:
    """``checksums``: ``PoolWriter.checksums()`` as the sample store keeps it ({"images", "keys"})."""
    return PoolPart(
        images_file=pool_images_path(directory, name), keys_file=pool_keys_path(directory, name), count=count,
        checksums=None if checksums is None else (checksums["images"], checksums["keys"]),
    )  # fmt: skip


class PoolWriter:
    """Adds images to a pool part, skipping any whose key the pool (any earlier part) already holds."""

    def __init__(self, part: PoolPart, known: dict[bytes, int], first_index: int):
        self.part = part
        self.known = known
        self.next_index = first_index
        self.added = 0
        self._images: OutputFile | None = None  # opened with the first new image: an empty part has no files
        self._keys: OutputFile | None = None

    def add(self, image: np.ndarray) -> tuple[bytes, int]:
        """(key, pool index) of the image, storing it if new."""
        return self.add_keyed(image_key(image), image)

    def add_keyed(self, key: bytes, image: np.ndarray) -> tuple[bytes, int]:
        """``add`` for an image whose key is already known (copied from another pool part)."""
        index = self.known.get(key)
        if index is not None:
            return key, index
        if self._images is None:
            self._images = OutputFile(self.part.images_file, write_behind=True)
            self._keys = OutputFile(self.part.keys_file)
        self._images.write(np.ascontiguousarray(image, dtype=np.uint8).data)
        self._keys.write(key)
        index = self.next_index
        self.known[key] = index
        self.next_index += 1
        self.added += 1
        return key, index

    def close(self) -> int:
        """Make the part durable; the number of images it holds."""
        for file in (self._images, self._keys):
            if file is not None:
                file.close()
        return self.added

    def checksums(self) -> dict[str, str] | None:
        """What the part's files hash to (``PoolPart.checksums``), None when it holds no image."""
        if self._images is None:
            return None
        return {"images": self._images.checksum(), "keys": self._keys.checksum()}


def load_keys(parts: list[PoolPart]) -> dict[bytes, int]:
    """key -> pool index of every image of the parts."""
    known: dict[bytes, int] = {}
    index = 0
    for part in parts:
        if part.count == 0:
            continue
        data = part.keys_file.read_bytes()
        for k in range(part.count):
            known.setdefault(data[k * KEY_BYTES : (k + 1) * KEY_BYTES], index + k)
        index += part.count
    return known


class ImagePool:
    """Reads images by pool index from the parts; ``mmap=False`` reads with file reads (bounded RSS)."""

    def __init__(self, parts: list[PoolPart], image_shape, mmap: bool = True):
        self.parts = [part for part in parts if part.count]
        self.image_shape = tuple(image_shape)
        self.image_bytes = int(np.prod(self.image_shape))
        self.starts = np.cumsum([0] + [part.count for part in self.parts]).astype(np.int64)
        self._mmap = mmap
        self._maps: dict[int, np.ndarray] = {}
        self._files: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, indices) -> np.ndarray:
        """uint8 (len(indices), 3, H, W)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), *self.image_shape), dtype=np.uint8)
        if not len(indices):  # a text-only pack
            return out
        if indices.min() < 0 or indices.max() >= len(self):
            raise IndexError(f"image index outside the pool of {len(self)} images")
        parts = np.searchsorted(self.starts, indices, side="right") - 1
        for k, (index, part) in enumerate(zip(indices.tolist(), parts.tolist())):
            local = index - int(self.starts[part])
            if self._mmap:
                out[k] = self._map(part)[local]
            else:
                data = os.pread(self._file(part), self.image_bytes, local * self.image_bytes)
                out[k] = np.frombuffer(data, dtype=np.uint8).reshape(self.image_shape)
        return out

    def views(self, indices) -> list[np.ndarray]:
        """Read-only (1, 3, H, W) views into the memory-mapped parts, one per index (no copy)."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"image index outside the pool of {len(self)} images")
        parts = np.searchsorted(self.starts, indices, side="right") - 1
        return [self._map(part)[index - int(self.starts[part]) :][:1] for index, part in zip(indices.tolist(), parts.tolist())]

    def _map(self, part: int) -> np.ndarray:
        if part not in self._maps:
            shape = (self.parts[part].count, *self.image_shape)
            self._maps[part] = np.memmap(self.parts[part].images_file, dtype=np.uint8, mode="r", shape=shape)
        return self._maps[part]

    def _file(self, part: int) -> int:
        if part not in self._files:
            self._files[part] = os.open(self.parts[part].images_file, os.O_RDONLY)
        return self._files[part]

    def close(self) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()
        self._maps.clear()

    def __del__(self):
        self.close()
