"""The skip lists: the run's (every record skipped while encoding, in record order) and each pack
size's (the run's plus its own: the samples its cut leaves without a trained label, and those over a
visual budget on their own)."""

from __future__ import annotations

import heapq
import json
import os
import shutil
from pathlib import Path

import numpy as np

from neva_pack.files import paths
from neva_pack.core import InputError

__all__ = ["size_skip_details", "too_many_skipped", "top_reasons", "write_run_skipped", "write_size_skipped"]


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
    """The one line a run stops with past --max_skip_fraction: the counts, and the commonest reasons with
    their counts and the first record's detail (read back from the skip list just written), so that the
    cause shows without opening the file: "16 missing_image (coco/1.jpg: ...)"."""
    target = output_dir / paths.SKIPPED_FILE
    return InputError(
        f"{skipped} of {of_records} records were skipped (> --max_skip_fraction {max_skip_fraction}): "
        f"{top_reasons(target)}; every one in {target}"
    )


def top_reasons(skipped_file: Path, most: int = 3) -> str:
    """"16 missing_image (first: <its detail>), 2 unreadable_image (first: ...)": the ``most`` commonest
    reasons of a skip list, each with the detail of its first record."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    with open(skipped_file, encoding="utf-8") as f:
        for line in f:
            entry = json.loads(line)
            reason = entry["reason"]
            counts[reason] = counts.get(reason, 0) + 1
            first.setdefault(reason, str(entry.get("detail", "")))
    ranked = sorted(counts, key=lambda reason: (-counts[reason], reason))[:most]
    more = len(counts) - len(ranked)
    parts = [f"{counts[reason]} {reason} (first: {first[reason][:120]})" for reason in ranked]
    return ", ".join(parts) + (f", and {more} other reason(s)" if more > 0 else "")


def size_skip_details(
    size: int, max_images_per_pack: int | None = None, max_image_tokens_per_pack: int | None = None,
    max_video_tokens_per_pack: int | None = None,
) -> dict[str, str]:  # fmt: skip
    """The detail line of each reason a pack size skips samples for on its own."""
    budgets = " and ".join(
        f"{flag} {value}" for flag, value in (("--max_images_per_pack", max_images_per_pack),
                                              ("--max_image_tokens_per_pack", max_image_tokens_per_pack),
                                              ("--max_video_tokens_per_pack", max_video_tokens_per_pack))
        if value is not None
    )  # fmt: skip
    return {
        "no_supervised_tokens": f"no trained label after truncation to pack size {size}",
        "over_image_budget": f"more images, image tokens or video tokens than {budgets} allow in a pack (at pack size {size})",
    }


def write_size_skipped(
    run_file: Path, target: Path, records: dict[str, np.ndarray], ids: dict[int, str | None], details: dict[str, str]
) -> None:
    """One prefix's skipped list (atomically): the run's lines and this size's own (reason -> the
    ``records`` it skips for it; ``ids``: their ids; ``details``: the line of each reason), by record
    index. Without own skips at the run's own size (a single-size run), the run's list is already it."""
    if target == run_file and not any(len(values) for values in records.values()):
        return
    skips = (
        {"index": int(index), "id": ids.get(int(index)), "reason": reason, "detail": details[reason]}
        for reason, values in records.items()
        for index in values
    )
    own = sorted(((skip["index"], json.dumps(skip) + "\n") for skip in skips), key=lambda pair: pair[0])
    tmp = target.with_name(target.name + ".tmp")
    with open(run_file, encoding="utf-8") as run, open(tmp, "w", encoding="utf-8") as out:
        lines = ((json.loads(line)["index"], line) for line in run if line.strip())
        for _, line in heapq.merge(lines, own, key=lambda pair: pair[0]):
            out.write(line)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(target)
