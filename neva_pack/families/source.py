"""Image bytes by relative name, from a directory or an uncompressed .tar archive.

A name must stay inside the folder (after normalisation and symlinks) unless the user allows
otherwise; a .tar reads as the folder ``tar x`` would unpack; only regular files are opened and at
most a budget of bytes is read, so one hostile path never blocks or exhausts a worker. An ``s3://``
folder is a prefix (or a .tar object) read by ranged requests (``files.remote``): the same names are
refused, and no more than the budget is ever fetched.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from neva_pack.core import ConfigError
from neva_pack.records import RecordError
from neva_pack.files import FileRefused, RemoteError, RemoteFiles, compression_of, is_remote, open_regular, regular_file_bytes

DEFAULT_MAX_IMAGE_BYTES = 64 << 20
"""64 MiB per image file (a 24-megapixel JPEG is about 10 MB)."""

HEADER_BUFFER = 16 << 10
"""Bytes read at a time from an archive member opened for its header: a JPEG's or PNG's header
(EXIF and ICC included, usually) in one read."""


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
        self.root = None if root is None else root if is_remote(root) else Path(root)
        self.max_bytes = max_bytes
        self.allow_outside = allow_outside
        self._tar_index: dict[str, TarMember] | None = None
        self._tar_file = None
        self._resolved_root = None
        self._remote: RemoteFiles | None = None
        self._folders: dict[str, str] = {}
        if self.root is None:
            return
        if is_remote(self.root):
            self._open_remote()
            return
        if self.root.is_file() and tarfile.is_tarfile(self.root):
            self._tar_index = _index_tar(self.root)
        elif self.root.is_file():
            raise ConfigError(f"--image_folder {self.root}: {_not_a_tar(self.root)}")
        elif not self.root.is_dir():
            raise ConfigError(f"--image_folder {self.root}: not a directory or a .tar archive")
        else:
            self._resolved_root = self.root.resolve()

    def _open_remote(self) -> None:
        """An ``s3://`` folder: a .tar object (indexed now, its members read by range) or a prefix."""
        self._remote = RemoteFiles(self.root)
        try:
            size = self._remote.size()
            if size is not None:
                with self._remote.open(block_size=1 << 20) as archive:
                    self._tar_index = _index_members(archive, size, self.root)
            elif not self._remote.has_objects():
                raise ConfigError(f"--image_folder {self.root}: no such prefix or archive")
        except RemoteError as exc:
            raise ConfigError(f"--image_folder {exc}") from None

    def read(self, name: str) -> bytes:
        """The image file's bytes (at most ``max_bytes``): what a sample's images are decoded from."""
        self._check_source(name)
        if self._tar_index is not None:
            member = self._member(name)
            if self._remote is not None:
                return self._remote_call(name, self._remote.read, None, member.offset, member.offset + member.size)
            archive = self._archive()
            archive.seek(member.offset)
            return archive.read(member.size)
        if self._remote is not None:
            data = self._remote_call(name, self._remote.read, self._remote_name(name), 0, self.max_bytes + 1)
            self._check_bytes(name, len(data))
            return data
        path = self._confined(name)
        try:
            return regular_file_bytes(path, self.max_bytes)
        except FileRefused as refused:
            raise self._refused(name, refused) from None

    def open(self, name: str) -> BinaryIO:
        """The image file as an unread binary file object (the caller closes it), for a reader that
        needs its first bytes only (an image header): the same names confined, the same skips as
        ``read`` and the byte budget checked from the file's (or member's) size, with nothing read."""
        self._check_source(name)
        if self._tar_index is not None:
            member = self._member(name)
            return io.BufferedReader(_MemberReader(self._archive(), member.offset, member.size), HEADER_BUFFER)
        if self._remote is not None:
            key = self._remote_name(name)
            size = self._remote_call(name, self._remote.size, key)
            if size is None:
                raise RecordError("missing_image", f"{name}: not found in {self.root}")
            self._check_bytes(name, size)
            return self._remote_call(name, self._remote.open, key, HEADER_BUFFER)
        path = self._confined(name)
        try:
            return open_regular(path, self.max_bytes)
        except FileRefused as refused:
            raise self._refused(name, refused) from None

    def _remote_name(self, name: str) -> str:
        """The object's name under the prefix: a relative name, normalised as a path is (no symlinks
        in object storage; a name leaving the prefix is refused even with ``allow_outside``)."""
        self._check_relative(name)
        key = os.path.normpath(name)
        if key in ("", os.curdir):
            raise RecordError("missing_image", f"{name}: not found in {self.root}")
        return key

    def _remote_call(self, name: str, call, *args):
        try:
            return call(*args)
        except FileNotFoundError:
            raise RecordError("missing_image", f"{name}: not found in {self.root}") from None
        except RemoteError as exc:
            raise RecordError("unreadable_image", f"{name}: {exc}") from None

    def _check_source(self, name: str) -> None:
        if self.root is None:
            raise RecordError("missing_image", f"{name}: the record has an image but no --image_folder was given")

    def _refused(self, name: str, refused: FileRefused) -> RecordError:
        if refused.kind == "missing":
            return RecordError("missing_image", f"{name}: not found in {self.root}")
        if refused.kind == "too_large":
            return RecordError("image_too_large", f"{name}: more than --max_image_bytes {self.max_bytes:,} bytes")
        return RecordError("unreadable_image", f"{name}: {refused.why}")

    def _confined(self, name: str) -> str:
        """The file a name points at; outside_image_folder unless it stays inside the folder."""
        if self.allow_outside:
            return os.path.normpath(self.root / name)
        self._check_relative(name)
        resolved = self._resolved(name)
        root = str(self._resolved_root)
        if resolved != root and not resolved.startswith(root.rstrip(os.sep) + os.sep):
            raise RecordError("outside_image_folder", f"{name}: resolves to {resolved}, outside --image_folder {self.root}")
        return resolved

    def _resolved(self, name: str) -> str:
        """The name's real path. Its folder's real path is remembered (a dataset's images share a few
        folders), so a plain file costs one ``lstat``; a symlink, a ``..`` or anything unusual is
        resolved whole, as the first time."""
        folder, file = os.path.split(name)
        if file in ("", os.curdir) or os.pardir in name.split(os.sep):
            return self._resolved_whole(name)
        parent = self._folders.get(folder)
        if parent is None:
            try:
                parent = str((self._resolved_root / folder).resolve())
            except (OSError, RuntimeError, ValueError):
                return self._resolved_whole(name)
            if len(self._folders) >= 1 << 16:
                self._folders.clear()
            self._folders[folder] = parent
        path = os.path.join(parent, file)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return self._resolved_whole(name)
        except (OSError, ValueError):  # missing (its detail is open's), or a name the OS refuses
            return self._resolved_whole(name)
        return path

    def _resolved_whole(self, name: str) -> str:
        try:
            return str((self._resolved_root / name).resolve())
        except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
            raise RecordError("unreadable_image", f"{name}: its path cannot be resolved ({exc})") from None

    def _check_relative(self, name: str) -> None:
        """The same names are outside the folder whether it is a directory or a .tar archive."""
        if leaves_folder(name):
            raise RecordError("outside_image_folder", f"{name}: not a relative path inside --image_folder {self.root}")

    def _check_bytes(self, name: str, size: int) -> None:
        if size > self.max_bytes:
            raise RecordError("image_too_large", f"{name}: more than --max_image_bytes {self.max_bytes:,} bytes")

    def _member(self, name: str) -> TarMember:
        """The archive's member of that name, within the byte budget (nothing read)."""
        if not self.allow_outside:
            self._check_relative(name)
        member = self._tar_index.get(_normalise_member_name(name))
        if member is None:
            raise RecordError("missing_image", f"{name}: not a member of {self.root}")
        if member.sparse:
            raise RecordError("unreadable_image", f"{name}: a sparse member of {self.root} (archive it without --sparse)")
        self._check_bytes(name, member.size)
        return member

    def _archive(self):
        if self._tar_file is None:
            self._tar_file = self._remote.open(block_size=HEADER_BUFFER) if self._remote is not None else open(self.root, "rb")
        return self._tar_file

    def __getstate__(self):
        # the index travels to DataLoader workers; each worker opens the archive, and resolves folders, itself
        return {key: getattr(self, key) for key in _SOURCE_STATE}

    def __setstate__(self, state):
        for key in _SOURCE_STATE:
            setattr(self, key, state[key])
        self._tar_file = None
        self._folders = {}


