"""What a config field is to a user, declared once on the field: its flag, help text, --help section,
NeMo hparams key, allowed values and range. The command line, the hparams reader, the type checks
and the error messages are all generated from it.

    seed: int = option(0, help="seed of the packing algorithm (default {default})", group=NEMO,
                       hparams=None, minimum=0, maximum=MAX_SEED)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from neva_pack.core import ConfigError
from neva_pack.files import is_remote, location

NEMO = "NeMo preprocess_dataset.py flags"
OURS = "neva_pack flags"
TRAINING = "training-side flags (Megatron-Core THD)"
BUDGETS = "per-record budgets (a record over one is skipped, with its reason)"
GROUPS = (NEMO, OURS, TRAINING, BUDGETS)
"""The --help sections, in order. Flags of NEMO are NeMo's own, with NeMo's names and defaults."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """A field's user-facing side (the ``"option"`` entry of its dataclass metadata)."""

    help: str | Callable[[], str] | None
    """The flag's help text (``{default}`` is replaced by the field's default), or what builds it when
    asked (help made from a registry); None: no flag, the field is set only by the hparams file or
    the Python API."""
    group: str = OURS
    """The --help section listing the flag."""
    hparams: tuple[str, ...] | None = None
    """The NeMo YAML key path that sets the field too (``model.data.data_path`` -> its parts)."""
    choices: Callable[[], Iterable[str]] | None = None
    """The allowed values (a callable: registries are read when asked)."""
    minimum: int | float | None = None
    maximum: int | float | None = None
    maximum_words: str | None = None
    """How the maximum is written in an error (``2**63 - 1`` reads better than its digits)."""
    flag: str | None = None
    """The flag when it is not ``--<name>``: a boolean default True is turned off by it (``--no_truncate``)."""
    metavar: str | None = None
    fingerprint: str | None = None
    """Sample fields: the key of the sample fingerprint holding the value (several fields may share
    one: a list, in field order); "" leaves the field out (it checks, it does not decide a sample)."""
    fingerprint_when_set: bool = False
    """Sample fields: in the fingerprint only when not None (an option a store made without it never
    had, so such a store's fingerprint stays what it was)."""
    location: bool = False
    """Sample fields: the value names a file or a setting by location or name, not by content (a
    sharded run's content fingerprint replaces it by a digest of what it designates)."""
    written_as: str | None = None
    """A setting that decides the bytes of a written prefix: the meta field recording it ("" when
    only the stats file does). Resume compares these (``PreprocessConfig.write_settings``)."""
    remote: bool = False
    """Path fields: an ``s3://`` URL is accepted (kept as the str it is; ``files.remote``)."""


def option(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **spec) -> Any:
    """A dataclass field carrying its ``Option`` (the keyword arguments besides the default)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"option": Option(**spec)})


def nested(cls: type) -> Any:
    """A dataclass field holding a group of settings, itself a config of option fields (the record
    budgets): each of its settings is one of the outer config's, by its own name and flag."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls})


