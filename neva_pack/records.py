"""Stream LLaVA-format records and turn each into a typed ``Conversation`` at the edge.

Accepted input: a JSON list of records, or JSONL (one record per line). A record::

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",   # or a list, or absent
     "conversations": [{"from": "human", "value": "<image>\\nWhat is ..."},
                       {"from": "gpt", "value": "The bus ..."}]}

A record that cannot be used raises ``RecordError`` with a reason from ``SKIP_REASONS``;
the pipeline turns it into a counted, reported skip. The source index of every record
travels end to end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from neva_pack.errors import InputError

IMAGE_PLACEHOLDER = "<image>"

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant"})

SKIP_REASONS = {
    "malformed_json": "the JSONL line is not valid JSON",
    "malformed_record": "the record is not an object, or its conversations/image fields have the wrong type",
    "empty_conversation": "no turns left after dropping a leading non-human turn",
    "unknown_role": "a turn's 'from' is not human/user or gpt/assistant",
    "roles_not_alternating": "turns do not alternate human, gpt, human, ...",
    "non_string_value": "a turn's 'value' is not a string",
    "no_assistant_turn": "the conversation has nothing to train on",
    "placeholder_mismatch": "the number of <image> placeholders in human turns differs from the number of images",
    "missing_image": "an image file is not in the image folder / archive",
    "unreadable_image": "an image file cannot be decoded",
    "too_long": "longer than max_seq_length while truncation is off",
    "plain_record_shape": "the plain template takes one human turn and one answer (llava: with <image>)",
}
"""Every reason a record can be skipped for, with what it means (shown in the summary)."""


class RecordError(Exception):
    """A record that is skipped, with one of ``SKIP_REASONS`` and a human-readable detail."""

    def __init__(self, reason: str, detail: str):
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Turn:
    role: Literal["user", "assistant"]
    """Normalised speaker."""
    text: str
    """The turn's text, <image> placeholders included."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversation:
    index: int
    """Position of the record in the input file (0-based); the key of every report line."""
    record_id: str | None
    """The record's own "id", if any."""
    turns: tuple[Turn, ...]
    """Starts with a user turn and alternates."""
    images: tuple[str, ...]
    """Image file names relative to the image folder, in placeholder order."""
    system: str | None = None
    """The record's own "system" prompt, if any (used by templates that read it: NeMo's nvgpt)."""


@dataclass(frozen=True, slots=True)
class RawRecord:
    index: int
    """Position in the input file."""
    value: object
    """The decoded JSON value, or None when the line was not valid JSON."""
    error: str | None = None
    """The JSON decoding error of a malformed JSONL line."""


def input_format(path: Path) -> Literal["json", "jsonl"]:
    """JSON list or JSONL, by content: a JSON list starts with '['."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    return "json" if head.startswith(b"[") else "jsonl"


def iter_raw_records(path: Path) -> Iterator[RawRecord]:
    """Yield every record of the file in order, streaming (the file is never loaded whole)."""
    if input_format(path) == "json":
        yield from _iter_json_list(path)
    else:
        yield from _iter_jsonl(path)


def count_records(path: Path, progress: bool = False) -> int:
    """Number of records, checking a JSON list's syntax: a broken list fails here, before any work."""
    from tqdm import tqdm

    count = 0
    for _ in tqdm(iter_raw_records(path), desc="read records", unit="rec", disable=not progress, mininterval=1):
        count += 1
    return count


def _iter_json_list(path: Path) -> Iterator[RawRecord]:
    import ijson

    with open(path, "rb") as f:
        try:
            for index, value in enumerate(ijson.items(f, "item", use_float=True)):
                yield RawRecord(index, value)
        except ijson.JSONError as exc:
            raise InputError(f"--data_path {path}: invalid JSON list ({exc})") from None


def _iter_jsonl(path: Path) -> Iterator[RawRecord]:
    index = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield RawRecord(index, json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield RawRecord(index, None, error=str(exc))
            index += 1


def parse_record(raw: RawRecord) -> Conversation:
    """Validate one record's shape; raise RecordError for anything the pipeline cannot use."""
    if raw.error is not None:
        raise RecordError("malformed_json", raw.error)
    record = raw.value
    if not isinstance(record, dict):
        raise RecordError("malformed_record", f"expected an object, got {type(record).__name__}")
    record_id = record.get("id")
    record_id = None if record_id is None else str(record_id)
    images = _image_list(record.get("image"))
    conversations = record.get("conversations")
    if not isinstance(conversations, list):
        raise RecordError("malformed_record", "'conversations' is missing or not a list")
    turns = []
    for position, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            raise RecordError("malformed_record", f"turn {position} is not an object")
        speaker = turn.get("from")
        if speaker in USER_ROLES:
            role = "user"
        elif speaker in ASSISTANT_ROLES:
            role = "assistant"
        else:
            raise RecordError("unknown_role", f"turn {position} has from={speaker!r}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise RecordError("non_string_value", f"turn {position} has value of type {type(value).__name__}")
        turns.append(Turn(role, value))
    if turns and turns[0].role != "user":
        turns = turns[1:]  # a leading non-human turn is dropped, as LLaVA and NeMo do
    if not turns:
        raise RecordError("empty_conversation", "no human turn to start the conversation")
    for position, turn in enumerate(turns):
        expected = "user" if position % 2 == 0 else "assistant"
        if turn.role != expected:
            raise RecordError("roles_not_alternating", f"turn {position} is {turn.role}, expected {expected}")
    if len(turns) < 2:
        raise RecordError("no_assistant_turn", "the conversation has no gpt turn")
    placeholders = sum(t.text.count(IMAGE_PLACEHOLDER) for t in turns if t.role == "user")
    in_answers = sum(t.text.count(IMAGE_PLACEHOLDER) for t in turns if t.role == "assistant")
    if in_answers:
        raise RecordError("placeholder_mismatch", f"{in_answers} <image> placeholder(s) in gpt turns")
    if placeholders != len(images):
        raise RecordError("placeholder_mismatch", f"{placeholders} <image> placeholder(s) for {len(images)} image(s)")
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise RecordError("malformed_record", f"'system' is a {type(system).__name__}, not a string")
    return Conversation(index=raw.index, record_id=record_id, turns=tuple(turns), images=images, system=system)


def _image_list(field) -> tuple[str, ...]:
    if field is None:
        return ()
    if isinstance(field, str):
        return (field,)
    if isinstance(field, list) and all(isinstance(name, str) for name in field):
        return tuple(field)
    raise RecordError("malformed_record", f"'image' must be a string or a list of strings, got {field!r:.80}")