_SOURCE_STATE = ("root", "max_bytes", "allow_outside", "_tar_index", "_resolved_root", "_remote")


class _MemberReader(io.RawIOBase):
    """An archive member's bytes as a file of its own (positions from its first byte), read from
    the archive's open file only as far as the reader asks; closing it leaves the archive open."""

    def __init__(self, archive, offset: int, size: int):
        super().__init__()
        self._archive, self._offset, self._size, self._position = archive, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._size - self._position))
        if count == 0:
            return 0
        self._archive.seek(self._offset + self._position)
        count = self._archive.readinto(memoryview(buffer)[:count])
        self._position += count
        return count


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
    try:
        with open(path, "rb") as f:
            return _index_members(f, path.stat().st_size, path)
    except OSError as exc:
        reason = _not_a_tar(path)
        if reason.startswith("not a"):
            reason = f"truncated or corrupt tar archive ({exc})"
        raise ConfigError(f"--image_folder {path}: {reason}") from None


def _index_members(file, size: int, path) -> dict[str, TarMember]:
    """``_index_tar`` of an open archive of ``size`` bytes (a local file, or a remote object read by range)."""
    try:
        with tarfile.open(fileobj=file, mode="r:") as archive:
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
        file.seek(0)
        kind = compression_of(file.read(8))
        reason = (f"a {kind}-compressed file; compressed archives are not supported (decompress it to a .tar)" if kind
                  else f"truncated or corrupt tar archive ({exc})")  # fmt: skip
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
