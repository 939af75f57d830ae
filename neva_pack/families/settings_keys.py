"""Encoder settings checked key by key: what each key a family reads may hold (type, range, shape),
declared as ``Setting``\\ s, and one line naming the file and the key for a value outside them.

A checkpoint's preprocessor_config.json, config.json and processor_config.json are files we did not
write. Every key a family reads from them is declared here (the keys all families read alike,
``COMMON_SETTINGS``) or in the family's module (its ``settings_keys`` and ``model_keys``), and is
checked before any record is read, so that no value reaches a worker as a ``ZeroDivisionError``, a
hang over a grid of 2**62 tiles, an allocation of a 10**9-pixel crop, or pixels normalised to
infinity. The bounds are far outside every released checkpoint's values and inside what a run can
hold; a value JSON can spell but no number is (``NaN``, ``1e999``) is refused wherever a number goes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neva_pack.core import ConfigError

__all__ = [
    "COMMON_SETTINGS", "MAX_AREA", "MAX_PATCH", "MAX_SIDE", "Setting", "check_keys", "choice", "flag", "is_int", "is_number",
    "number", "numbers", "refuse", "size_sides", "whole",
]  # fmt: skip

MAX_SIDE = 4096
"""Most pixels on a side of a crop or tile: 9 times a CLIP crop (448 at most in any release); a 4096²
crop is 16.7 megapixels, under the default image budget of 36."""

MAX_AREA = 1 << 30
"""Most pixels of an area setting (a Qwen2-VL ``max_pixels``: 12,845,056, Qwen3-VL's 16,777,216); an
image over the run's pixel budget is skipped anyway, this keeps the arithmetic on it ordinary."""

MAX_PATCH = 64
"""Most pixels on a side of a vision transformer patch (14 or 16 in every release)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One key of a settings file: what it must hold, as a test and as words for the one line."""

    key: str
    expected: str
    """What the key holds, as the refusal says it ("an integer from 1 to 8")."""
    ok: Callable[[Any], bool]


def check_keys(settings: dict, path, keys: tuple[Setting, ...]) -> None:
    """ConfigError, one line naming ``path`` and the key, for the first key of ``keys`` present in
    ``settings`` with a value its declaration refuses."""
    for setting in keys:
        if setting.key in settings and not setting.ok(settings[setting.key]):
            refuse(path, setting.key, settings[setting.key], setting.expected)


def refuse(path, key: str, value, expected: str):
    """The one line of a settings value refused (ConfigError)."""
    raise ConfigError(f"{path}: {key} {value!r:.60}: expected {expected}, got {type(value).__name__}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or a finite float (not a bool, not NaN or infinity)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def whole(key: str, low: int, high: int, what: str = "") -> Setting:
    """An integer from ``low`` to ``high`` (a float, even 2.0, is refused: the processors take ints)."""
    return Setting(key, f"an integer from {low:,} to {high:,}{what}", lambda v: is_int(v) and low <= v <= high)


def number(key: str, low: float, high: float, *, above: bool = False, what: str = "") -> Setting:
    """A finite number from ``low`` (or above it) to ``high``."""
    lowest = "above" if above else "from"
    return Setting(key, f"a number {lowest} {low:g} to {high:g}{what}",
                   lambda v: is_number(v) and (v > low if above else v >= low) and v <= high)  # fmt: skip


def numbers(key: str, count: int, low: float, high: float, what: str) -> Setting:
    """A list of ``count`` finite numbers, each from ``low`` to ``high``."""
    return Setting(key, f"a list of {count} numbers from {low:g} to {high:g} ({what})",
                   lambda v: isinstance(v, list) and len(v) == count and all(is_number(x) and low <= x <= high for x in v))  # fmt: skip


def flag(key: str) -> Setting:
    return Setting(key, "true or false", lambda v: isinstance(v, bool))


def choice(key: str, options: tuple) -> Setting:
    return Setting(key, f"one of {', '.join(map(repr, options))}", lambda v: type(v) in {type(o) for o in options} and v in options)


_SIZE_KEYS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"longest_edge"},
              {"max_height", "max_width"}, {"min_pixels", "max_pixels"})  # fmt: skip
"""The key sets transformers' image processors accept in a size (any other is its ValueError in a worker)."""


def _is_size(value) -> bool:
    if is_int(value):
        return 0 < value <= MAX_AREA
    return isinstance(value, dict) and set(value) in _SIZE_KEYS and all(is_int(v) and 0 < v <= MAX_AREA for v in value.values())


def size_sides(key: str, high: int = MAX_SIDE) -> Setting:
    """A size whose every value is a side in pixels (a fixed crop's, a tile's): at most ``high``."""
    return Setting(key, f"sides from 1 to {high:,} pixels",
                   lambda v: all(is_int(x) and 0 < x <= high for x in (v.values() if isinstance(v, dict) else [v])))  # fmt: skip


_SIZE = "a positive integer or an object of positive integers (at most 2**30): height and width, shortest_edge and/or longest_edge, max_height and max_width, or min_pixels and max_pixels"

COMMON_SETTINGS = (
    Setting("image_processor_type", "a class name", lambda v: isinstance(v, str)),
    Setting("size", _SIZE, _is_size),
    Setting("crop_size", _SIZE, _is_size),
    *(flag(key) for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb", "do_pad")),
    whole("resample", 0, 5, " (a PIL resampling filter)"),
    number("rescale_factor", 1e-6, 1, what=" (1/255 scales pixels to 0..1)"),
    numbers("image_mean", 3, 0, 1, "one per RGB channel, the mean of pixels scaled to 0..1"),
    numbers("image_std", 3, 1e-3, 1e3, "one per RGB channel: pixels are divided by them"),
)
"""The keys every family reads alike (registry.check_settings runs them on every settings file)."""
