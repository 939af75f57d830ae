"""A lock object in a bucket: who runs an ``s3://`` output (or a shard's part of it), taken by a conditional write.

    s3://bucket/out/.neva_pack.lock                                   a single run, or the final step
    s3://bucket/out/packed_seq_dataset/part_00003_of_00008/.neva_pack.lock   shard 3 of 8

- Taken with an atomic create-if-absent (``PutObject`` with ``If-None-Match: *``): of two runs (two pods
  given the same index) exactly one creates it; the other reads it and is refused in one line naming
  the holder (pid, host, start time), as on a local disk.
- Refreshed while the run lives: a heartbeat every ``HEARTBEAT_S`` seconds rewrites it, conditionally on
  the ETag this run last wrote (``If-Match``).
- A holder is dead when its lock was not refreshed for ``LOCK_TIMEOUT_S`` seconds (the age is the
  storage's own clock: its ``Date`` against the object's ``Last-Modified``, so the pods' clocks do not
  matter), or at once when it names this host and pid namespace and a pid that is no longer running
  (containers sharing a host name but not their pids never judge each other's). A dead holder's lock
  is taken over by a write conditional on the ETag read: of two runs taking it over, one wins.
- A run whose lock was taken over (it stalled past the timeout) learns it at its next heartbeat, and
  ``check`` stops it before it sends anything more to the bucket.
- Released when the run ends (also on an error): deleted conditionally on its ETag, so a lock another
  run took over is never deleted. A killed run leaves it behind; it goes stale as above.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import os
import socket
import threading

from neva_pack.core import ConfigError
from neva_pack.files.paths import LOCK_FILE
from neva_pack.files.remote import _failed, _filesystem, url_join

__all__ = ["HEARTBEAT_S", "LOCK_TIMEOUT_S", "RemoteLock", "remote_lock_holder"]

LOCK_TIMEOUT_S = 60.0
"""Seconds without a heartbeat after which a lock's holder is taken as dead (its lock stale)."""
HEARTBEAT_S = 10.0
"""Seconds between the refreshes of a held lock."""
_TRIES = 8


