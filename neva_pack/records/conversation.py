"""LLaVA-format records turned into a typed ``Conversation`` at the edge (``parse_record``), with
the limits a record is held to and every reason it can be skipped for. Reading them from a file,
streamed, is ``record_stream``'s job (the JSON list's scanner: ``list_scanner``).

Accepted input: a JSON list of records, or JSONL (one record per line). A record::

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",   # or a list, or absent
     "conversations": [{"from": "human", "value": "<image>\\nWhat is ..."},
                       {"from": "gpt", "value": "The bus ..."}]}

(``"images": [...]``, as several LLaVA-derived datasets write it, is read as ``image``.) Video clips,
as LLaVA-Video, ms-swift and LLaMA-Factory records name them: ``"video"`` (a name or a list) or
``"videos"``, one ``<video>`` placeholder in the human turns per clip; a record may mix images and
clips, each taken in the order its placeholder comes.

A record that cannot be used raises ``RecordError`` with a reason from ``SKIP_REASONS``;
the pipeline turns it into a counted, reported skip. The source index of every record
travels end to end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from neva_pack.files import VIDEO_HEADER_REASONS

__all__ = [
    "ASSISTANT_ROLES", "DEFAULT_MAX_CONVERSATION_CHARS", "DEFAULT_MAX_IMAGES_PER_RECORD", "DEFAULT_MAX_RECORD_BYTES",
    "DEFAULT_MAX_RECORD_DEPTH", "IMAGES_NOT_HELD", "IMAGE_PLACEHOLDER", "MAX_RECORD_DEPTH_LIMIT", "OVER_IMAGE_BUDGET",
    "PLACEHOLDERS", "SKIP_REASONS", "VIDEO_PLACEHOLDER", "VIDEOS_NOT_READ",
    "USER_ROLES", "Conversation", "RawRecord", "RecordError", "RecordLimits", "Turn", "parse_record",
]  # fmt: skip

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
PLACEHOLDERS = re.compile("<image>|<video>")
"""Where a turn's text holds a visual item: an image or a video clip."""
VIDEOS_NOT_READ = "videos_not_read"
"""The skip reason of a record with a video clip where the run reads none."""

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant"})
_ROLE_OF = {**dict.fromkeys(USER_ROLES, "user"), **dict.fromkeys(ASSISTANT_ROLES, "assistant")}

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
    "unreadable_image": "an image file cannot be decoded (the detail names the decoder's error)",
    "too_long": "longer than max_seq_length while truncation is off",
    "plain_record_shape": "the plain template takes one human turn and one answer (llava: with <image>)",
    # reliability budgets and checks: each bounds what one record may cost
    "record_too_large": "the record's JSON text is longer than --max_record_bytes (it is not parsed)",
    "record_too_deep": "the record nests arrays/objects deeper than --max_record_depth (it is not parsed)",
    "conversation_too_long": "the conversation's text has more characters than --max_conversation_chars",
    "invalid_unicode": "a string holds a lone UTF-16 surrogate (an escape like \\ud800), which is not text",
    "outside_image_folder": "an image name is absolute, climbs out with '..', or resolves (symlinks too) "
    "outside --image_folder (see --allow_outside_image_folder)",
    "image_too_large": "an image file is larger than --max_image_bytes, or its pixels (as decoded, padded "
    "or resized) exceed --max_image_pixels (checked before decoding)",
    "no_supervised_tokens": "no label is trained after templating and truncation (nothing to learn from)",
    "image_too_slow": "decoding one image took more CPU time than --max_image_decode_seconds (it was stopped)",
    "too_many_images": "the record names more images than --max_images_per_record (checked before any is read)",
    "images_not_held": "the record has images and --output_format holds text only",
    "over_image_budget": "the sample alone has more images, image tokens or video tokens than --max_images_per_pack / "
    "--max_image_tokens_per_pack / --max_video_tokens_per_pack allow in a pack",
    "videos_not_read": "the record has a video clip and the run's model family reads none (a native-resolution "
    "encoder does), or the output format holds text only",
    "video_frames_mismatch": "a video's stream ends before the last frame its header promised (an edit list that "
    "trims frames, a truncated file), or its frames are not the size its header declares: the frames sampled from the "
    "header are not all there, or not the tokens counted",
    "video_too_slow": "decoding one video's frames took more CPU time than --max_image_decode_seconds (it was stopped)",
    "unreadable_video": "a video's frames cannot be decoded, or the clip is one the model's processor refuses "
    "(fewer frames than a temporal patch, an aspect ratio over 200)",
    **VIDEO_HEADER_REASONS,
}
"""Every reason a record can be skipped for, with what it means (shown in the summary)."""


