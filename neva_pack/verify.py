"""verify: recompute checksums and check every invariant of a packed output.

Checked, for every pack (DESIGN.md):
- the checksum of every output file listed in the meta;
- 4 items per pack with modes (0, 0, 0, 1); as many packs as the meta says;
- every invariant of ``neva_pack.invariants`` (which the writer checked too, before writing):
  cu_seqlens, lengths, labels, alignment padding (pad id, ignored labels), whole image runs, as many
  runs as images;
- the image item holds whole (3, H, W) images; a pack without runs holds one zero image;
- the plan table agrees with cu_seqlens; with ``data_path``: every input record is packed
  exactly once or listed in skipped.jsonl, never both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack import invariants
from neva_pack import store as layout
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
    meta = layout.read_packed_meta(prefix)
    result = Verification()
    _verify_checksums(prefix, meta, result)
    try:
        reader = layout.PackedReader(prefix)
        plan = layout.read_plan_table(prefix)
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
    spec = pack_spec(meta)
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
        if last - first != layout.ITEMS_PER_PACK:
            result.add(f"{where}: {last - first} items, expected {layout.ITEMS_PER_PACK}")
            continue
        if tuple(int(m) for m in modes[first:last]) != layout.PACK_MODES:
            result.add(f"{where}: item modes {list(modes[first:last])}, expected {list(layout.PACK_MODES)}")
        cu = ds[first + layout.ITEM_CU_SEQLENS].astype(np.int64)
        tokens = ds[first + layout.ITEM_TOKENS].astype(np.int64)
        labels = ds[first + layout.ITEM_LABELS].astype(np.int64)
        image_values = int(lengths[first + layout.ITEM_IMAGE])
        if image_values % image_size or image_values == 0:
            result.add(f"{where}: image item of {image_values} values is not whole (3, H, W) images")
        held = image_values // image_size
        if held == 1 and invariants.image_runs(tokens, spec)[0] == 0 and not np.any(ds[first + layout.ITEM_IMAGE]):
            held = 0  # the zero image a pack without images carries
        planned = plan.get("padded_length", plan["length"])[offsets[p] : offsets[p + 1]]
        real = plan["length"][offsets[p] : offsets[p + 1]]
        if not np.array_equal(np.diff(cu), planned):
            result.add(f"{where}: sample lengths {np.diff(cu).tolist()} differ from the plan table {planned.tolist()}")
            real = None  # the plan cannot say where padding starts: check the pack on its own
        for problem in invariants.pack_problems(spec, cu, tokens, labels, held, real_lengths=real):
            result.add(f"{where}: {problem}")
        samples += max(len(cu) - 1, 0)
    result.checked["packs"] = num_packs
    result.checked["samples"] = samples


def pack_spec(meta: dict) -> invariants.PackSpec:
    """What the meta says every pack satisfies."""
    ids = meta.get("image_token_ids", {})
    return invariants.PackSpec(
        max_seq_length=int(meta["max_seq_length"]),
        ignore_index=int(meta.get("ignore_index", -1)),
        image_positions=int(meta.get("image_positions", 0)),
        patch_id=int(ids.get("patch", 0)),
        start_id=ids.get("start"),
        end_id=ids.get("end"),
        pad_id=int(meta.get("pad_id", 0)),
    )


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
