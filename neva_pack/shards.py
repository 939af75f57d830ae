"""Preprocessing split across nodes: each shard encodes a contiguous record range into its own
store part; a final step checks the parts and joins them into the sample store.

    records     0 ........ 1428 ........ 2857 ........ 4285 ...   (--num_shards 7, 10,000 records)
    shard       |--- 0 ----|---- 1 ------|---- 2 ------|--- ...
    part        packed_seq_dataset/part_00000_of_00007/   a complete sample store of its range,
                                                          committed in chunks: resumable on its own
    final step  every part present, complete, same settings (content fingerprint), ranges tiling
                [0, records) once -> parts joined in record order by Megatron-Core's add_index
                (no re-tokenising) -> packed and written like any run: the same bytes as a run
                without shards

The content fingerprint names what decides the samples by content, never by absolute path or
mtime (nodes mount the same files at different places): hashes of the data file, the tokenizer
files and the template, the encoder's settings, and every other sample setting (those of the
resume fingerprint). The image folder is identified by the records that name its files, not hashed.

Each part dedups its images within itself; the join drops the images an earlier part already
holds (formats/sample_store.join_part), so the joined pool is the one a run without shards builds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from neva_pack import paths
from neva_pack.checksums import file_checksum
from neva_pack.errors import ConfigError, InputError

PART_NAME = paths.PART_NAME
_PART = paths.PART_PATTERN
LOCATION_KEYS = ("data_path", "data_size", "data_mtime_ns", "image_folder", "tokenizer_path", "conv_template",
                 "hf_vision_encoder")  # fmt: skip
"""Keys of the resume fingerprint that name a file or a setting by location or name; the content
fingerprint replaces them by digests of what they designate."""


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


def shard_range(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """Records [first, end) of shard ``index``: contiguous, sizes differing by at most one."""
    return total * index // num_shards, total * (index + 1) // num_shards


def part_dir(store_directory: Path, num_shards: int, index: int) -> Path:
    return paths.part_dir(store_directory, num_shards, index)


def is_part_file(name: str) -> bool:
    """A file a store part holds: its shards' files, progress, skipped lines, temporary names."""
    return paths.is_store_file(name) or name in (paths.SKIPPED_FILE, paths.SKIPPED_FILE + ".tmp")


def resolve_shards(num_shards: int | None, shard_index: int | None, environ=os.environ) -> tuple[int | None, int | None]:
    """--num_shards / --shard_index, defaulting from a SLURM job array (--array=0-(N-1)): the task id is
    the shard index, so a resubmitted subset (--array=3,7 with --num_shards N) redoes those shards."""
    if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in environ:
        num_shards = _slurm_number(environ, "SLURM_ARRAY_TASK_COUNT", "--num_shards")
    if num_shards is not None and shard_index is None and "SLURM_ARRAY_TASK_ID" in environ:
        shard_index = _slurm_number(environ, "SLURM_ARRAY_TASK_ID", "--shard_index")
    if num_shards is None and shard_index is not None:
        raise ConfigError("--shard_index needs --num_shards")
    if num_shards is not None and num_shards < 1:
        raise ConfigError(f"--num_shards {num_shards}: must be >= 1")
    if shard_index is not None and not 0 <= shard_index < num_shards:
        raise ConfigError(f"--shard_index {shard_index}: must be between 0 and --num_shards - 1 ({num_shards - 1})")
    return num_shards, shard_index


def _slurm_number(environ, name: str, flag: str) -> int:
    value = environ[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number (it stands for {flag}); "
                          f"pass {flag} explicitly or unset {name}") from None


def content_fingerprint(config, builder, total_records: int, resume_fingerprint: dict) -> dict:
    """What decides the samples, by content (no absolute path, no mtime): the resume fingerprint
    (``pipeline.sample_fingerprint``) with its locations and names replaced by content digests."""
    encoder = builder.preprocessor.encoder
    template = {k: v for k, v in dataclasses.asdict(builder.template).items() if k != "name"}
    return {
        "data": _file_digest(Path(config.data_path)),
        "records": total_records,
        "tokenizer": _tokenizer_digest(Path(config.tokenizer_path)),
        "template": _text_digest(json.dumps(template, sort_keys=True, default=str)),
        "encoder": _text_digest(json.dumps([encoder.processor, encoder.preprocessor_config, encoder.patch_size], sort_keys=True)),
        "image_ids": [builder.layout.patch_id, builder.layout.start_id, builder.layout.end_id],
        "image_positions": builder.layout.positions,
        **{k: v for k, v in resume_fingerprint.items() if k not in LOCATION_KEYS and k != "image_ids"},
    }


