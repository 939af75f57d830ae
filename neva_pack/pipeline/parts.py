"""A sharded run's parts: each shard encodes a contiguous record range (neva_pack.records.shards) into its
own part of the store; a final step checks the parts and joins them into the sample store.

    records     0 ........ 1428 ........ 2857 ........ 4285 ...   (--num_shards 7, 10,000 records)
    shard       |--- 0 ----|---- 1 ------|---- 2 ------|--- ...
    part        packed_seq_dataset/part_00000_of_00007/   a complete sample store of its range,
                                                          committed in segments: resumable on its own
    final step  every part present, complete, same settings (content fingerprint), ranges tiling
                [0, records) once -> parts joined in record order by Megatron-Core's add_index
                (no re-tokenising) -> packed and written like any run: the same bytes as a run
                without shards

The content fingerprint names what decides the samples by content, never by absolute path or
mtime (nodes mount the same files at different places): hashes of the data file, the tokenizer
files and the template, the image folder's member table or file list (pipeline/inputs.py), the
encoder's settings, and every other sample setting (those of the resume fingerprint).

Each part dedups its images within itself; the join drops the images an earlier part already
holds (sample_store.join_part), so the joined pool is the one a run without shards builds.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from neva_pack.config import RunConfig, SampleConfig
from neva_pack.core import ConfigError, InputError
from neva_pack.pipeline.encode import encode_samples, records_per_message, store_images
from neva_pack.pipeline.inputs import text_digest
from neva_pack.pipeline.ownership import LOCK_FILE, is_part_file, lock_holder, prepare_part_dir
from neva_pack.pipeline.shard_status import resubmit_lines
from neva_pack.records import index_records, shard_range
from neva_pack.sample_store import (
    PROGRESS_FILE,
    SampleStoreWriter,
    StoreDamage,
    check_input,
    join_part,
    part_dir,
    part_of,
    read_progress,
    store_checksums_problem,
    store_files_problem,
)
from neva_pack.samples import SampleBuilder
from neva_pack.files import file_checksum

__all__ = ["Partition", "content_fingerprint", "encode_part", "input_digest", "join_parts"]

@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    """One shard's share of the records (what its part's progress file records)."""

    num_shards: int
    """Shards of the run (--num_shards)."""
    shard_index: int
    """This shard, 0-based (--shard_index)."""
    total_records: int
    """Records in the input file: every shard must see the same file."""
    first_record: int
    """First input record of the shard."""
    end_record: int
    """One past the shard's last record."""
    fingerprint: dict
    """Content fingerprint of the settings (see module docstring)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def encode_part(
    sample: SampleConfig, run: RunConfig, builder: SampleBuilder, progress: bool, *, resume_fingerprint: dict,
    inputs: dict[str, str | None],
) -> str:  # fmt: skip
    """--num_shards N --shard_index i: encode shard i's record range into its own part of the sample
    store; --resume / --overwrite touch only that part. ``resume_fingerprint``: the run's sample
    fingerprint (``PreprocessConfig.sample_fingerprint``), of which the part records the content
    version (``inputs``: the run's ``input_digests``). Returns the line that tells the user what next."""
    output_dir = Path(run.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    index = index_records(sample.data_path, every=records_per_message(sample), progress=progress)
    total = index.count
    first, end = shard_range(total, run.num_shards, run.shard_index)
    with prepare_part_dir(run) as lock:
        part = lock.path.parent
        partition = Partition(
            num_shards=run.num_shards,
            shard_index=run.shard_index,
            total_records=total,
            first_record=first,
            end_record=end,
            fingerprint=content_fingerprint(sample, builder, total, resume_fingerprint, inputs),
        )
        extra = {"partition": partition.to_json()}
        encode_samples(sample, run, builder, part, part, index, progress, first=first, end=end, extra=extra,
                       fingerprint=partition.fingerprint, input_digest=partition.fingerprint["data"])  # fmt: skip
    return (
        f"shard {run.shard_index} of {run.num_shards}: records {first}..{end - 1} encoded into {part}; "
        f"once every shard is done, run the same command without --shard_index to pack"
    )


def content_fingerprint(
    sample: SampleConfig, builder, total_records: int, resume_fingerprint: dict, inputs: dict[str, str | None]
) -> dict:  # fmt: skip
    """What decides the samples, by content (no absolute path, no mtime): the resume fingerprint
    (``PreprocessConfig.sample_fingerprint``) with its locations and names replaced by content digests
    (``inputs``: the run's ``input_digests``, computed when it started)."""
    locations = set(sample.location_keys())
    return {
        "data": inputs["data_path"],
        "records": total_records,
        "tokenizer": inputs["tokenizer_path"],
        "template": inputs["conv_template"],
        "image_folder": inputs["image_folder"],
        "encoder": _encoder_digest(sample, builder),
        "image_ids": [builder.image_run.patch_id, builder.image_run.start_id, builder.image_run.end_id],
        "image_positions": builder.image_run.positions,
        **{k: v for k, v in resume_fingerprint.items() if k not in locations and k != "image_ids"},
    }


def _encoder_digest(sample: SampleConfig, builder) -> str:
    """The image processor by content: a fixed crop's encoder settings, or a dynamic family's processor
    record (``images.processor_record``: encoder settings plus the pixel bounds and arithmetic it resolved)."""
    images = store_images(sample, builder)
    if images.image_processor is not None:
        return text_digest(json.dumps(images.image_processor, sort_keys=True))
    encoder = builder.preprocessor.encoder
    return text_digest(json.dumps([encoder.processor, encoder.preprocessor_config, encoder.patch_size], sort_keys=True))


def join_parts(
    store_directory: Path, num_shards: int, total_records: int, fingerprint: dict, image_shape, resume_fingerprint: dict,
    *, image_run, ignore_index: int, data_path, image_processor: dict | None = None, frame_compression: str | None = None,
) -> None:  # fmt: skip
    """Check that the parts tile [0, total_records) once with identical settings and that each part's
    files are what its progress file records, then join them into the sample store (one store shard
    per part), check the joined store's files, and only then remove the parts.

    Idempotent: a store already joined from the same parts is left as it is (parts left over by a
    run stopped while removing them are removed).
    """
    store_directory = Path(store_directory)
    progress_file = store_directory / PROGRESS_FILE
    if progress_file.is_file():
        joined = read_progress(store_directory)
        if joined.get("complete") and joined.get("joined_from") == _joined_marker(num_shards, total_records, fingerprint):
            problem = store_checksums_problem(store_directory, joined)
            if problem is not None:
                raise InputError(f"--resume: the sample store in {store_directory} is damaged ({problem}); run the "
                                 "shards and this step again with --overwrite")  # fmt: skip
            _remove_joined_parts(store_directory, num_shards)
            return
        if joined.get("complete") and not any(part_of(p.name) for p in store_directory.iterdir()):
            check_input(store_directory, (joined.get("joined_from") or {}).get("fingerprint", {}).get("data"),
                        fingerprint["data"], data_path)  # fmt: skip
    parts = _check_parts(store_directory, num_shards, total_records, fingerprint)
    marker = {"joined_from": _joined_marker(num_shards, total_records, fingerprint)}
    writer = SampleStoreWriter(
        store_directory, image_shape, resume_fingerprint, extra=marker, image_run=image_run, ignore_index=ignore_index,
        input_digest=fingerprint["data"], image_processor=image_processor, frame_compression=frame_compression,
    )
    for path, progress in parts:
        partition = progress["partition"]
        try:
            join_part(writer, path, partition["first_record"], partition["end_record"])
        except StoreDamage as exc:
            raise _damaged(path, partition, exc) from None
    problem = store_files_problem(store_directory, read_progress(store_directory))
    if problem is not None:  # left incomplete, with every part: the final step joins them again
        raise InputError(f"{store_directory}: the store joined from the parts is damaged ({problem}); the parts "
                         "were kept: run the final step again")  # fmt: skip
    writer.finish(total_records)
    for path, _ in parts:
        shutil.rmtree(path)


def _damaged(path: Path, partition: dict, problem) -> InputError:
    first, end, index = partition["first_record"], partition["end_record"], partition["shard_index"]
    return InputError(f"{path.name} (records {first}..{end - 1}) is damaged: {problem}; nothing was deleted: run it "
                      f"again with --shard_index {index} --overwrite")  # fmt: skip


def _remove_joined_parts(store_directory: Path, num_shards: int) -> None:
    """Parts of this run left in a store already joined from them (the final step stopped while it
    removed them): the joined store holds their records. Only directories that are one of this run's
    parts by name and hold nothing but a part's files are removed."""
    for path in sorted(store_directory.iterdir()):
        part = part_of(path.name)
        if not (part and path.is_dir() and not path.is_symlink() and part[1] == num_shards and part[0] < num_shards):
            continue
        if all(p.is_file() and not p.is_symlink() and (is_part_file(p.name) or p.name == LOCK_FILE) for p in path.iterdir()):
            shutil.rmtree(path)


def _joined_marker(num_shards: int, total_records: int, fingerprint: dict) -> dict:
    return {"num_shards": num_shards, "total_records": total_records, "fingerprint": fingerprint}


def _check_parts(store_directory: Path, num_shards: int, total: int, fingerprint: dict) -> list[tuple[Path, dict]]:
    found = sorted(p for p in store_directory.iterdir() if p.is_dir() and part_of(p.name)) if store_directory.is_dir() else []
    foreign = [p.name for p in found if part_of(p.name)[1] != num_shards]
    if foreign:
        raise InputError(f"{store_directory}: {', '.join(foreign)} belong to a run with another --num_shards; "
                         f"remove them (this run has --num_shards {num_shards})")  # fmt: skip
    unfinished = _unfinished(store_directory, num_shards, total)
    if unfinished:
        raise unfinished
    parts = []
    for index in range(num_shards):
        path = part_dir(store_directory, num_shards, index)
        progress = _read_part(path)
        partition = progress.get("partition") or {}
        for key, value in sorted(fingerprint.items()):
            if partition.get("fingerprint", {}).get(key) != value:
                raise InputError(f"{path.name} was encoded with other settings ({key} differs); run it again with "
                                 f"--shard_index {index} --overwrite and the settings of this command")  # fmt: skip
        parts.append((path, progress, partition))
    covered = sorted((p["first_record"], p["end_record"], path.name) for path, _, p in parts)
    position = 0
    for first, end, name in covered:
        if first < position:
            raise InputError(f"{name} holds records {first}..{end - 1}, already covered by another part "
                             f"(duplicated part); run it again with --overwrite")  # fmt: skip
        if first > position:
            raise InputError(f"records {position}..{first - 1} are in no part (missing part before {name})")
        position = end
    if position != total:
        raise InputError(f"records {position}..{total - 1} are in no part (missing part)")
    for path, progress, partition in parts:
        expected = shard_range(total, num_shards, partition["shard_index"])
        if path.name != part_dir(store_directory, num_shards, partition["shard_index"]).name or expected != (
            partition["first_record"], partition["end_record"]
        ):
            raise InputError(f"{path.name} holds shard {partition['shard_index']} of {partition['num_shards']} "
                             f"(records {partition['first_record']}..{partition['end_record'] - 1}): a duplicated "
                             "or moved part; run it again with --overwrite")  # fmt: skip
    for path, progress, partition in parts:  # before anything is joined or deleted: a damaged part is redone
        problem = store_files_problem(path, progress)
        if problem is not None:
            raise _damaged(path, partition, problem)
    return [(path, progress) for path, progress, _ in parts]


def _unfinished(store_directory: Path, num_shards: int, total: int) -> InputError | None:
    """The refusal of a final step run before every shard finished (None when each part is complete):
    one line naming the first part left and what it needs, every shard left, and the lines that
    resubmit exactly the missing and stale ones on each engine (``shard_status.resubmit_lines``)."""
    left, resubmit, problems = [], [], []
    for index in range(num_shards):
        path = part_dir(store_directory, num_shards, index)
        first, end = shard_range(total, num_shards, index)
        progress = _read_part(path)
        if progress is not None and progress.get("complete"):
            continue
        holder = lock_holder(path) if path.is_dir() else None
        if holder is not None:
            problems.append(f"{path.name} (records {first}..{end - 1}) is running ({holder}): wait for it to end")
            left.append(f"{index} (running)")
            continue
        started = progress is not None or (path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir()))
        if not started:
            problems.append(f"{path.name} (records {first}..{end - 1}) is missing: run the same command with "
                            f"--shard_index {index}")  # fmt: skip
            left.append(f"{index} (missing)")
        else:
            committed = "" if progress is not None else " (nothing committed)"
            problems.append(f"{path.name} (records {first}..{end - 1}) is incomplete{committed}: finish it with "
                            f"--shard_index {index} --resume")  # fmt: skip
            left.append(f"{index} (stale)")
        resubmit.append(index)
    if not left:
        return None
    lines = "; ".join(resubmit_lines(resubmit, num_shards)) if resubmit else "nothing to resubmit"
    return InputError(f"{problems[0]}; {len(left)} of the {num_shards} shards are not done: {', '.join(left)}; {lines}")


def _read_part(path: Path) -> dict | None:
    if not (path / PROGRESS_FILE).exists():
        return None
    return read_progress(path)


def input_digest(data_path) -> str:
    """The input records file's content digest: what a resume and ``verify --data_path`` compare, so
    that an input edited in place (same size, mtime put back) is never taken for the one packed."""
    return file_checksum(Path(data_path))
