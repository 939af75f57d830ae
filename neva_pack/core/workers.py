"""DataLoader workers that behave: they leave Ctrl-C to the main process, die with it however it
dies, and are killed at once when a run stops early. ``worker_messages`` is how the encoding
workers (``pipeline/encode.py``) and the pack-assembling workers (``parallel_assembly``) are run."""

from __future__ import annotations

import os
import signal
import sys
from typing import Iterator

__all__ = ["passthrough", "stop_workers", "worker_init", "worker_messages"]

_PR_SET_PDEATHSIG = 1


def worker_init(_worker_id: int) -> None:
    """A DataLoader worker leaves Ctrl-C to the main process (which shuts it down cleanly), dies
    quietly on SIGTERM (not through the main process's handler, inherited by fork) and, on Linux,
    is killed when the main process dies however it dies (even SIGKILL): no orphans."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the main process died before prctl took effect
            os._exit(1)


def stop_workers(items) -> None:
    """Kill the DataLoader's workers at once when the run stops early (Ctrl-C, SIGTERM, an error):
    they hold nothing durable, and torch's own shutdown waits up to 5 s for each busy one. They
    are first taken off torch's SIGCHLD watch list, or their death would raise in the main process."""
    workers = [worker for worker in getattr(items, "_workers", ()) if worker.is_alive()]
    if getattr(items, "_worker_pids_set", False):
        from torch.utils.data import _utils

        _utils.signal_handling._remove_worker_pids(id(items))
        items._worker_pids_set = False
    for worker in workers:
        worker.kill()


def passthrough(item):
    """DataLoader collate that leaves a worker's message as it is (no tensor conversion)."""
    return item


def worker_messages(dataset, workers: int, in_flight: int) -> Iterator:
    """The messages of an IterableDataset from ``workers`` DataLoader workers (in this process
    with 0), in the order the DataLoader takes them, each worker ``in_flight`` messages ahead.
    Closing the generator early (``close()``, in the caller's ``finally``) kills the workers at once."""
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset, batch_size=None, num_workers=workers, collate_fn=passthrough,
        prefetch_factor=in_flight if workers else None, worker_init_fn=worker_init,
    )  # fmt: skip
    items = iter(loader)
    try:
        yield from items
    except BaseException:  # an error, Ctrl-C, or the caller closing this generator early
        stop_workers(items)
        raise
