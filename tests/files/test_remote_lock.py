"""The lock object of an s3:// output, on a real S3-protocol server (moto's, on loopback; s3fs talks HTTP
to it): taken by a conditional create, refused to a second holder in one line naming the first, refreshed
by a heartbeat, taken over once stale (by an ETag-conditional write), and released only by its holder."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from neva_pack.core import ConfigError
from neva_pack.files import LOCK_FILE, RemoteLock, remote_lock_holder
from neva_pack.files import remote_lock as remote_lock_module
from tests.object_storage import BUCKET, s3_server
from tests.shard_faults import ROOT

HOLD = """
import sys, time
from neva_pack.files import RemoteLock
RemoteLock(sys.argv[1], "--output_dir test").acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "staging") as server:
        yield server


def lock_record(server, url: str) -> dict:
    return json.loads(server.read(f"{url}/{LOCK_FILE}"))


def test_a_second_holder_is_refused_in_one_line_naming_the_first(server):
    url = f"s3://{BUCKET}/two_runs"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, url], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        name = f"pid {holder.pid} on {socket.gethostname()}, started "
        with pytest.raises(ConfigError, match=f"^--output_dir {url}: in use by another neva-pack run \\({name}") as refused:
            RemoteLock(url, f"--output_dir {url}").acquire()
        assert "\n" not in str(refused.value)
        assert remote_lock_holder(url).startswith(name)
    finally:
        holder.kill()
        holder.wait()
    taken = RemoteLock(url, "--output_dir test").acquire()  # its process is gone (this host): taken over at once
    assert lock_record(server, url)["pid"] == os.getpid()
    taken.release()
    assert remote_lock_holder(url) is None and not server.fs().exists(f"{BUCKET}/two_runs/{LOCK_FILE}")


def test_a_held_lock_is_refreshed_and_released(server, monkeypatch):
    monkeypatch.setattr(remote_lock_module, "HEARTBEAT_S", 0.2)
    url = f"s3://{BUCKET}/heartbeat"
    with RemoteLock(url, "--output_dir test"):
        first = lock_record(server, url)
        time.sleep(1.3)  # the storage's Last-Modified has one-second steps
        refreshed = lock_record(server, url)
        assert refreshed["started"] == first["started"] and refreshed["heartbeat"] > first["heartbeat"]
        assert remote_lock_holder(url) == f"pid {os.getpid()} on {socket.gethostname()}, started {first['started']}"
    assert remote_lock_holder(url) is None


def test_a_stale_lock_is_taken_over_and_its_old_holder_stops(server, monkeypatch):
    url = f"s3://{BUCKET}/stale"
    key = f"{BUCKET}/stale/{LOCK_FILE}"
    gone = {"pid": 4242, "host": "pod-7", "started": "2026-01-01T00:00:00Z", "heartbeat": "2026-01-01T00:00:00Z"}
    server.fs().pipe(key, json.dumps(gone).encode())
    with pytest.raises(ConfigError, match=r"in use by another neva-pack run \(pid 4242 on pod-7, started 2026-01-01"):
        RemoteLock(url, "--output_dir test").acquire()  # another host's: alive until the timeout
    other_container = {**gone, "host": socket.gethostname(), "pid": 2**22 + 1, "pid_namespace": "pid:[1]"}
    server.fs().pipe(key, json.dumps(other_container).encode())  # this host's name, another pid namespace
    with pytest.raises(ConfigError, match=f"in use by another neva-pack run \\(pid {2**22 + 1} on "):
        RemoteLock(url, "--output_dir test").acquire()  # its pid is not this container's to judge
    server.fs().pipe(key, json.dumps(gone).encode())
    monkeypatch.setattr(remote_lock_module, "LOCK_TIMEOUT_S", 1.0)
    time.sleep(2.1)
    assert remote_lock_holder(url) is None  # stale: nobody holds it
    monkeypatch.setattr(remote_lock_module, "HEARTBEAT_S", 0.2)
    lock = RemoteLock(url, "--output_dir test").acquire()
    assert lock_record(server, url)["pid"] == os.getpid()
    server.fs().pipe(key, json.dumps({**gone, "host": "pod-8"}).encode())  # another run took it over meanwhile
    time.sleep(0.8)
    with pytest.raises(ConfigError, match=r"this run's lock was taken over \(pid 4242 on pod-8"):
        lock.check()
    lock.release()
    assert lock_record(server, url)["host"] == "pod-8"  # never deleted by the run that lost it