def join_parts(
    store_directory: Path, num_shards: int, total_records: int, fingerprint: dict, image_shape, resume_fingerprint: dict,
    *, image_run, ignore_index: int,
) -> None:  # fmt: skip
    """Check that the parts tile [0, total_records) once with identical settings and that each part's
    files are what its progress file records, then join them into the sample store (one store shard
    per part), check the joined store's files, and only then remove the parts.

    Idempotent: a store already joined from the same parts is left as it is (parts left over by a
    run stopped while removing them are removed).
    """
    from neva_pack.formats import sample_store

    store_directory = Path(store_directory)
    progress_file = store_directory / paths.STORE_PROGRESS
    if progress_file.is_file():
        joined = json.loads(progress_file.read_text(encoding="utf-8"))
        if joined.get("complete") and joined.get("joined_from") == _joined_marker(num_shards, total_records, fingerprint):
            _remove_joined_parts(store_directory, num_shards)
            return
    parts = _check_parts(store_directory, num_shards, total_records, fingerprint)
    marker = {"joined_from": _joined_marker(num_shards, total_records, fingerprint)}
    writer = sample_store.SampleStoreWriter(
        store_directory, image_shape, resume_fingerprint, extra=marker, image_run=image_run, ignore_index=ignore_index
    )
    for path, progress in parts:
        partition = progress["partition"]
        try:
            sample_store.join_part(writer, path, partition["first_record"], partition["end_record"])
        except sample_store.StoreDamage as exc:
            raise _damaged(path, partition, exc) from None
    problem = sample_store.store_files_problem(store_directory, json.loads(progress_file.read_text(encoding="utf-8")))
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
    from neva_pack.paths import LOCK_FILE

    for path in sorted(store_directory.iterdir()):
        match = _PART.fullmatch(path.name)
        if not (match and path.is_dir() and not path.is_symlink() and int(match.group(2)) == num_shards
                and int(match.group(1)) < num_shards):  # fmt: skip
            continue
        if all(p.is_file() and not p.is_symlink() and (is_part_file(p.name) or p.name == LOCK_FILE) for p in path.iterdir()):
            shutil.rmtree(path)


def _joined_marker(num_shards: int, total_records: int, fingerprint: dict) -> dict:
    return {"num_shards": num_shards, "total_records": total_records, "fingerprint": fingerprint}


def _check_parts(store_directory: Path, num_shards: int, total: int, fingerprint: dict) -> list[tuple[Path, dict]]:
    found = sorted(p for p in store_directory.iterdir() if p.is_dir() and _PART.fullmatch(p.name)) if store_directory.is_dir() else []
    foreign = [p.name for p in found if int(_PART.fullmatch(p.name).group(2)) != num_shards]
    if foreign:
        raise InputError(f"{store_directory}: {', '.join(foreign)} belong to a run with another --num_shards; "
                         f"remove them (this run has --num_shards {num_shards})")  # fmt: skip
    parts = []
    for index in range(num_shards):
        path = part_dir(store_directory, num_shards, index)
        first, end = shard_range(total, num_shards, index)
        progress = _read_part(path)
        if progress is None:
            raise InputError(f"{path.name} (records {first}..{end - 1}) is missing: run the same command with "
                             f"--shard_index {index}")  # fmt: skip
        if not progress.get("complete"):
            raise InputError(f"{path.name} (records {first}..{end - 1}) is incomplete: finish it with "
                             f"--shard_index {index} --resume")  # fmt: skip
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
        if path.name != PART_NAME.format(index=partition["shard_index"], count=num_shards) or expected != (
            partition["first_record"], partition["end_record"]
        ):
            raise InputError(f"{path.name} holds shard {partition['shard_index']} of {partition['num_shards']} "
                             f"(records {partition['first_record']}..{partition['end_record'] - 1}): a duplicated "
                             "or moved part; run it again with --overwrite")  # fmt: skip
    from neva_pack.formats.sample_store import store_files_problem

    for path, progress, partition in parts:  # before anything is joined or deleted: a damaged part is redone
        problem = store_files_problem(path, progress)
        if problem is not None:
            raise _damaged(path, partition, problem)
    return [(path, progress) for path, progress, _ in parts]


def _read_part(path: Path) -> dict | None:
    progress = path / paths.STORE_PROGRESS
    if not progress.is_file():
        return None
    try:
        return json.loads(progress.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{progress}: unreadable ({exc})") from None


def _file_digest(path: Path) -> str:
    return file_checksum(path)


def _text_digest(text: str) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def _tokenizer_digest(path: Path) -> str:
    """By content: a single file's bytes (not its name: the same .model copied under another name is
    the same tokenizer); a directory's files by their names inside it (tokenizer.json, ...) and bytes."""
    if not path.is_dir():
        return _file_digest(path)
    files = sorted(p for p in path.iterdir() if p.is_file())
    return _text_digest(json.dumps([[p.name, _file_digest(p)] for p in files]))

