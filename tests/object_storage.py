"""A real S3-protocol server on loopback for the object storage tests: moto's server (``moto_server``,
from PyPI) in a process of its own on 127.0.0.1, and the environment a run reads its credentials and
endpoint from (never a flag). Nothing mocks the client: s3fs talks HTTP to the server.

    with s3_server(staging) as server:     # AWS_* and NEVA_PACK_STAGING_DIR set while it runs
        server.put_tree(folder, "bucket/images")
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SECRET = "neva-pack-test-secret-3f9c2a7e51"
"""The secret access key the server is reached with: no output of a run may show it."""
KEY_ID = "neva-pack-test-key"
BUCKET = "neva-bucket"


@dataclass(frozen=True)
class Server:
    endpoint: str
    environ: dict[str, str]
    """The variables a run needs (also set in this process while the server runs)."""

    def fs(self):
        import fsspec

        return fsspec.filesystem("s3")

    def put_tree(self, folder: Path, prefix: str) -> str:
        """Every file under ``folder`` uploaded under ``prefix`` (bucket/key...); returns its s3:// URL."""
        fs = self.fs()
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                fs.put_file(str(path), f"{prefix}/{path.relative_to(folder).as_posix()}")
        return f"s3://{prefix}"

    def put_file(self, path: Path, key: str) -> str:
        self.fs().put_file(str(path), key)
        return f"s3://{key}"

    def put_tar(self, folder: Path, key: str, scratch: Path) -> str:
        """``folder`` archived as a .tar (names relative to it) and uploaded as one object."""
        archive = scratch / "images.tar"
        with tarfile.open(archive, "w") as tar:
            for path in sorted(Path(folder).rglob("*")):
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
        return self.put_file(archive, key)

    def listing(self, prefix: str) -> dict[str, int]:
        """Objects under an s3:// prefix: relative name -> size."""
        from neva_pack.files import remote_listing

        return remote_listing(prefix)

    def read(self, url: str) -> bytes:
        fs = self.fs()
        fs.invalidate_cache()
        return fs.cat_file(url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(staging: Path):
    """moto's S3 server on a free loopback port, a bucket in it, and this process's environment set
    for it (credentials, endpoint, region, the staging directory) until the block ends."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    environ = {
        "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint, "NEVA_PACK_STAGING_DIR": str(staging), "NO_PROXY": "127.0.0.1",
    }  # fmt: skip
    saved = {name: os.environ.get(name) for name in environ}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        os.environ.update(environ)
        _forget_clients()  # a client made for another server (an earlier module's) is not reused
        server = Server(endpoint=endpoint, environ=environ)
        server.fs().mkdir(BUCKET)
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _forget_clients()
        process.terminate()
        process.wait(timeout=10)


def _forget_clients() -> None:
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