IMAGES_NOT_HELD = "images_not_held"
"""The skip reason of a record with images when the output format holds text only."""
OVER_IMAGE_BUDGET = "over_image_budget"
"""The skip reason, at a pack size, of a sample over a visual budget on its own."""


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
    """Image (and video clip) file names relative to the image folder, in placeholder order."""
    video_slots: tuple[int, ...] = ()
    """Which of ``images`` are video clips (their positions there): a <video> placeholder's."""
    system: str | None = None
    """The record's own "system" prompt, if any (used by templates that read it: NeMo's nvgpt)."""


DEFAULT_MAX_RECORD_BYTES = 8 << 20
"""8 MiB of JSON text per record (a LLaVA record is about 1.5 KB)."""
DEFAULT_MAX_RECORD_DEPTH = 64
"""Nesting levels per record (a LLaVA record has 3: record, conversations, turn)."""
MAX_RECORD_DEPTH_LIMIT = 500
"""The most --max_record_depth may be: Python's json parser recurses once per level."""
DEFAULT_MAX_CONVERSATION_CHARS = 1_000_000
"""Characters of text per conversation (about 250,000 tokens: far beyond any max_seq_length)."""
DEFAULT_MAX_IMAGES_PER_RECORD = 1_000
"""Images per record (interleaved web documents hold tens; 1,000 image runs of 576 positions are
5 MB of ids, where 142,000 placeholders took a gigabyte before they could be refused)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordLimits:
    """What one record may cost before it is parsed: a record over a limit is skipped unparsed."""

    max_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Bytes of the record's JSON text (record_too_large)."""
    max_depth: int = DEFAULT_MAX_RECORD_DEPTH
    """Nesting depth of arrays/objects inside the record, the record itself being 1 (record_too_deep)."""


@dataclass(frozen=True, slots=True)
class RawRecord:
    index: int
    """Position in the input file."""
    value: object
    """The decoded JSON value, or None when the record could not be decoded."""
    error: str | None = None
    """Why the record could not be decoded."""
    reason: str = "malformed_json"
    """The skip reason of ``error``: malformed_json, record_too_large, record_too_deep, invalid_unicode."""

    @property
    def record_id(self) -> str | None:
        """The record's "id" as text (what skipped.jsonl names a record by), or None without one."""
        value = self.value.get("id") if isinstance(self.value, dict) else None
        return None if value is None else str(value)


