"""verify: recompute checksums and check every invariant of a packed output.

Checked, for every prefix of the output (each --pack_sizes size) and every pack (DESIGN.md):
- the meta's own checksum, and the checksum of every output file it lists;
- the format's own structure (its module's ``check``: NeMo's 4 items with modes (0, 0, 0, 1),
  the compact index against its files and pool); as many packs as the meta says;
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
from neva_pack.errors import InputError
from neva_pack.formats import format_module, resolve_prefixes
from neva_pack.formats.meta import PackedMeta, meta_checksum_ok, read_meta_json

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
    """An output directory or a prefix -> the prefix (the largest size of a --pack_sizes output)."""
    return max(resolve_prefixes(path), key=lambda p: layout.pack_size_of(p) or 0)


def verify(path: Path, data_path: Path | None = None, progress: bool = True) -> Verification:
    """Every prefix of an output directory (each --pack_sizes size), or one prefix."""
    prefixes = resolve_prefixes(path)
    result = Verification()
    for prefix in prefixes:
        label = f"{prefix.name}: " if len(prefixes) > 1 else ""
        _verify_prefix(prefix, data_path, progress, result, label)
    if len(prefixes) > 1:
        result.checked["prefixes"] = len(prefixes)
    return result


class _Labelled:
    """Prefixes the problems of one prefix of a multi-size output with its name."""

    def __init__(self, result: Verification, label: str):
        self.result, self.label, self.checked = result, label, result.checked

    def add(self, problem: str) -> None:
        self.result.add(self.label + problem)


def _verify_prefix(prefix: Path, data_path, progress: bool, result: Verification, label: str) -> None:
    out = _Labelled(result, label)
    try:
        raw = read_meta_json(layout.meta_path(prefix))
    except InputError as exc:
        out.add(str(exc))
        return
    if not meta_checksum_ok(raw):
        out.add(f"{layout.meta_path(prefix).name}: its own checksum does not match (the meta was changed or corrupted)")
    try:
        meta = PackedMeta.from_json(raw, where=layout.meta_path(prefix).name)
        fmt = format_module(meta.format)
    except InputError as exc:
        out.add(str(exc))
        return
    _verify_checksums(prefix, meta, out)
    try:
        reader = fmt.Reader(prefix, meta)
        plan = reader.plan_table()
    except Exception as exc:  # a corrupt file makes Megatron/numpy fail in many ways: report, don't crash
        out.add(f"cannot read the packed dataset: {exc.__class__.__name__}: {exc}")
        return
    try:
        fmt.check(reader, out)
        _verify_packs(reader, meta, plan, out, progress)
    except Exception as exc:  # noqa: BLE001 - same reason: a corrupt output must give a report
        out.add(f"cannot read the packed dataset: {exc.__class__.__name__}: {exc}")
        return
    finally:
        reader.close()
    if data_path is not None:
        _verify_accounting(prefix, plan, Path(data_path), out)


def _verify_checksums(prefix: Path, meta: PackedMeta, result) -> None:
    files = meta.checksums
    if not files:
        result.add("the meta lists no checksums")
    for name, expected in files.items():
        path = prefix.parent / name
        if not path.is_file():
            result.add(f"{name}: missing")
        elif layout.file_checksum(path) != expected:
            result.add(f"{name}: checksum mismatch (the file was changed or corrupted)")
    result.checked["files"] = sorted(set(result.checked.get("files", [])) | set(files))


def _verify_packs(reader, meta: PackedMeta, plan, result, progress: bool) -> None:
    max_len = int(meta.max_seq_length)
    ignore = int(meta.ignore_index)
    ids = meta.image_token_ids
    positions = int(meta.image_positions)
    offsets = plan.offsets
    num_packs = len(reader)
    if num_packs != meta.num_packs:
        result.add(f"{num_packs} packs in the output, the meta says {meta.num_packs}")
    if len(offsets) != num_packs + 1:
        result.add(f"the plan table has {len(offsets) - 1} packs, the output {num_packs}")
        return
    samples = 0
    for p in tqdm(range(num_packs), desc="verify packs", unit="pack", disable=not progress):
        where = f"pack {p}"
        pack = reader.pack(p, images=False)
        cu, tokens, labels = pack.cu_seqlens, pack.tokens, pack.labels
        if len(tokens) != len(labels) or len(tokens) > max_len:
            result.add(f"{where}: {len(tokens)} tokens, {len(labels)} labels, max_seq_length {max_len}")
            continue
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != len(tokens) or np.any(np.diff(cu) <= 0):
            result.add(f"{where}: cu_seqlens {cu[:8].tolist()}... not strictly increasing from 0 to {len(tokens)}")
            continue
        planned = plan.padded_length[offsets[p] : offsets[p + 1]]
        real = plan.length[offsets[p] : offsets[p + 1]]
        if not np.array_equal(np.diff(cu), planned) or not np.array_equal(np.diff(pack.cu_seqlens_unpadded), real):
            result.add(f"{where}: sample lengths {np.diff(cu).tolist()} differ from the plan table {planned.tolist()}")
            continue
        samples += len(cu) - 1
        _check_labels(where, tokens, labels, cu, real, ignore, meta.pad_id, result)
        runs = _image_runs(tokens, {"patch": ids.patch, "start": ids.start, "end": ids.end}, positions)
        expected = int(plan.num_images[offsets[p] : offsets[p + 1]].sum())
        if pack.num_images != runs or runs != expected:
            result.add(f"{where}: {pack.num_images} images for {runs} image runs (plan table: {expected})")
    result.checked["packs"] = result.checked.get("packs", 0) + num_packs
    result.checked["samples"] = result.checked.get("samples", 0) + samples


def _check_labels(where: str, tokens, labels, cu, real, ignore: int, pad_id: int, result) -> None:
    """Inside a sample: the next token or the ignore value; on its padding: pad id and the ignore value."""
    inner = np.ones(len(tokens), dtype=bool)
    inner[cu[:-1] + real - 1] = False  # a sample's last label is its next id, which no pack holds
    padding = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.add.at(padding, cu[:-1] + real, 1)
    np.add.at(padding, cu[1:], -1)
    padding = np.cumsum(padding[:-1]) > 0
    inner &= ~padding
    following = np.append(tokens[1:], 0)
    bad = inner & (labels != ignore) & (labels != following)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        result.add(f"{where}: label at position {at} is {labels[at]}, neither the next token nor {ignore}")
    if padding.any() and (np.any(tokens[padding] != pad_id) or np.any(labels[padding] != ignore)):
        result.add(f"{where}: padding positions hold other than pad id {pad_id} / label {ignore}")


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


def _verify_accounting(prefix: Path, plan, data_path: Path, result) -> None:
    from neva_pack.records import count_records

    total = count_records(data_path)
    packed = plan.record_index.astype(np.int64)
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
