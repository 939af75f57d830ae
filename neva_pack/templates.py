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

import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from neva_pack.errors import ConfigError
from neva_pack.records import IMAGE_PLACEHOLDER, Turn

_SPECIAL_REFERENCE = re.compile(r"\{(bos|eos)\}")
_TEMPLATE_KEYS = {
    "name", "description", "bos", "system", "system_placement", "system_prefix", "system_suffix",
    "user", "assistant", "user_content",
}  # fmt: skip
_ROLE_KEYS = {"prefix", "suffix"}


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleFormat:
    prefix: str = ""
    """Text before the turn's content (never trained)."""
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
    """``images_only`` keeps only the <image> placeholders of human turns (LLaVA ``plain``)."""


@dataclass(frozen=True, slots=True)
class Piece:
    kind: Literal["text", "special", "image"]
    """Text to tokenize, a special token named by ``value`` ("bos"/"eos"), or one image."""
    value: str
    """The text, or the special token's name; empty for an image."""
    trained: bool
    """Whether the tokens of this piece are label targets."""


def available_templates() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in _template_dir().iterdir() if _is_template_file(p.name))


def load_template(name_or_path: str) -> Template:
    """A registry name (``v1``) or a path to a YAML file of the same schema."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text = path.read_text(encoding="utf-8")
    else:
        resource = _template_dir() / f"{name_or_path}.yaml"
        if not _is_template_file(resource.name) or not resource.is_file():
            raise ConfigError(
                f"--conv_template {name_or_path!r}: unknown template; choose one of "
                f"{', '.join(available_templates())} or give a .yaml file"
            )
        text = resource.read_text(encoding="utf-8")
    return _parse_template(yaml.safe_load(text), source=str(name_or_path))


def render(template: Template, turns: tuple[Turn, ...], system: str | None = None) -> list[Piece]:
    """Turns (starting with a user turn, alternating) -> pieces in sequence order."""
    system_prompt = template.system if system is None else system
    pieces: list[Piece] = []
    if template.bos:
        pieces.append(Piece("special", "bos", False))
    if system_prompt and template.system_placement == "before_first_turn":
        _add_text(pieces, template.system_prefix + system_prompt + template.system_suffix, trained=False)
    for position, turn in enumerate(turns):
        if turn.role == "user":
            _add_text(pieces, template.user.prefix, trained=False)
            if position == 0 and system_prompt and template.system_placement == "in_first_user":
                _add_text(pieces, template.system_prefix + system_prompt + template.system_suffix, trained=False)
            _add_content(pieces, turn.text, images_only=template.user_content == "images_only")
            _add_text(pieces, template.user.suffix, trained=False)
        else:
            _add_text(pieces, template.assistant.prefix, trained=False)
            _add_text(pieces, turn.text, trained=True)
            _add_text(pieces, template.assistant.suffix, trained=True)
    return pieces


def _add_content(pieces: list[Piece], text: str, images_only: bool) -> None:
    parts = text.split(IMAGE_PLACEHOLDER)
    for k, part in enumerate(parts):
        if k:
            pieces.append(Piece("image", "", False))
        if not images_only:
            _add_text(pieces, part, trained=False)


def _add_text(pieces: list[Piece], text: str, trained: bool) -> None:
    """Append text, turning ``{bos}``/``{eos}`` into special pieces."""
    position = 0
    for match in _SPECIAL_REFERENCE.finditer(text):
        if match.start() > position:
            pieces.append(Piece("text", text[position : match.start()], trained))
        pieces.append(Piece("special", match.group(1), trained))
        position = match.end()
    if position < len(text):
        pieces.append(Piece("text", text[position:], trained))


def _parse_template(data, source: str) -> Template:
    if not isinstance(data, dict):
        raise ConfigError(f"template {source}: expected a mapping at the top level")
    unknown = set(data) - _TEMPLATE_KEYS
    if unknown:
        raise ConfigError(f"template {source}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TEMPLATE_KEYS)}")
    roles = {}
    for role in ("user", "assistant"):
        spec = data.get(role) or {}
        if not isinstance(spec, dict) or set(spec) - _ROLE_KEYS:
            raise ConfigError(f"template {source}: {role} must be a mapping with keys {sorted(_ROLE_KEYS)}")
        roles[role] = RoleFormat(prefix=str(spec.get("prefix", "")), suffix=str(spec.get("suffix", "")))
    placement = data.get("system_placement", "before_first_turn")
    if placement not in ("before_first_turn", "in_first_user"):
        raise ConfigError(f"template {source}: system_placement {placement!r} must be before_first_turn or in_first_user")
    user_content = data.get("user_content", "text")
    if user_content not in ("text", "images_only"):
        raise ConfigError(f"template {source}: user_content {user_content!r} must be text or images_only")
    return Template(
        name=str(data.get("name", Path(source).stem)),
        description=str(data.get("description", "")),
        bos=bool(data.get("bos", False)),
        system=str(data.get("system", "")),
        system_placement=placement,
        system_prefix=str(data.get("system_prefix", "")),
        system_suffix=str(data.get("system_suffix", "")),
        user=roles["user"],
        assistant=roles["assistant"],
        user_content=user_content,
    )


def _template_dir():
    return importlib.resources.files("neva_pack.yaml_templates")


def _is_template_file(name: str) -> bool:
    return name.endswith(".yaml") and name != "training_overrides.yaml"