def parse_record(
    raw: RawRecord, max_conversation_chars: int = DEFAULT_MAX_CONVERSATION_CHARS,
    max_images: int = DEFAULT_MAX_IMAGES_PER_RECORD,
) -> Conversation:  # fmt: skip
    """Validate one record's shape; raise RecordError for anything the pipeline cannot use.

    The images are named by ``image`` (LLaVA: a name or a list) or ``images`` (a list, as several
    LLaVA-derived datasets write it): the same thing spelled two ways; a record with both is
    malformed (which one it means is not ours to guess). A record naming more than ``max_images``
    images, or holding more <image> placeholders than that, is skipped before anything is built
    for them (each costs an image run of ids, hundreds of positions)."""
    if raw.error is not None:
        raise RecordError(raw.reason, raw.error)
    record = raw.value
    if not isinstance(record, dict):
        raise RecordError("malformed_record", f"expected an object, got {type(record).__name__}")
    record_id = raw.record_id
    if "image" in record and "images" in record:
        raise RecordError("malformed_record", "both 'image' and 'images' are given (use one of them)")
    if "video" in record and "videos" in record:
        raise RecordError("malformed_record", "both 'video' and 'videos' are given (use one of them)")
    field = "images" if "images" in record else "image"
    images = _image_list(record.get(field), field, max_images)
    field = "videos" if "videos" in record else "video"
    videos = _image_list(record.get(field), field, max_images)
    conversations = record.get("conversations")
    if not isinstance(conversations, list):
        raise RecordError("malformed_record", "'conversations' is missing or not a list")
    turns = []
    characters = 0
    for position, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            raise RecordError("malformed_record", f"turn {position} is not an object")
        speaker = turn.get("from")
        if not isinstance(speaker, str):
            raise RecordError("unknown_role", f"turn {position} has from={speaker!r:.80} (not a string)")
        role = _ROLE_OF.get(speaker)
        if role is None:
            raise RecordError("unknown_role", f"turn {position} has from={speaker!r}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise RecordError("non_string_value", f"turn {position} has value of type {type(value).__name__}")
        characters += len(value)
        if characters > max_conversation_chars:
            raise RecordError(
                "conversation_too_long", f"more than --max_conversation_chars {max_conversation_chars:,} characters"
            )
        turns.append(Turn(role, value))
    if turns and turns[0].role != "user":
        turns = turns[1:]  # a leading non-human turn is dropped, as LLaVA and NeMo do
    if not turns:
        raise RecordError("empty_conversation", "no human turn to start the conversation")
    placeholders = in_answers = 0
    order: list[str] = []  # each placeholder of the human turns, in order
    for position, turn in enumerate(turns):
        if placeholders > max_images:
            break
        expected = "assistant" if position & 1 else "user"
        if turn.role != expected:
            raise RecordError("roles_not_alternating", f"turn {position} is {turn.role}, expected {expected}")
        if "<" in turn.text:
            found = PLACEHOLDERS.findall(turn.text)
            if position & 1:
                in_answers += len(found)
            else:
                placeholders += len(found)
                order.extend(found[: max_images + 1])
    if placeholders > max_images:
        raise RecordError("too_many_images", f"more than --max_images_per_record {max_images:,} <image> placeholders")
    if len(turns) < 2:
        raise RecordError("no_assistant_turn", "the conversation has no gpt turn")
    if in_answers:
        raise RecordError("placeholder_mismatch", f"{in_answers} <image>/<video> placeholder(s) in gpt turns")
    counted = order.count(VIDEO_PLACEHOLDER)
    if placeholders - counted != len(images):
        raise RecordError("placeholder_mismatch", f"{placeholders - counted} <image> placeholder(s) for {len(images)} image(s)")
    if counted != len(videos):
        raise RecordError("placeholder_mismatch", f"{counted} <video> placeholder(s) for {len(videos)} video(s)")
    video_slots = ()
    if videos:
        if len(images) + len(videos) > max_images:
            raise RecordError("too_many_images", f"{len(images) + len(videos):,} images and videos > --max_images_per_record {max_images:,}")
        stills, clips = iter(images), iter(videos)
        images = tuple(next(clips) if kind == VIDEO_PLACEHOLDER else next(stills) for kind in order)
        video_slots = tuple(k for k, kind in enumerate(order) if kind == VIDEO_PLACEHOLDER)
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise RecordError("malformed_record", f"'system' is a {type(system).__name__}, not a string")
    return Conversation(index=raw.index, record_id=record_id, turns=tuple(turns), images=images, system=system,
                        video_slots=video_slots)  # fmt: skip


def _image_list(value, field: str, max_images: int) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, list) and all(isinstance(name, str) for name in value):
        names = tuple(value)
    else:
        raise RecordError("malformed_record", f"'{field}' must be a string or a list of strings, got {value!r:.80}")
    if len(names) > max_images:
        raise RecordError("too_many_images", f"{len(names):,} images > --max_images_per_record {max_images:,}")
    for name in names:
        if "\x00" in name or not name.strip():  # a NUL cannot be in a file name (open() would raise)
            raise RecordError("malformed_record", f"image name {name!r:.80} is empty or holds a NUL character")
    return names
