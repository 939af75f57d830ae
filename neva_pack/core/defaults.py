"""Defaults that more than one module uses, each written once here.

A setting's own default is written where the setting is declared (``neva_pack.config``); a value
lands here when readers, writers and training-side helpers need it too.
"""

VERSION = "0.1.0"
"""This package's version (pyproject.toml says the same): written into every meta and progress file."""

IGNORE_INDEX = -1
"""Label of untrained positions: the value NeMo's collate masks (and PyTorch's cross entropy skips
when told), so a pack written with it trains unchanged in NeMo."""

PAD_ID = 0
"""Token id of alignment padding and of the padding a collate adds between packs."""

__all__ = ["IGNORE_INDEX", "PAD_ID", "VERSION"]