def options(cls_or_instance) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Each setting of a config with its Option, in declaration order (a nested group's in its place)."""
    for spec in dataclasses.fields(cls_or_instance):
        group = spec.metadata.get("nested")
        if group is not None:
            yield from options(group)
        else:
            yield spec, spec.metadata["option"]


def value_of(config, name: str) -> Any:
    """The value of setting ``name`` of a config instance, also one of a nested group."""
    for spec in dataclasses.fields(config):
        if spec.name == name:
            return getattr(config, name)
        group = spec.metadata.get("nested")
        if group is not None and any(inner.name == name for inner, _ in options(group)):
            return value_of(getattr(config, spec.name), name)
    raise AttributeError(f"{type(config).__name__} has no setting {name!r}")


def build(cls: type, values: dict) -> Any:
    """``cls`` made from settings by name: a nested group's settings gathered into its own config (or
    the group given whole, by its field's name)."""
    direct = {}
    for spec in dataclasses.fields(cls):
        group = spec.metadata.get("nested")
        if group is None or spec.name in values:
            if spec.name in values:
                direct[spec.name] = values[spec.name]
            continue
        inner = {s.name: values[s.name] for s, _ in options(group) if s.name in values}
        if inner:
            direct[spec.name] = build(group, inner)
    unknown = sorted(set(values) - set(direct) - {s.name for s, _ in options(cls)})
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown setting {unknown[0]!r}")
    return cls(**direct)


def default_of(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return dataclasses.MISSING


def flag_of(spec: dataclasses.Field) -> str | None:
    """The field's flag (None: hparams-only)."""
    opt = spec.metadata["option"]
    if opt.help is None:
        return None
    return opt.flag or f"--{spec.name}"


def help_of(spec: dataclasses.Field) -> str:
    opt = spec.metadata["option"]
    text = opt.help() if callable(opt.help) else opt.help
    return text.replace("{default}", str(default_of(spec)))


def hparams_key(spec: dataclasses.Field) -> str | None:
    opt = spec.metadata["option"]
    return ".".join(opt.hparams) if opt.hparams else None


def setting_name(spec: dataclasses.Field) -> str:
    """How a user sets a field, for error messages: its flag, and the hparams key that sets it too."""
    flag, key = flag_of(spec), hparams_key(spec)
    if flag is None:
        return f"hparams {key}" if key else spec.name
    return flag + (f" (or hparams {key})" if key else "")


_EXPECTED = {
    "Path": ("a path", lambda v: isinstance(v, Path) or is_remote(v)),  # PreprocessConfig(data_path=str) makes a str one
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple[int, int]": (
        "a list of 2 integers (height, width)",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_EXPECTED["int"][1](x) for x in v),
    ),
    "tuple[int, ...]": (
        "a list of integers",
        lambda v: isinstance(v, (list, tuple)) and all(_EXPECTED["int"][1](x) for x in v),
    ),
}
"""Annotation of a field -> (what it must be, in words; the test). Values from a YAML hparams file or
the Python API arrive untyped: a wrong type is refused at construction, naming the flag."""


def base_type(spec: dataclasses.Field) -> str:
    """The field's annotation without ``| None``."""
    return spec.type.removesuffix(" | None")


def check_fields(config) -> None:
    """ConfigError naming the flag, the value and what it must be, for the first field whose value
    has the wrong type, is not one of its choices, or is out of its range."""
    for spec, opt in options(config):
        value = value_of(config, spec.name)
        if value is None and base_type(spec) != spec.type:
            continue
        if is_remote(value) and not opt.remote:
            raise ConfigError(f"{setting_name(spec)} {value}: a local path is needed here (object storage is read for "
                              "--data_path, --image_folder and --output_dir); copy it to a local disk")  # fmt: skip
        words, test = _EXPECTED[base_type(spec)]
        if not test(value):
            raise ConfigError(f"{setting_name(spec)} {value!r:.60}: expected {words}, got {type(value).__name__}")
        if opt.choices is not None and value not in (allowed := list(opt.choices())):
            raise ConfigError(f"{flag_of(spec) or setting_name(spec)} {value!r}: choose one of {', '.join(allowed)}")
        low, high = opt.minimum, opt.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            name = flag_of(spec) or setting_name(spec)
            if high is None:
                raise ConfigError(f"{name} {value}: must be >= {low}")
            raise ConfigError(f"{name} {value}: must be between {low} and {opt.maximum_words or f'{high:,}'}")


def as_field_value(spec: dataclasses.Field, value: Any) -> Any:
    """A value as the Python API, a YAML file or argparse hands it, in the field's own type when it
    is one in spirit (a str path, a list for a tuple); anything else is left for ``check_fields``."""
    kind = base_type(spec)
    if kind == "Path" and isinstance(value, (str, os.PathLike)):
        return location(value)  # an s3:// URL stays a str (a Path would collapse its //)
    if kind.startswith("tuple[") and isinstance(value, list):
        return tuple(value)
    return value


__all__ = [
    "BUDGETS", "GROUPS", "NEMO", "OURS", "TRAINING", "Option", "as_field_value", "base_type", "build", "check_fields",
    "default_of", "flag_of", "help_of", "hparams_key", "nested", "option", "options", "setting_name", "value_of",
]  # fmt: skip
