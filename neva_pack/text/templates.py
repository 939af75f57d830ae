"""Conversation templates: YAML data in ``templates/``, rendered into typed pieces.

A template is a mapping role -> (prefix, suffix) plus a few named options, never a
subclass. Rendering a conversation gives a flat list of ``Piece`` s::

    v1, one round:   [bos] "SYSTEM " "USER: " "<image>"... "\\nHi" " " "ASSISTANT: " "Hello" [eos]
    trained:           -      -        -         -          -     -        -         yes    yes

Strings may name the tokenizer's BOS/EOS as ``{bos}`` / ``{eos}``; they become ids,
never text. Assistant content and the assistant suffix (the end of turn) are trained;
everything else is not.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


from neva_pack.core import ConfigError
from neva_pack.records import IMAGE_PLACEHOLDER, PLACEHOLDERS, RecordError, Turn
from neva_pack.files import parse_yaml, read_text


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokenization:
    name: str
    """Registry name (``--tokenization``)."""
    description: str
    """One line for ``--help`` and the README."""
    one_call: bool
    """Tokenize the whole prompt in one call, images and BOS/EOS written as the tokenizer's
    special pieces (NeMo); False: one call per stretch of text between images, each starting a
    new sentencepiece sentence (LLaVA's tokenizer_image_token; BOS/EOS do not start one)."""
    auto_image_delimiters: bool
    """Open/close image runs with the tokenizer's <extra_id_4>/<extra_id_5> when it has them."""


TOKENIZATIONS = {
    t.name: t
    for t in (
        Tokenization(
            name="nemo",
            description="token-identical to NeMo NeVA's preprocessing (one tokenizer call per prompt)",
            one_call=True,
            auto_image_delimiters=True,
        ),
        Tokenization(
            name="llava",
            description="token-identical to LLaVA-1.5's preprocessing (tokenizer_image_token, chunk by chunk)",
            one_call=False,
            auto_image_delimiters=False,
        ),
    )
}
"""The tokenization conventions; the CLI's choices come from here."""
DEFAULT_TOKENIZATION = "nemo"

_SPECIAL_REFERENCE = re.compile(r"\{(bos|eos)\}")
_TEMPLATE_KEYS = {
    "name", "description", "bos", "system", "system_placement", "system_prefix", "system_suffix",
    "system_when_empty", "system_from_record", "user", "assistant", "user_content", "first_user_prefix", "round_separator",
    "strip_user_content", "strip_end", "one_round_only", "requires_image", "image_patch_token", "trim_messages",
}  # fmt: skip
_ROLE_KEYS = {"prefix", "lead", "suffix"}


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleFormat:
    prefix: str = ""
    """Text before the turn's content (never trained)."""
    lead: str = ""
    """Assistant only: trained text between the prefix and the answer, the space a model writes
    itself after ``ASSISTANT:`` at inference (NeMo and LLaVA train the "▁" it becomes)."""
    suffix: str = ""
    """Text after the content; for the assistant this is the end of turn and is trained."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Template:
    name: str
    """Registry name (file stem)."""
    description: str
    """One line shown by ``--help`` and in the output's meta."""
    bos: bool
    """Start the sequence with the tokenizer's BOS id."""
    system: str
    """Default system prompt; empty = no system block at all."""
    system_placement: Literal["before_first_turn", "in_first_user"]
    """Own block before the first turn, or inside the first user turn (Llama-2, Mistral)."""
    system_prefix: str
    """Text before the system prompt."""
    system_suffix: str
    """Text after the system prompt."""
    user: RoleFormat
    """Format of human turns."""
    assistant: RoleFormat
    """Format of model turns."""
    user_content: Literal["text", "images_only"]
    """``images_only``: a human turn with <image> keeps only its placeholders, one without keeps
    its text (``plain``: NeMo captions a text-only record's answer after its question)."""
    system_when_empty: bool = False
    """Write the system block (prefix + suffix) even when the system prompt is empty."""
    system_from_record: bool = False
    """A record's own "system" field replaces the system prompt (NeMo's nvgpt reads it)."""
    first_user_prefix: str | None = None
    """Prefix of the first user turn when it differs from later ones (NeMo's Llama-2: no BOS)."""
    round_separator: str = ""
    """Untrained text between an assistant turn and the next user turn (NeMo's v1: a space)."""
    strip_user_content: bool = False
    """Strip whitespace around each user turn's text (NeMo's yi_34b)."""
    strip_end: bool = False
    """Drop trailing whitespace at the end of the rendering (NeMo's yi_34b strips its prompt)."""
    trim_messages: bool = False
    """Strip whitespace around every message's text: the system prompt, each user turn and each answer
    (Gemma 4's chat template writes each message ``| trim``)."""
    one_round_only: bool = False
    """Only one user turn and one answer are accepted (``plain``: NeMo and LLaVA refuse other
    records); anything else is skipped as ``plain_record_shape``."""
    requires_image: bool = False
    """The user turn must hold an <image> (LLaVA's ``plain``), else ``plain_record_shape``."""
    image_patch_token: str | None = None
    """Token whose id fills image positions (NeMo leaves <extra_id_3> where its template has
    no id remapping); None: the configured patch id (0)."""


@dataclass(frozen=True, slots=True)
class Piece:
    kind: Literal["text", "content", "special", "image"]
    """Template text, conversation text (never substituted, never a control id), a special
    token named by ``value`` ("bos"/"eos"), or one image."""
    value: str
    """The text, or the special token's name; empty for an image."""
    trained: bool
    """Whether the tokens of this piece are label targets."""


TEMPLATE_ALIASES = {"vicuna_v1": "v1", "llava_mistral_instruct": "mistral_instruct"}
"""Names the reference code gives a shipped template: LLaVA-NeXT's conv_templates "vicuna_v1" (LLaVA-v1.6
Vicuna) is LLaVA-1.5's conv_vicuna_v1, our v1; its "llava_mistral_instruct" is its "mistral_instruct"."""


def available_templates() -> list[str]:
    files = [p.name[: -len(".yaml")] for p in _template_dir().iterdir() if _is_template_file(p.name)]
    return sorted(files + list(TEMPLATE_ALIASES))


def load_template(name_or_path: str, tokenization: str = DEFAULT_TOKENIZATION) -> Template:
    """A registry name (``v1``) or a path to a YAML file of the same schema, with the
    section of the given tokenization convention applied."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = read_text(path, what="--conv_template")
    else:
        resource = _template_dir() / f"{TEMPLATE_ALIASES.get(name_or_path, name_or_path)}.yaml"
        if not _is_template_file(resource.name) or not resource.is_file():
            raise ConfigError(
                f"--conv_template {name_or_path!r}: unknown template; choose one of "
                f"{', '.join(available_templates())} or give a .yaml file"
            )
        text = resource.read_text(encoding="utf-8")
    if tokenization not in TOKENIZATIONS:
        raise ConfigError(f"--tokenization {tokenization!r}: choose one of {', '.join(TOKENIZATIONS)}")
    data = parse_yaml(text, f"--conv_template {name_or_path}")
    if isinstance(data, dict):
        sections = {name: data.pop(name, None) or {} for name in TOKENIZATIONS}
        override = sections[tokenization]
        if not isinstance(override, dict):
            raise ConfigError(f"template {name_or_path}: section {tokenization!r} must be a mapping")
        data = {**data, **override}
        if name_or_path in TEMPLATE_ALIASES and not path.suffix:
            data["name"] = name_or_path
    return _parse_template(data, source=str(name_or_path))


def render(
    template: Template, turns: tuple[Turn, ...], system: str | None = None, record_system: str | None = None
) -> list[Piece]:
    """Turns (starting with a user turn, alternating) -> pieces in sequence order.

    ``system`` (--system_prompt) replaces the template's system prompt, as template text;
    ``record_system`` (a record's own, for templates that read it) replaces both, as conversation text."""
    if template.one_round_only or template.requires_image:
        _check_shape(template, turns)
    trim = str.strip if template.trim_messages else str
    if record_system is not None:
        system_pieces = [Piece("content", trim(record_system), False)] if trim(record_system) else []
    else:
        system_pieces = list(_text_pieces(trim(template.system if system is None else system), False))
    with_system = bool(system_pieces) or template.system_when_empty
    pieces: list[Piece] = []
    if template.bos:
        pieces.append(Piece("special", "bos", False))
    if with_system and template.system_placement == "before_first_turn":
        _add_system(pieces, template, system_pieces)
    for position, turn in enumerate(turns):
        if turn.role == "user":
            if position:
                _add_text(pieces, template.round_separator, trained=False)
            first = position == 0 and template.first_user_prefix is not None
            _add_text(pieces, template.first_user_prefix if first else template.user.prefix, trained=False)
            if position == 0 and with_system and template.system_placement == "in_first_user":
                _add_system(pieces, template, system_pieces)
            text = turn.text.strip() if template.strip_user_content else trim(turn.text)
            _add_content(pieces, text, images_only=template.user_content == "images_only")
            _add_text(pieces, template.user.suffix, trained=False)
        else:
            _add_text(pieces, template.assistant.prefix, trained=False)
            _add_text(pieces, template.assistant.lead, trained=True)
            if trim(turn.text):
                pieces.append(Piece("content", trim(turn.text), True))
            _add_text(pieces, template.assistant.suffix, trained=True)
    if template.strip_end:
        _strip_end(pieces)
    return pieces


def _check_shape(template: Template, turns: tuple[Turn, ...]) -> None:
    if template.one_round_only and len(turns) != 2:
        raise RecordError(
            "plain_record_shape", f"{len(turns)} turns: template {template.name} takes one human turn and one answer"
        )
    if template.requires_image and not any(IMAGE_PLACEHOLDER in t.text for t in turns if t.role == "user"):
        raise RecordError("plain_record_shape", f"no <image>: template {template.name} captions an image")


def _add_system(pieces: list[Piece], template: Template, system_pieces: list[Piece]) -> None:
    """The system block: the template's prefix and suffix around the prompt's pieces (a record's
    own prompt is content: a special token typed in it is spelled as text, ``{eos}`` is literal)."""
    _add_text(pieces, template.system_prefix, trained=False)
    pieces.extend(system_pieces)
    _add_text(pieces, template.system_suffix, trained=False)


def _add_content(pieces: list[Piece], text: str, images_only: bool) -> None:
    """A user turn's text, each <image> (or <video>: a clip is a visual item of its own run) an image piece."""
    parts = PLACEHOLDERS.split(text)
    images_only = images_only and len(parts) > 1
    for k, part in enumerate(parts):
        if k:
            pieces.append(Piece("image", "", False))
        if part and not images_only:
            pieces.append(Piece("content", part, False))


def _strip_end(pieces: list[Piece]) -> None:
    while pieces and pieces[-1].kind in ("text", "content"):
        last = pieces.pop()
        value = last.value.rstrip()
        if value:
            pieces.append(Piece(last.kind, value, last.trained))
            return


def _add_text(pieces: list[Piece], text: str, trained: bool) -> None:
    """Append text, turning ``{bos}``/``{eos}`` into special pieces."""
    if text:
        pieces.extend(_text_pieces(text, trained))


@functools.lru_cache(maxsize=1024)
def _text_pieces(text: str, trained: bool) -> tuple[Piece, ...]:
    """The pieces of one template string, split once: a template has a handful of strings and
    every record renders them again (pieces are immutable, so shared)."""
    pieces = []
    position = 0
    for match in _SPECIAL_REFERENCE.finditer(text):
        if match.start() > position:
            pieces.append(Piece("text", text[position : match.start()], trained))
        pieces.append(Piece("special", match.group(1), trained))
        position = match.end()
    if position < len(text):
        pieces.append(Piece("text", text[position:], trained))
    return tuple(pieces)


def _parse_template(data, source: str) -> Template:
    if not isinstance(data, dict):
        raise ConfigError(f"template {source}: expected a mapping at the top level")
    unknown = set(map(str, data)) - _TEMPLATE_KEYS
    if unknown:
        raise ConfigError(f"template {source}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TEMPLATE_KEYS)}")
    roles = {}
    for role in ("user", "assistant"):
        spec = data.get(role) or {}
        if not isinstance(spec, dict) or set(map(str, spec)) - _ROLE_KEYS:
            raise ConfigError(f"template {source}: {role} must be a mapping with keys {sorted(_ROLE_KEYS)}")
        roles[role] = RoleFormat(**{key: _text(spec, key, "", f"{source}: {role}") for key in spec})
    placement = _text(data, "system_placement", "before_first_turn", source)
    if placement not in ("before_first_turn", "in_first_user"):
        raise ConfigError(f"template {source}: system_placement {placement!r} must be before_first_turn or in_first_user")
    user_content = _text(data, "user_content", "text", source)
    if user_content not in ("text", "images_only"):
        raise ConfigError(f"template {source}: user_content {user_content!r} must be text or images_only")
    first_user_prefix = _text(data, "first_user_prefix", None, source)
    return Template(
        name=_text(data, "name", Path(source).stem, source),
        description=_text(data, "description", "", source),
        bos=_flag(data, "bos", source),
        system=_text(data, "system", "", source),
        system_placement=placement,
        system_prefix=_text(data, "system_prefix", "", source),
        system_suffix=_text(data, "system_suffix", "", source),
        user=roles["user"],
        assistant=roles["assistant"],
        user_content=user_content,
        system_when_empty=_flag(data, "system_when_empty", source),
        system_from_record=_flag(data, "system_from_record", source),
        first_user_prefix=first_user_prefix,
        round_separator=_text(data, "round_separator", "", source),
        strip_user_content=_flag(data, "strip_user_content", source),
        strip_end=_flag(data, "strip_end", source),
        trim_messages=_flag(data, "trim_messages", source),
        one_round_only=_flag(data, "one_round_only", source),
        requires_image=_flag(data, "requires_image", source),
        image_patch_token=_text(data, "image_patch_token", None, source),
    )


def _text(data: dict, key: str, default, source: str):
    """A text setting: a YAML string (a number is read as its text, as YAML users expect of
    ``name: 1``); a list, mapping or boolean is refused, naming the key."""
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"template {source}: {key} {value!r:.60}: expected text, got {type(value).__name__}")
    value = str(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # YAML's "\ud800" escape: no tokenizer can take it
        raise ConfigError(f"template {source}: {key} {value!r:.60}: holds a lone UTF-16 surrogate, which is not text") from None
    return value


def _flag(data: dict, key: str, source: str) -> bool:
    """A yes/no setting: a YAML boolean only (``bool("false")`` would be True)."""
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"template {source}: {key} {value!r:.60}: expected true or false, got {type(value).__name__}")
    return value


def _template_dir():
    return importlib.resources.files("neva_pack.yaml_templates")


def _is_template_file(name: str) -> bool:
    return name.endswith(".yaml") and name != "training_overrides.yaml"
