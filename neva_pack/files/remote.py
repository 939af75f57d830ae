"""Object storage (``s3://``) through fsspec / s3fs: what a remote input, image prefix or output needs.

    s3://bucket/data.jsonl        --data_path      copied once into the staging directory (``local_copy``)
    s3://bucket/images/           --image_folder   read image by image (``RemoteFiles``: one ranged GET each)
    s3://bucket/images.tar                         indexed once, then one ranged GET per member
    s3://bucket/out/              --output_dir     written in a local staging directory and mirrored
                                                   (``mirror``): the files first, the completion markers
                                                   (a store's progress file, a prefix's meta) last

Credentials come only from the environment, as s3fs (botocore) reads them: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, ..., the endpoint from AWS_ENDPOINT_URL or
FSSPEC_S3_ENDPOINT_URL. No flag takes one, and an error from the storage is one line with every
credential the environment holds blanked out (``RemoteError``). A POSIX path never comes here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "STAGING_VARIABLE",
    "Mirrored",
    "RemoteError",
    "RemoteFiles",
    "is_remote",
    "local_copy",
    "location",
    "mirror",
    "pull",
    "redacted",
    "remote_copy",
    "remote_listing",
    "staging_root",
    "url_join",
]  # fmt: skip

SCHEMES = ("s3://",)
"""URL schemes read and written through fsspec (``s3fs`` installs the filesystem: ``pip install neva-pack[s3]``)."""
STAGING_VARIABLE = "NEVA_PACK_STAGING_DIR"
"""Where a remote run stages its files (default: the system's temporary directory)."""
_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECURITY_TOKEN")


class RemoteError(OSError):
    """A storage request failed: one line, naming the URL, with the environment's credentials blanked."""


def is_remote(value) -> bool:
    """An ``s3://`` URL (a str: a Path would have collapsed its ``//``)."""
    return isinstance(value, str) and value.startswith(SCHEMES)


def location(value: str | os.PathLike) -> str | Path:
    """A path flag's value: a URL kept as the str it is, anything else a Path."""
    return value if is_remote(value) else Path(value)


def url_join(url: str, *names: str) -> str:
    """``url`` / names, with one slash between."""
    return "/".join([url.rstrip("/"), *(name.strip("/") for name in names)])


def redacted(text: str) -> str:
    """``text`` with every credential the environment holds replaced by ***."""
    for name in _SECRETS:
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _failed(url: str, exc: BaseException, doing: str) -> RemoteError:
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return RemoteError(redacted(f"{url}: cannot {doing} ({type(exc).__name__}: {detail})"))


def _filesystem(url: str):
    """The fsspec filesystem of a URL's scheme, configured by the environment alone."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with s3fs
        raise RemoteError(f"{url}: object storage needs s3fs (pip install 'neva-pack[s3]')") from None
    try:
        return fsspec.filesystem(url.split("://", 1)[0])
    except ImportError:
        raise RemoteError(f"{url}: object storage needs s3fs (pip install 'neva-pack[s3]')") from None


def staging_root() -> Path:
    """$NEVA_PACK_STAGING_DIR, or <tmp>/neva_pack_staging: the same on every pod of one image, so a
    restarted pod stages to the same paths (a single run's resume fingerprint names the data copy's)."""
    return Path(os.environ.get(STAGING_VARIABLE) or Path(tempfile.gettempdir()) / "neva_pack_staging")


def remote_listing(url: str) -> dict[str, int]:
    """Every object under the prefix ``url``: its name relative to it -> its size (empty when none)."""
    fs = _filesystem(url)
    root = fs._strip_protocol(url).rstrip("/")
    try:
        fs.invalidate_cache()
        found = fs.find(root, detail=True, withdirs=False)
    except FileNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001 - botocore's and aiohttp's errors have no common base
        raise _failed(url, exc, "list") from None
    return {name[len(root) + 1 :]: int(info["size"]) for name, info in found.items() if name.startswith(root + "/")}


def _remote_info(url: str) -> dict | None:
    fs = _filesystem(url)
    try:
        fs.invalidate_cache()
        info = fs.info(url)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001
        raise _failed(url, exc, "read") from None
    return info


def local_copy(url: str, what: str) -> Path:
    """A remote input file copied into the staging directory (once: again only when the object
    changed). Its mtime is 0, whatever the object's: an upload of the same bytes changes the object's
    time, and a resume proves its input by content (the digest), so the path, size and mtime a run
    records are the same on every pod. ``what``: the flag, for the error of a missing object."""
    from neva_pack.core import ConfigError

    info = _remote_info(url)
    if info is None or info.get("type") == "directory":
        raise ConfigError(f"{what} {url}: no such object")
    version = str(info.get("ETag") or info.get("etag") or "").strip('"')
    target = staging_root() / "inputs" / _digest(url) / url.rstrip("/").rsplit("/", 1)[-1]
    stamp = target.with_name(target.name + ".etag")
    if target.is_file() and stamp.is_file() and stamp.read_text() == f"{version} {info['size']}":
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.part")
    _get(url, partial)
    os.utime(partial, (0, 0))
    os.replace(partial, target)
    stamp.write_text(f"{version} {info['size']}")
    return target


def _digest(text: str) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


def _get(url: str, path: Path) -> None:
    try:
        _filesystem(url).get_file(url, str(path))
    except Exception as exc:  # noqa: BLE001
        raise _failed(url, exc, "download") from None


def _get_many(urls: list[str], paths: list[Path]) -> None:
    """Downloads, sent together (s3fs runs them concurrently)."""
    if urls:
        try:
            _filesystem(urls[0]).get(urls, [str(path) for path in paths])
        except Exception as exc:  # noqa: BLE001
            raise _failed(urls[0].rsplit("/", 1)[0], exc, "download") from None


def _put_many(paths: list[Path], urls: list[str]) -> None:
    """Uploads, sent together (s3fs runs them concurrently); done when every one is."""
    if urls:
        try:
            _filesystem(urls[0]).put([str(path) for path in paths], urls)
        except Exception as exc:  # noqa: BLE001
            raise _failed(urls[0].rsplit("/", 1)[0], exc, "upload to") from None


def _delete(urls: list[str]) -> None:
    if urls:
        try:
            _filesystem(urls[0]).rm(urls)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            raise _failed(urls[0], exc, "delete") from None


@dataclass(slots=True)
class Mirrored:
    """What a local directory and its remote prefix held when last in step: name -> (size, mtime_ns)."""

    local: Path
    url: str
    synced: dict[str, tuple[int, int]] = field(default_factory=dict)


def pull(url: str, local: Path, skip: Callable[[str], bool] = lambda name: False) -> Mirrored:
    """The remote prefix copied into ``local``, emptied first: the bucket is the truth a restarted run
    continues from, whatever an earlier process left on this disk. ``skip``: names (relative, with
    slashes) not copied."""
    import shutil

    local = Path(local)
    if local.exists():
        shutil.rmtree(local)
    local.mkdir(parents=True)
    state = Mirrored(local=local, url=url)
    names = [name for name in sorted(remote_listing(url)) if not skip(name)]
    for name in names:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
    _get_many([url_join(url, name) for name in names], [local / name for name in names])
    for name in names:
        state.synced[name] = _stat(local / name)
    return state


def _stat(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def mirror(state: Mirrored, is_marker: Callable[[str], bool], *, under: str = "", delete: bool = True,
           skip: Callable[[str], bool] = lambda name: False) -> None:  # fmt: skip
    """Make the remote prefix hold what ``state.local`` holds (below ``under`` only), so that the
    remote output never looks more complete than it is:

    1. a remote marker (``is_marker``: a completion mark, e.g. a progress file or a meta) whose local
       file is gone is deleted, and so are the markers of a directory where a file is about to be
       replaced (an old mark never vouches for new bytes); a marker that only grew (a store's progress
       file after a commit: its segments' files are new names) is replaced in place, never absent;
    2. with ``delete``, remote files gone locally are deleted;
    3. new and changed files are uploaded, the markers last (an object's PUT is atomic).

    Files unchanged since the last pull or mirror (size and mtime) are not sent again. ``skip``:
    names never sent (a lock, a temporary name)."""
    local, url = state.local, state.url
    prefix = under.strip("/") + "/" if under else ""
    present = {}
    base = local / under if under else local
    if base.is_dir():
        for path in sorted(base.rglob("*")):
            name = path.relative_to(local).as_posix()
            if path.is_file() and not path.is_symlink() and not skip(name):
                present[name] = _stat(path)
    listed = remote_listing(url_join(url, under) if under else url)
    remote = {prefix + name: size for name, size in listed.items() if not skip(prefix + name)}
    changed = [name for name, stat in present.items() if state.synced.get(name) != stat or name not in remote]
    replaced_dirs = {_parent(name) for name in changed if name in remote and not is_marker(name)}
    stale_marks = [name for name in remote if is_marker(name) and (name not in present or _parent(name) in replaced_dirs)]
    _delete([url_join(url, name) for name in stale_marks])
    for name in stale_marks:
        state.synced.pop(name, None)
    if delete:
        gone = [name for name in remote if name not in present and not is_marker(name)]
        _delete([url_join(url, name) for name in gone])
        for name in gone:
            state.synced.pop(name, None)
    sending = changed + [name for name in stale_marks if name in present and name not in changed]
    for marks in (False, True):  # the files, all of them stored, then the markers that vouch for them
        names = [name for name in sending if is_marker(name) == marks]
        _put_many([local / name for name in names], [url_join(url, name) for name in names])
        for name in names:
            state.synced[name] = present[name]


def _parent(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else ""


class RemoteFiles:
    """Files under a remote prefix (or the members of a remote .tar, by byte range) read within a budget:
    what ``families.ImageSource`` reads an ``s3://`` image folder with. Picklable: each DataLoader
    worker opens its own connections."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def size(self, name: str | None = None) -> int | None:
        """The object's size (``name`` under the prefix, or the URL itself), None when there is none."""
        info = _remote_info(self.url if name is None else url_join(self.url, name))
        return None if info is None or info.get("type") == "directory" else int(info["size"])

    def has_objects(self) -> bool:
        """Whether the prefix holds any object (one listed is enough)."""
        fs = _filesystem(self.url)
        try:
            return bool(fs.ls(self.url, detail=False, refresh=True))
        except FileNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001
            raise _failed(self.url, exc, "list") from None

    def read(self, name: str | None, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (fewer at its end); FileNotFoundError when it is missing."""
        url = self.url if name is None else url_join(self.url, name)
        try:
            return _filesystem(url).cat_file(url, start=start, end=end)
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _failed(url, exc, "read") from None

    def open(self, name: str | None = None, block_size: int = 5 << 20):
        """The object as a seekable binary file (ranged reads of ``block_size``)."""
        url = self.url if name is None else url_join(self.url, name)
        try:
            return _filesystem(url).open(url, "rb", block_size=block_size)
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _failed(url, exc, "open") from None


@contextlib.contextmanager
def remote_copy(url: str, keep: Callable[[str], bool] = lambda name: True) -> Iterator[Path]:
    """A temporary local copy of the objects under ``url`` that ``keep`` (relative names) selects: what
    ``verify``, ``stats`` and ``shards status`` read an ``s3://`` output from. A prefix never
    completed has no meta in the bucket, so its copy has none either: it reads as incomplete."""
    with tempfile.TemporaryDirectory(prefix="neva_pack_remote_") as scratch:
        local = Path(scratch) / url.rstrip("/").rsplit("/", 1)[-1]
        pull(url, local, skip=lambda name: not keep(name))
        yield local
