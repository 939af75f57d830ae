"""Every knob of a preprocess run, split by concern and validated at construction.

    SampleConfig   what makes a sample (its fingerprint: what the sample store must match to resume)
    PackConfig     what makes a pack (the writing settings a published prefix records in its meta)
    RunConfig      how to run (paths, workers, resume / overwrite, skips, checkpoints, shards)
    PreprocessConfig   the three together: what ``preprocess(config)`` takes

Each field declares its flag, help, NeMo hparams key and allowed values (``options.option``): the
command line and the hparams reader are generated from them. Built from NeMo's flags, our own
flags, and/or a NeMo-style YAML hparams file: field defaults (NeMo's for NeMo's flags) < hparams
file < explicit flags. No field is changed after construction; what depends on several fields
(the pack sizes, the alignment, the length samples are cut to) is a property.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from neva_pack.config.hparams import NEMO_SECTION_KEYS, read_hparams as _read_yaml
from neva_pack.config.options import (
    GROUPS, NEMO, OURS, Option, as_field_value, base_type, default_of, flag_of, help_of, options
)
from neva_pack.config.pack import MAX_SEED, PackConfig
from neva_pack.config.run import RunConfig, default_workers, max_workers
from neva_pack.config.sample import IMAGE_ASPECT_RATIOS, SampleConfig
from neva_pack.core import ConfigError
from neva_pack.formats import FORMATS


PARTS = {"sample": SampleConfig, "pack": PackConfig, "run": RunConfig}
"""PreprocessConfig's attribute -> the part's class, in the order flags are listed."""


@dataclass(frozen=True, slots=True, init=False)
class PreprocessConfig:
    """The three parts of a run's config. Build it from the parts, or from the settings by name as
    the command line has them (each routed to the part declaring it; a str path becomes a Path, a
    list a tuple)::

        PreprocessConfig(sample=SampleConfig(...), pack=PackConfig(...), run=RunConfig(...))
        PreprocessConfig(data_path=..., tokenizer_path=..., output_dir=..., seed=3)

    Every field of a part also reads through the whole: ``config.seed`` is ``config.pack.seed``
    (field names are unique across the parts), for whoever holds a config in hand (the Python API,
    tests). The pipeline says which part it reads (``config.pack.seed``): its stages are handed a
    part, or less, never the whole.
    """

    sample: SampleConfig
    pack: PackConfig
    run: RunConfig

    def __init__(
        self, *, sample: SampleConfig | None = None, pack: PackConfig | None = None, run: RunConfig | None = None,
        **settings,
    ):  # fmt: skip
        parts = {"sample": sample, "pack": pack, "run": run}
        if settings:
            if any(part is not None for part in parts.values()):
                raise TypeError("PreprocessConfig: give either the parts or settings by name, not both")
            parts = _parts_of(settings)
        for name, part in parts.items():
            if not isinstance(part, PARTS[name]):
                raise TypeError(f"PreprocessConfig: {name} must be a {PARTS[name].__name__}, got {type(part).__name__}")
            object.__setattr__(self, name, part)
        self._check()

    def _check(self) -> None:
        """What no single part can check on its own."""
        output_format = FORMATS[self.pack.output_format]
        output_format.check_settings(ignore_index=self.sample.ignore_index)  # the largest label it stores exactly
        if self.run.drop_store and output_format.uses_image_pool:
            raise ConfigError(f"--drop_store: the {output_format.name} output's images ARE the sample store's pool; nothing to drop")

    @classmethod
    def field_names(cls) -> set[str]:
        """Every setting's name (the fields of the parts)."""
        return set(_FIELDS)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.pack.sizes

    @property
    def alignment(self) -> int:
        return self.pack.alignment

    @property
    def cut_length(self) -> int:
        return self.pack.cut_length

    def sample_fingerprint(self) -> dict:
        """Everything that decides the samples: ``SampleConfig.fingerprint`` at this run's cut, and whether
        the output format holds images (a text-only format skips the records that have some)."""
        fingerprint = self.sample.fingerprint(self.pack.cut_length)
        if not FORMATS[self.pack.output_format].holds_images:  # absent otherwise: stores made before it resume
            fingerprint["text_only"] = True
        return fingerprint

    def write_settings(self, size: int) -> dict:
        """Every setting that decides the bytes of one pack size's published files beyond the samples
        (the fields declaring ``written_as``): a resumed prefix, finished or not, must have been
        written with exactly these. The size is the prefix's own; the alignment is the lcm of the
        padding flags; the step cost model counts only when the packs are balanced."""
        derived = {"max_seq_length": size, "pad_to_multiple_of": self.pack.alignment,
                   "step_cost_model": self.pack.step_cost_model if self.pack.balance_data_parallel else None}  # fmt: skip
        return {
            spec.name: derived.get(spec.name, getattr(part, spec.name))
            for part in (self.pack, self.sample)
            for spec, opt in options(part)
            if opt.written_as is not None
        }

    def meta_settings(self, size: int) -> dict:
        """The writing settings by the meta field recording each (``PackedMeta`` keywords)."""
        names = meta_fields()
        return {names[key]: value for key, value in self.write_settings(size).items() if key in names}


def _parts_of(settings: dict) -> dict:
    routed = {name: {} for name in PARTS}
    for name, value in settings.items():
        part, spec = _FIELDS.get(name, (None, None))
        if part is None:
            raise TypeError(f"PreprocessConfig: unknown setting {name!r}")
        routed[part][name] = as_field_value(spec, value)
    return {part: PARTS[part](**values) for part, values in routed.items()}


def _collect_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    found = {}
    for part, cls in PARTS.items():
        for spec, _ in options(cls):
            if spec.name in found:
                raise TypeError(f"field {spec.name} is declared by two parts of PreprocessConfig")
            found[spec.name] = (part, spec)
    return found


_FIELDS = _collect_fields()


def _read_through(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=f"``{part}.{name}``")


for _name, (_part, _) in _FIELDS.items():
    setattr(PreprocessConfig, _name, _read_through(_part, _name))


def settings() -> Iterator[tuple[dataclasses.Field, Option]]:
    """Every setting's field and Option, part by part (sample, pack, run), in declaration order."""
    for cls in PARTS.values():
        yield from options(cls)


def required_settings() -> list[str]:
    """Settings without a default: a run needs them (from a flag or the hparams file)."""
    return [spec.name for spec, _ in settings() if default_of(spec) is dataclasses.MISSING]


def hparams_keys() -> dict[tuple[str, ...], str]:
    """NeMo YAML key path -> the setting it sets."""
    return {opt.hparams: spec.name for spec, opt in settings() if opt.hparams}


def meta_fields() -> dict[str, str]:
    """Writing setting -> the meta field recording it (the others are in the stats file only)."""
    return {spec.name: opt.written_as for spec, opt in settings() if opt.written_as}


def read_hparams(path: Path) -> dict:
    """The settings a NeMo-style YAML sets (``Option.hparams``), by setting name."""
    return _read_yaml(path, hparams_keys())

__all__ = [
    "GROUPS",
    "IMAGE_ASPECT_RATIOS",
    "MAX_SEED",
    "NEMO",
    "NEMO_SECTION_KEYS",
    "OURS",
    "Option",
    "PARTS",
    "PackConfig",
    "PreprocessConfig",
    "RunConfig",
    "SampleConfig",
    "as_field_value",
    "base_type",
    "default_workers",
    "flag_of",
    "help_of",
    "hparams_keys",
    "max_workers",
    "meta_fields",
    "options",
    "read_hparams",
    "required_settings",
    "settings",
]
