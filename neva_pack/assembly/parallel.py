"""Packs assembled, checked and prepared for their format in DataLoader workers, handed to the
writer in plan order.

Assembling a pack (its samples' text read back from the store, ids and labels rebuilt, padding),
checking it against the pack invariants and turning it into the format's bytes (``fmt.prepare``:
float32 items for nemo, the elided ids and index entries for compact) is the write stage's
per-pack work. Here workers forked from the main process (the store inherited, read with pread)
take consecutive ranges of packs in turn, and the DataLoader takes one message from each worker
in turn, so the packs arrive in plan order whatever the number of workers::

    packs     0..31   32..63   64..95  ...
    worker      0        1        0    ...     (2 workers, PACKS_PER_MESSAGE 32)

A message is one ``PackBatch``: a few arrays for its 32 packs, not 32 packs of a dozen arrays
each, so that the main process's share (unpickling, then the writes) stays small beside the
workers'. Pixels are not sent between processes: the main process reads a pack's images from the
pool itself (one read, as before), so a message stays a few hundred KB of ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from neva_pack.packing import PackingPlan, fast_pack_problems, invariants, padded_view
from neva_pack.assembly.assemble import AssembledPack, assemble_packs
from neva_pack.core import worker_messages

PACKS_PER_MESSAGE = 32
"""Packs a worker assembles and sends as one message (a text-only pack of 4K positions is ~64 KB)."""
MESSAGES_IN_FLIGHT = 2
"""Messages each worker may have queued ahead."""
MIN_PACKS_PER_WORKER = 4 * PACKS_PER_MESSAGE
"""Below this many packs a worker, the packs are assembled in the main process: starting workers
is a fixed cost that a small plan does not earn back."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackBatch:
    """Consecutive packs of the plan, checked and prepared for the writer (``fmt.prepare``)."""

    start: int
    """Plan index of the first pack."""
    problems: list[str | None]
    """Per pack, the first thing wrong with it, or None."""
    image_indices: list[np.ndarray]
    """Per pack, the pool index of each of its images (what the writer's pixels are read from)."""
    prepared: object
    """The format's ``PreparedPacks`` of the packs (None when one of them has a problem)."""

    def __len__(self) -> int:
        return len(self.problems)


def pack_problem(pack: AssembledPack, checks: invariants.PackSpec) -> str | None:
    """The first problem of an assembled pack, as the writer would write it, or None."""
    tokens, labels = padded_view(pack, checks.pad_id, checks.ignore_index)
    cu_seqlens = np.concatenate([[0], np.cumsum(pack.padded_lengths)])
    problems = fast_pack_problems(checks, cu_seqlens, tokens, labels, len(pack.image_indices), real_lengths=pack.lengths,
                                  image_lengths=pack.image_lengths, whole_runs=pack.whole_runs)
    return problems[0] if problems else None


@dataclass(frozen=True, slots=True, kw_only=True)
class PackJob:
    """What assembling packs needs, the same in every worker."""

    store: object
    """The sample store (sample_store.SampleStore)."""
    plan: PackingPlan
    cuts: dict[int, tuple[int, int]]
    pad_to_multiple_of: int
    checks: invariants.PackSpec
    prepare: Callable[[list[AssembledPack]], object]
    """The output format's ``prepare`` for this run's WriteSpec (pure: runs in the workers)."""

    def batch(self, start: int, stop: int) -> PackBatch:
        """Packs [start, stop) assembled, checked and prepared (not prepared when one has a
        problem: the run stops there). Their pixels are left to the writer's process."""
        packs = list(assemble_packs(
            self.store, self.plan, self.cuts, pad_to_multiple_of=self.pad_to_multiple_of, start=start, stop=stop,
            with_pixels=False, pad_id=self.checks.pad_id, ignore_index=self.checks.ignore_index,
        ))  # fmt: skip
        problems = [pack_problem(pack, self.checks) for pack in packs]
        return PackBatch(
            start=start,
            problems=problems,
            image_indices=[pack.image_indices for pack in packs],
            prepared=None if any(problems) else self.prepare(packs),
        )


class PackStream(IterableDataset):
    """Packs [start, stop) as PackBatches: consecutive ranges of ``per_message`` packs, range k
    to worker k mod W."""

    def __init__(self, job: PackJob, start: int, stop: int, per_message: int):
        self.job, self.start, self.stop, self.per_message = job, start, stop, per_message

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for first in range(self.start + worker * self.per_message, self.stop, workers * self.per_message):
            yield self.job.batch(first, min(first + self.per_message, self.stop))


def pack_batches(job: PackJob, *, start: int = 0, workers: int) -> Iterator[PackBatch]:
    """Packs ``start``.. of the job's plan, checked and prepared, in plan order, PACKS_PER_MESSAGE
    at a time: by ``workers`` DataLoader workers (in this process with 0, or when there are too
    few packs for them)."""
    stop = job.plan.num_bins
    stream = PackStream(job, start, stop, PACKS_PER_MESSAGE)
    if workers == 0 or stop - start < workers * MIN_PACKS_PER_WORKER:
        yield from stream  # iterated here, outside any worker: every range, in order
        return
    messages = worker_messages(stream, workers, MESSAGES_IN_FLIGHT)
    try:
        yield from messages
    finally:  # this generator closed early (an error, Ctrl-C): the workers are killed at once
        messages.close()
