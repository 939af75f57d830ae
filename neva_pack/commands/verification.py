"""verify: recompute checksums and check every invariant of a packed output.

Checked, for every prefix of the output (each --pack_sizes size) and every pack (DESIGN.md):
- the meta's own checksum, and the checksum of every output file it lists;
- the format's own structure (its ``check``, formats/base.py); as many packs as the meta says;
- every invariant of ``neva_pack.packing.invariants`` (which the writer checked too, before writing):
  cu_seqlens, lengths, labels, alignment padding (pad id, ignored labels), whole image runs, as many
  runs as images, the meta's visual budgets (images, image tokens, video tokens per pack);
- the plan table agrees with cu_seqlens; with ``data_path``: every input record is packed
  exactly once or listed in the prefix's skipped list (skipped.jsonl; skipped_<size>.jsonl for a
  prefix of a multi-size run), never both.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neva_pack.packing import fast_pack_problems, invariants
from neva_pack.files import file_checksum, paths
from neva_pack.core import InputError
from neva_pack.formats import (
    PackedMeta, checksum_problems, get_format, meta_checksum_ok, read_meta_json, resolve_prefixes
)
from neva_pack.commands.report import read_report

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
        raw = read_meta_json(paths.meta_path(prefix))
    except InputError as exc:
        out.add(str(exc))
        return
    if not meta_checksum_ok(raw):
        out.add(f"{paths.meta_path(prefix).name}: its own checksum does not match (the meta was changed or corrupted)")
    try:
        meta = PackedMeta.from_json(raw, where=paths.meta_path(prefix).name)
        fmt = get_format(meta.format)
    except InputError as exc:
        out.add(str(exc))
        return
    # the files are hashed in a thread (reading and xxh3 release the GIL; a .bin's holes, the zero
    # images of image-less packs, are hashed as zeros unread) while this one imports the reader's
    # Megatron-Core (seconds); then the format's structure (which reads what of those zero images
    # is not a hole: numpy releases the GIL too) is checked in a thread while this one checks
    # the packs. Problems keep their order: checksums, structure, packs
    threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="verify")
    try:
        checksums = {
            name: threads.submit(file_checksum, prefix.parent / name) if (prefix.parent / name).is_file() else None
            for name in meta.checksums
        }
        out.checked["files"] = sorted(set(out.checked.get("files", [])) | set(meta.checksums))
        found, plan = _verify_reader(prefix, meta, fmt, out, progress, threads)
        _verify_checksums(meta, checksums, out)
    finally:
        threads.shutdown(wait=True, cancel_futures=True)
    for problems in found:
        problems.replay(out)
    stats_file = paths.stats_path_of(prefix)
    report = None
    if stats_file.is_file():  # what stats and convert read of it must parse, whatever its checksum says
        try:
            report = read_report(stats_file)
        except InputError as exc:
            out.add(str(exc))
    if data_path is not None and report is not None and report.input_digest is not None:
        if file_checksum(Path(data_path)) != report.input_digest:
            out.add(f"stale: {data_path} changed since this output was packed from it (its content differs from "
                    f"the input digest in {stats_file.name}); pack it again with --overwrite")  # fmt: skip
    if data_path is not None and plan is not None:
        _verify_accounting(prefix, plan, Path(data_path), out)


class _Deferred:
    """Holds problems (their count, and the first MAX_REPORTED of them, which is all a Verification
    keeps) and what was checked, to be reported in order once the checks before them are done."""

    def __init__(self, out: _Labelled):
        self.problems: list[str] = []
        self.count = 0
        self.checked = dict(out.checked)

    def add(self, problem: str) -> None:
        self.count += 1
        if len(self.problems) < MAX_REPORTED:
            self.problems.append(problem)

    def replay(self, out: _Labelled) -> None:
        for problem in self.problems:
            out.add(problem)
        out.result.problem_count += self.count - len(self.problems)
        out.checked.update(self.checked)


def _unreadable(out: _Deferred, check, *args, **kwargs) -> bool:
    """Run ``check(*args, out, **kwargs)``; a corrupt file makes Megatron/numpy fail in many ways:
    report it (True), don't crash."""
    try:
        check(*args, out, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a corrupt output must give a report
        out.add(f"cannot read the packed dataset: {exc.__class__.__name__}: {exc}")
        return True
    return False


def _verify_reader(prefix: Path, meta: PackedMeta, fmt, out: _Labelled, progress: bool, threads):
    """The format's structure and every pack's invariants, read through the format's reader:
    (the problems found, to report in this order; the plan table, or None when the output cannot
    be read). What the pack checks found is dropped when the structure could not be read (it
    stops verify before the packs)."""
    opened = _Deferred(out)
    try:
        reader = fmt.reader(prefix, meta)
        plan = reader.plan_table()
    except InputError as exc:  # a file the reader refused, named
        opened.add(str(exc))
        return [opened], None
    except Exception as exc:  # a corrupt file makes Megatron/numpy fail in many ways: report, don't crash
        opened.add(f"cannot read the packed dataset: {exc.__class__.__name__}: {exc}")
        return [opened], None
    structure, packs = _Deferred(out), _Deferred(out)
    structure_failed = threads.submit(_unreadable, structure, fmt.check, reader)
    try:
        packs_failed = _unreadable(packs, verify_packs, reader, meta, plan, progress=progress)
        if structure_failed.result():
            return [structure], None
    finally:
        if not structure_failed.cancel():
            structure_failed.exception()  # the thread may still read through the reader: wait before closing it
        reader.close()
    return [structure, packs], None if packs_failed else plan


def _verify_checksums(meta: PackedMeta, checksums: dict, result) -> None:
    """``checksums``: file name -> the future of its checksum (None: the file is missing)."""
    if not meta.checksums:
        result.add("the meta lists no checksums")
    actual = {name: None if future is None else future.result() for name, future in checksums.items()}
    for problem in checksum_problems(meta.checksums, actual):
        result.add(problem)


def verify_packs(reader, meta: PackedMeta, plan, result, progress: bool) -> None:
    spec = pack_spec(meta)
    offsets = plan.offsets
    num_packs = len(reader)
    if num_packs != meta.num_packs:
        result.add(f"{num_packs} packs in the output, the meta says {meta.num_packs}")
    if len(offsets) != num_packs + 1:
        result.add(f"the plan table has {len(offsets) - 1} packs, the output {num_packs}")
        return
    samples = 0
    dynamic = meta.image_run.dynamic
    for p in tqdm(range(num_packs), desc="verify packs", unit="pack", disable=not progress):
        where = f"pack {p}"
        pack = reader.pack(p, images=dynamic)  # a dynamic image's record says its tokens (no pixel is decoded)
        cu, tokens, labels = pack.cu_seqlens, pack.tokens, pack.labels
        planned = plan.padded_length[offsets[p] : offsets[p + 1]]
        real = plan.length[offsets[p] : offsets[p + 1]]
        if not np.array_equal(np.diff(cu), planned) or not np.array_equal(np.diff(pack.cu_seqlens_unpadded), real):
            result.add(f"{where}: sample lengths {np.diff(cu).tolist()} differ from the plan table {planned.tolist()}")
            real = None  # the plan cannot say where padding starts: check the pack on its own
        whole = None if pack.stored_images is None else np.array([bool(image.frames) for image in pack.stored_images], dtype=bool)
        for problem in fast_pack_problems(spec, cu, tokens, labels, pack.num_images, real_lengths=real,
                                          image_lengths=pack.image_lengths, whole_runs=whole):  # fmt: skip
            result.add(f"{where}: {problem}")
        expected = int(plan.num_images[offsets[p] : offsets[p + 1]].sum())
        if pack.num_images != expected:
            result.add(f"{where}: {pack.num_images} images, the plan table says {expected}")
        elif pack.image_lengths is not None:
            for problem in _image_run_problems(pack, plan, offsets[p], offsets[p + 1], meta.image_run):
                result.add(f"{where}: {problem}")
        for problem in invariants.budget_problems(
            pack.num_images, pack.image_lengths, whole, max_images=meta.max_images_per_pack,
            max_image_tokens=meta.max_image_tokens_per_pack if pack.image_lengths is not None else None,
            max_video_tokens=meta.max_video_tokens_per_pack,
        ):  # fmt: skip
            result.add(f"{where}: {problem}")
        samples += max(len(cu) - 1, 0)
    result.checked["packs"] = result.checked.get("packs", 0) + num_packs
    result.checked["samples"] = result.checked.get("samples", 0) + samples


def _image_run_problems(pack, plan, first: int, last: int, image_run) -> list[str]:
    """Each image's run against what else records its size: the plan table's image positions per
    sample, and (dynamic images) the stored image's own token count plus the run's delimiters (a
    video clip's run, its family's own ids, at least that long)."""
    problems = []
    if plan.image_tokens is not None:
        bounds = np.concatenate([[0], np.cumsum(plan.num_images[first:last])])
        positions = np.concatenate([[0], np.cumsum(pack.image_lengths)])
        sums = positions[bounds[1:]] - positions[bounds[:-1]]
        if not np.array_equal(sums, plan.image_tokens[first:last]):
            problems.append(f"image positions per sample {sums.tolist()}, the plan table says {plan.image_tokens[first:last].tolist()}")
    if pack.stored_images is not None:
        expected = [image_run.length(image.tokens) for image in pack.stored_images]
        clips = [k for k, image in enumerate(pack.stored_images) if image.frames]
        for k in clips:  # a clip's run holds its features, its delimiters and whatever text its family puts between
            if pack.image_lengths[k] >= expected[k]:
                expected[k] = int(pack.image_lengths[k])
        if pack.image_lengths.tolist() != expected:
            problems.append(f"image runs of {pack.image_lengths.tolist()} positions, the stored images take {expected}")
    return problems


def pack_spec(meta: PackedMeta) -> invariants.PackSpec:
    """What the meta says every pack satisfies."""
    return invariants.PackSpec(
        max_seq_length=int(meta.packing.max_seq_length),
        ignore_index=int(meta.ignore_index),
        image_run=meta.image_run,
        pad_id=int(meta.pad_id),
    )


def _verify_accounting(prefix: Path, plan, data_path: Path, result) -> None:
    from neva_pack.records import count_records

    total = count_records(data_path)
    packed = plan.record_index.astype(np.int64)
    skipped_path = paths.skipped_path_of(prefix)
    try:
        skipped = paths.read_skipped_indices(skipped_path) if skipped_path.is_file() else []
    except InputError as exc:  # a damaged list accounts for nothing: say so, as for any other file
        result.add(str(exc))
        return
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
