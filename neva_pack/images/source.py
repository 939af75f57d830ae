"""Image bytes by relative name, from a directory or an uncompressed .tar archive.

A name must stay inside the folder (after normalisation and symlinks) unless the user allows
otherwise; a .tar reads as the folder ``tar x`` would unpack; only regular files are opened and at
most a budget of bytes is read, so one hostile path never blocks or exhausts a worker.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from neva_pack.errors import ConfigError
from neva_pack.records import RecordError
from neva_pack.untrusted import FileRefused, compression_of, regular_file_bytes

DEFAULT_MAX_IMAGE_BYTES = 64 << 20
"""64 MiB per image file (a 24-megapixel JPEG is about 10 MB)."""


@dataclass(frozen=True, slots=True)
class TarMember:
    offset: int
    """Byte offset of the member's data in the archive."""
    size: int
    """Size of the member's data in bytes."""
    sparse: bool = False
    """A sparse member (GNU/pax ``--sparse``): its data is not one run of bytes, so it is not read."""


class ImageSource:
    """Reads image bytes by relative name from a directory or an uncompressed .tar archive.

    A tar archive is indexed once (name -> data offset) and opened once per process;
    reading an image is one seek and one read. A name must stay inside the folder (after
    normalisation and symlinks) unless ``allow_outside``; only regular files are opened (never a
    device, FIFO or socket, which could block or never end), and at most ``max_bytes`` are read.
    """

    def __init__(self, root: str | Path | None, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, allow_outside: bool = False):
        self.root = None if root is None else Path(root)
        self.max_bytes = max_bytes
        self.allow_outside = allow_outside
        self._tar_index: dict[str, TarMember] | None = None
        self._tar_file = None
        self._resolved_root = None
        if self.root is None:
            return
        if self.root.is_file() and tarfile.is_tarfile(self.root):
            self._tar_index = _index_tar(self.root)
        elif self.root.is_file():
            raise ConfigError(f"--image_folder {self.root}: {_not_a_tar(self.root)}")
        elif not self.root.is_dir():
            raise ConfigError(f"--image_folder {self.root}: not a directory or a .tar archive")
        else:
            self._resolved_root = self.root.resolve()

    def read(self, name: str) -> bytes:
        if self.root is None:
            raise RecordError("missing_image", f"{name}: the record has an image but no --image_folder was given")
        if self._tar_index is not None:
            return self._read_tar(name)
        path = self._confined(name)
        try:
            return regular_file_bytes(path, self.max_bytes)
        except FileRefused as refused:
            if refused.kind == "missing":
                raise RecordError("missing_image", f"{name}: not found in {self.root}") from None
            if refused.kind == "too_large":
                raise RecordError("image_too_large", f"{name}: more than --max_image_bytes {self.max_bytes:,} bytes") from None
            raise RecordError("unreadable_image", f"{name}: {refused.why}") from None

    def _confined(self, name: str) -> Path:
        """The file a name points at; outside_image_folder unless it stays inside the folder."""
        if self.allow_outside:
            return Path(os.path.normpath(self.root / name))
        self._check_relative(name)
        try:
            resolved = (self._resolved_root / name).resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
            raise RecordError("unreadable_image", f"{name}: its path cannot be resolved ({exc})") from None
        if not resolved.is_relative_to(self._resolved_root):
            raise RecordError("outside_image_folder", f"{name}: resolves to {resolved}, outside --image_folder {self.root}")
        return resolved

    def _check_relative(self, name: str) -> None:
        """The same names are outside the folder whether it is a directory or a .tar archive."""
        if leaves_folder(name):
            raise RecordError("outside_image_folder", f"{name}: not a relative path inside --image_folder {self.root}")

    def _check_bytes(self, name: str, size: int) -> None:
        if size > self.max_bytes:
            raise RecordError("image_too_large", f"{name}: more than --max_image_bytes {self.max_bytes:,} bytes")

    def _read_tar(self, name: str) -> bytes:
        if not self.allow_outside:
            self._check_relative(name)
        member = self._tar_index.get(_normalise_member_name(name))
        if member is None:
            raise RecordError("missing_image", f"{name}: not a member of {self.root}")
        if member.sparse:
            raise RecordError("unreadable_image", f"{name}: a sparse member of {self.root} (archive it without --sparse)")
        self._check_bytes(name, member.size)
        if self._tar_file is None:
            self._tar_file = open(self.root, "rb")
        self._tar_file.seek(member.offset)
        return self._tar_file.read(member.size)

    def __getstate__(self):
        # the index travels to DataLoader workers; each worker opens the archive once itself
        return {key: getattr(self, key) for key in _SOURCE_STATE}

    def __setstate__(self, state):
        for key in _SOURCE_STATE:
            setattr(self, key, state[key])
        self._tar_file = None


_SOURCE_STATE = ("root", "max_bytes", "allow_outside", "_tar_index", "_resolved_root")


def _not_a_tar(path: Path) -> str:
    """Why a file given as --image_folder is not an archive we can index, in one phrase."""
    with open(path, "rb") as f:
        head = f.read(8)
    kind = compression_of(head)
    if kind is not None:
        return f"a {kind}-compressed file; compressed archives are not supported (decompress it to a .tar)"
    return "not a directory or a .tar archive"


def _index_tar(path: Path) -> dict[str, TarMember]:
    """Name -> data of every regular file, hard link and symlink (to a file in the archive), as
    ``tar x`` would lay them out in a folder: the same dataset then reads the same either way."""
    size = path.stat().st_size
    try:
        with tarfile.open(path, "r:") as archive:
            index, symlinks = {}, {}
            for member in archive:
                name = _normalise_member_name(member.name)
                index.pop(name, None)  # a later member of the same name replaces it, as tar x does
                symlinks.pop(name, None)
                if member.issparse():  # its expanded size is not what the archive holds
                    index[name] = TarMember(member.offset_data, member.size, sparse=True)
                elif member.isfile():
                    if member.offset_data + member.size > size:
                        raise ConfigError(f"--image_folder {path}: truncated tar archive ({member.name} is cut short)")
                    index[name] = TarMember(member.offset_data, member.size)
                elif member.islnk():  # a hard link's data is its target's, archived before it
                    target = index.get(_normalise_member_name(member.linkname))
                    if target is not None:
                        index[name] = target
                elif member.issym():
                    symlinks[name] = os.path.join(os.path.dirname(name), member.linkname)
            for name, link in symlinks.items():
                target = _follow_symlinks(link, symlinks)
                if target in index:
                    index[name] = index[target]
            return index
    except (tarfile.TarError, OSError) as exc:
        reason = _not_a_tar(path)
        if reason.startswith("not a"):
            reason = f"truncated or corrupt tar archive ({exc})"
        raise ConfigError(f"--image_folder {path}: {reason}") from None


def leaves_folder(name: str) -> bool:
    """An absolute name, or one whose ``..`` climb above the folder it is relative to."""
    return os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir


def _follow_symlinks(link: str, symlinks: dict[str, str], hops: int = 40) -> str | None:
    """The member a symlink ends at inside the archive; None when it leaves it or loops."""
    for _ in range(hops):
        if leaves_folder(link):
            return None
        link = _normalise_member_name(link)
        if link not in symlinks:
            return link
        link = symlinks[link]
    return None


def _normalise_member_name(name: str) -> str:
    return os.path.normpath(name).lstrip("/").removeprefix("./")
