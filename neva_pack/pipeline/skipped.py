"""The skip lists: the run's (every record skipped while encoding, in record order) and each pack
size's (the run's plus the samples its cut leaves without a trained label)."""

from __future__ import annotations

import heapq
import json
import os
import shutil
from pathlib import Path

import numpy as np

from neva_pack import paths
from neva_pack.errors import InputError

__all__ = ["too_many_skipped", "write_run_skipped", "write_size_skipped"]


def write_run_skipped(segment_files: list[Path], output_dir: Path) -> None:
    """Concatenate the store segments' skipped lines into the run's skipped.jsonl (atomically)."""
    target = output_dir / paths.SKIPPED_FILE
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        for segment in segment_files:
            with open(segment, "rb") as f:
                shutil.copyfileobj(f, out)
    tmp.replace(target)


def too_many_skipped(max_skip_fraction: float, skipped: int, of_records: str, output_dir: Path) -> InputError:
    return InputError(
        f"{skipped} of {of_records} records were skipped (> --max_skip_fraction {max_skip_fraction}); "
        f"reasons in {output_dir / paths.SKIPPED_FILE}"
    )


def write_size_skipped(run_file: Path, target: Path, records: np.ndarray, ids: dict[int, str | None], size: int) -> None:
    """One prefix's skipped list (atomically): the run's lines and this size's own (the
    ``records``, increasing, that its cut leaves without a trained label; ``ids``: their ids),
    by record index. Without own skips at the run's own size (a single-size run), the run's list
    is already it."""
    if target == run_file and len(records) == 0:
        return
    detail = f"no trained label after truncation to pack size {size}"
    skips = (
        {"index": int(index), "id": ids.get(int(index)), "reason": "no_supervised_tokens", "detail": detail}
        for index in records
    )
    own = [(skip["index"], json.dumps(skip) + "\n") for skip in skips]
    tmp = target.with_name(target.name + ".tmp")
    with open(run_file, encoding="utf-8") as run, open(tmp, "w", encoding="utf-8") as out:
        lines = ((json.loads(line)["index"], line) for line in run if line.strip())
        for _, line in heapq.merge(lines, own, key=lambda pair: pair[0]):
            out.write(line)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(target)