class _Lost(Exception):
    """A conditional request's condition did not hold: another run wrote or deleted the lock first."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _describe(record: dict) -> str:
    """The holder as the local lock names it: "pid 12 on node3, started 2026-...Z"."""
    if not isinstance(record, dict):
        return "unknown"
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}, started {record.get('started', '?')}"


def _precondition(exc: BaseException) -> bool:
    """Whether a storage error is a failed condition (412), or a conflicting conditional write (409)."""
    if isinstance(exc, FileExistsError):  # s3fs's translation of a failed If-None-Match
        return True
    for error in (exc, exc.__cause__):
        response = getattr(error, "response", None) or {}
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return True
    return False


def _call(url: str, method: str, doing: str, **kwargs) -> dict:
    fs = _filesystem(url)
    bucket, key, _ = fs.split_path(url)
    try:
        return fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)
    except Exception as exc:  # noqa: BLE001 - botocore's and aiohttp's errors have no common base
        if _precondition(exc):
            raise _Lost() from None
        raise _failed(url, exc, doing) from None


def _put(url: str, record: dict, **condition) -> str:
    """The record written as the lock object (under ``condition``); its new ETag."""
    body = json.dumps(record, sort_keys=True).encode("utf-8")
    return _call(url, "put_object", "write", Body=body, ContentType="application/json", **condition)["ETag"]


def _read(url: str) -> tuple[dict, str, float] | None:
    """The lock object's record, ETag and age in seconds (the storage's clock); None when there is none."""
    from fsspec.asyn import sync

    fs = _filesystem(url)
    bucket, key, _ = fs.split_path(url)

    async def get():
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with response["Body"] as body:
            return response, await body.read(1 << 16)

    try:
        response, data = sync(fs.loop, get)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001
        raise _failed(url, exc, "read") from None
    try:
        record = json.loads(data)
    except ValueError:
        record = {}
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    try:
        now = email.utils.parsedate_to_datetime(headers["date"])
    except (KeyError, TypeError, ValueError):
        now = datetime.datetime.now(datetime.timezone.utc)
    modified = response.get("LastModified") or now
    return (record if isinstance(record, dict) else {}), response["ETag"], max(0.0, (now - modified).total_seconds())


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux), None where there is no telling."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _dead(record: dict, age: float) -> bool:
    """A holder not heard from for the timeout, or one on this host (and pid namespace) whose process is gone."""
    if age > LOCK_TIMEOUT_S:
        return True
    pid, namespace = record.get("pid"), _pid_namespace()
    if (record.get("host") != socket.gethostname() or namespace is None or record.get("pid_namespace") != namespace
            or not isinstance(pid, int) or pid == os.getpid()):  # fmt: skip
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's, alive
        return False
    return False


def remote_lock_holder(directory_url: str) -> str | None:
    """Who holds the lock of the output (or part) at ``directory_url``: "pid 12 on node3, started ...",
    or None when nobody does (no lock object, or a stale one: its holder is dead)."""
    found = _read(url_join(directory_url, LOCK_FILE))
    if found is None or _dead(found[0], found[2]):
        return None
    return _describe(found[0])


class RemoteLock:
    """The lock object of the output (or part) at ``directory_url``, held from ``acquire`` to ``release``
    and refreshed meanwhile. ``what``: how a refusal names the output ("--output_dir s3://...")."""

    def __init__(self, directory_url: str, what: str):
        self.url = url_join(directory_url, LOCK_FILE)
        self.what = what
        self._record = {"pid": os.getpid(), "host": socket.gethostname(), "pid_namespace": _pid_namespace(), "started": _now()}
        self._etag: str | None = None
        self._lost: str | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def acquire(self) -> "RemoteLock":
        for _ in range(_TRIES):
            record = {**self._record, "heartbeat": _now()}
            try:
                self._etag = _put(self.url, record, IfNoneMatch="*")
                break
            except _Lost:
                pass
            found = _read(self.url)
            if found is None:  # released between the two requests: create it again
                continue
            holder, etag, age = found
            if not _dead(holder, age):
                raise ConfigError(
                    f"{self.what}: in use by another neva-pack run ({_describe(holder)}, alive {age:.0f} s ago); "
                    f"wait for it to end or choose another (a dead holder's lock is taken over after {LOCK_TIMEOUT_S:.0f} s)"
                )
            try:
                self._etag = _put(self.url, record, IfMatch=etag)  # a dead holder's: taken over, once
                break
            except _Lost:
                continue
        else:
            raise ConfigError(f"{self.what}: its lock {self.url} changed hands {_TRIES} times while taken; run again")
        self._stop.clear()
        self._beating = threading.Thread(target=self._beat, name="neva-pack-lock-heartbeat", daemon=True)
        self._beating.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._guard:
                if self._etag is None:
                    return
                try:
                    self._etag = _put(self.url, {**self._record, "heartbeat": _now()}, IfMatch=self._etag)
                except _Lost:
                    found = _read(self.url)
                    holder = _describe(found[0]) if found else "nobody"
                    self._lost = f"{self.what}: this run's lock was taken over ({holder} holds it now) after no heartbeat for {LOCK_TIMEOUT_S:.0f} s; stopped"
                    self._etag = None
                    return
                except OSError:  # a storage hiccup: the next beat tries again, within the timeout
                    continue

    def check(self) -> None:
        """ConfigError when another run took the lock over: this one must not write any more."""
        if self._lost:
            raise ConfigError(self._lost)

    def release(self) -> None:
        """Stop the heartbeat and delete the lock, unless another run took it over (its ETag changed)."""
        self._stop.set()
        if self._beating is not None:
            self._beating.join()
            self._beating = None
        with self._guard:
            etag, self._etag = self._etag, None
        if etag is None:
            return
        try:
            _call(self.url, "delete_object", "delete", IfMatch=etag)
        except (_Lost, OSError):  # taken over meanwhile, or unreachable: it goes stale
            pass

    def __enter__(self) -> "RemoteLock":
        return self if self._etag is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
