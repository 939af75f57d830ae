"""verify: recompute checksums and check every invariant of a packed output.

Checked, for every pack (DESIGN.md):
- the checksum of every output file listed in the meta;
- 4 items per pack with modes (0, 0, 0, 1); as many packs as the meta says;
- cu_seqlens strictly increasing from 0 to len(tokens); len(tokens) == len(labels) <= max_seq_length;
- the image item holds whole (3, H, W) images, one per image run in the tokens (runs are found
  by the image start id, or as runs of patch ids); a pack without runs holds one zero image;
- labels are the next token or the ignore value inside each sample, never across samples;
- the plan table agrees with cu_seqlens; with ``data_path``: every input record is packed
  exactly once or listed in skipped.jsonl, never both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack import store as layout
from neva_pack.formats import nemo
from neva_pack.errors import InputError

MAX_REPORTED = 20
"""Problems listed one by one; beyond this only their number is kept."""


@dataclass
class Verification:
    problems: list[str] = field(default_factory=list)
    """What is wrong, one line each (at most MAX_REPORTED; see ``problem_count``)."""
    problem_count: int = 0
    """Number of problems found."""
    checked: dict = field(default_factory=dict)
    """What was checked: packs, samples, files, records."""

    def add(self, problem: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_REPORTED:
            self.problems.append(problem)

    @property
    def ok(self) -> bool:
        return self.problem_count == 0


def resolve_prefix(path: Path) -> Path:
    """An output directory or a prefix -> the prefix."""
    path = Path(path)
    if path.is_dir() and layout.meta_path(layout.packed_prefix(path)).is_file():
        return layout.packed_prefix(path)
    if layout.meta_path(path).is_file():
        return path
    raise InputError(f"{path}: no {layout.PACKED_NAME}{layout.META_SUFFIX} here (not a complete neva_pack output)")


def verify(path: Path, data_path: Path | None = None, progress: bool = True) -> Verification:
    prefix = resolve_prefix(path)
    meta = nemo.read_packed_meta(prefix)
    result = Verification()
    _verify_checksums(prefix, meta, result)
    try:
        reader = nemo.PackedReader(prefix)
        plan = nemo.read_plan_table(prefix)
    except Exception as exc:  # a corrupt index makes Megatron/numpy fail in many ways: report, don't crash
        result.add(f"cannot read the packed dataset: {exc.__class__.__name__}: {exc}")
        return result
    _verify_packs(reader, meta, plan, result, progress)
    if data_path is not None:
        _verify_accounting(prefix, plan, Path(data_path), result)
    return result


def _verify_checksums(prefix: Path, meta: dict, result: Verification) -> None:
    files = meta.get("checksums", {}).get("files", {})
    if not files:
        result.add("the meta lists no checksums")
    for name, expected in files.items():
        path = prefix.parent / name
        if not path.is_file():
            result.add(f"{name}: missing")
        elif layout.file_checksum(path) != expected:
            result.add(f"{name}: checksum mismatch (the file was changed or corrupted)")
    result.checked["files"] = sorted(files)


def _verify_packs(reader, meta: dict, plan: dict, result: Verification, progress: bool) -> None:
    ds = reader.dataset
    image_size = int(np.prod(reader.image_shape))
    max_len = int(meta["max_seq_length"])
    ignore = int(meta.get("ignore_index", -1))
    ids = meta.get("image_token_ids", {})
    positions = int(meta.get("image_positions", 0))
    modes = reader.item_modes()
    lengths = ds.index.sequence_lengths
    offsets = plan["offsets"]
    num_packs = len(reader)
    if num_packs != meta["num_packs"]:
        result.add(f"{num_packs} packs in the index, the meta says {meta['num_packs']}")
    if len(offsets) != num_packs + 1:
        result.add(f"the plan table has {len(offsets) - 1} packs, the index {num_packs}")
        return
    samples = 0
    for p in tqdm(range(num_packs), desc="verify packs", unit="pack", disable=not progress):
        first, last = reader.items_of(p)
        where = f"pack {p}"
        if last - first != nemo.ITEMS_PER_PACK:
            result.add(f"{where}: {last - first} items, expected {nemo.ITEMS_PER_PACK}")
            continue
        if tuple(int(m) for m in modes[first:last]) != nemo.PACK_MODES:
            result.add(f"{where}: item modes {list(modes[first:last])}, expected {list(nemo.PACK_MODES)}")
        cu = ds[first + nemo.ITEM_CU_SEQLENS].astype(np.int64)
        tokens = ds[first + nemo.ITEM_TOKENS].astype(np.int64)
        labels = ds[first + nemo.ITEM_LABELS].astype(np.int64)
        if len(tokens) != len(labels) or len(tokens) > max_len:
            result.add(f"{where}: {len(tokens)} tokens, {len(labels)} labels, max_seq_length {max_len}")
            continue
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != len(tokens) or np.any(np.diff(cu) <= 0):
            result.add(f"{where}: cu_seqlens {cu[:8].tolist()}... not strictly increasing from 0 to {len(tokens)}")
            continue
        planned = plan["length"][offsets[p] : offsets[p + 1]]
        if not np.array_equal(np.diff(cu), planned):
            result.add(f"{where}: sample lengths {np.diff(cu).tolist()} differ from the plan table {planned.tolist()}")
        samples += len(cu) - 1
        _check_labels(where, tokens, labels, cu, ignore, result)
        image_values = int(lengths[first + nemo.ITEM_IMAGE])
        runs = _image_runs(tokens, ids, positions)
        if image_values % image_size or image_values == 0:
            result.add(f"{where}: image item of {image_values} values is not whole (3, H, W) images")
        elif runs == 0:
            if image_values != image_size or np.any(ds[first + nemo.ITEM_IMAGE]):
                result.add(f"{where}: no image run, so one zero image was expected")
        elif image_values // image_size != runs:
            result.add(f"{where}: {image_values // image_size} images for {runs} image runs")
    result.checked["packs"] = num_packs
    result.checked["samples"] = samples


def _check_labels(where: str, tokens, labels, cu, ignore: int, result: Verification) -> None:
    inner = np.ones(len(tokens), dtype=bool)
    inner[cu[1:] - 1] = False  # a sample's last label is its next id, which no pack holds
    following = np.append(tokens[1:], 0)
    bad = inner & (labels != ignore) & (labels != following)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        result.add(f"{where}: label at position {at} is {labels[at]}, neither the next token nor {ignore}")


def _image_runs(tokens: np.ndarray, ids: dict, positions: int) -> int:
    start = ids.get("start")
    if start is not None:
        return int(np.count_nonzero(tokens == start))
    if positions <= 0:
        return 0
    is_patch = np.concatenate([[False], tokens == ids.get("patch", 0), [False]])
    edges = np.flatnonzero(np.diff(is_patch.astype(np.int8)))
    run_lengths = edges[1::2] - edges[::2]
    whole = run_lengths[run_lengths % positions == 0]
    return int((whole // positions).sum())


def _verify_accounting(prefix: Path, plan: dict, data_path: Path, result: Verification) -> None:
    from neva_pack.records import count_records

    total = count_records(data_path)
    packed = plan["record_index"].astype(np.int64)
    skipped_path = prefix.parent / layout.SKIPPED_FILE
    skipped = []
    if skipped_path.is_file():
        with open(skipped_path, encoding="utf-8") as f:
            skipped = [json.loads(line)["index"] for line in f if line.strip()]
    seen = np.zeros(total, dtype=np.int64)
    out_of_range = [int(i) for i in packed if not 0 <= i < total] + [i for i in skipped if not 0 <= i < total]
    if out_of_range:
        result.add(f"record indices outside the input's {total} records: {out_of_range[:5]}")
    np.add.at(seen, packed[(packed >= 0) & (packed < total)], 1)
    np.add.at(seen, np.asarray([i for i in skipped if 0 <= i < total], dtype=np.int64), 1)
    missing = np.flatnonzero(seen == 0)
    twice = np.flatnonzero(seen > 1)
    if len(missing):
        result.add(f"{len(missing)} input record(s) neither packed nor skipped (first: {missing[:5].tolist()})")
    if len(twice):
        result.add(f"{len(twice)} input record(s) packed or skipped more than once (first: {twice[:5].tolist()})")
    result.checked["records"] = total
