"""What every format module provides, and the steps all of them share (checkpoint, publish).

A format module defines ``NAME``, a writer class, a reader class and ``check(reader, result)``
(the format's own structural checks, run by ``verify`` before the invariants every pack must
hold, which verify checks through the reader). ``formats.FORMATS`` maps the meta's ``format``
field to the module.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neva_pack.formats.meta import Normalisation, PackedMeta
from neva_pack.image_run import ImageRun
from neva_pack.sample_store.image_pool import PoolSegment
from neva_pack.store import checkpoint_paths, file_checksum, meta_path, relative_name, tmp_prefix, write_json_atomic


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteSpec:
    """What a writer needs to know before the first pack."""

    image_shape: tuple[int, int, int]
    """(3, H, W) of every image."""
    normalisation: Normalisation
    """How uint8 pixels become the model's float input (formats storing floats apply it)."""
    pad_id: int
    """Token id written on padding positions."""
    ignore_index: int
    """Label written on padding positions."""
    pool: tuple[PoolSegment, ...]
    """The image pool the packs' image indices refer to (the sample store's pool segments)."""
    plan_digest: str
    """Identifies the plan and the settings it is written with: a checkpoint of another is not resumed
    (the pipeline's digest is JSON, ``{"plan": ..., "settings": ...}``, so that a resume can name the
    setting that differs)."""
    image_run: ImageRun
    """The token ids of one image's run of positions (formats may store it once instead of per image)."""


class Checkpoint:
    """The writer's checkpoint file: durable state arrays next to the temporary prefix."""

    def __init__(self, prefix: Path, plan_digest: str):
        self.tmp = tmp_prefix(prefix)
        self.path, self.staging = checkpoint_paths(prefix)
        self.plan_digest = plan_digest

    def load(self, files: list[Path]) -> dict | None:
        """The saved state, if it belongs to this plan and every file is at least as long as saved."""
        if not self.path.is_file() or not all(f.is_file() for f in files):
            return None
        with np.load(self.path) as state:
            if str(state["plan_digest"]) != self.plan_digest:
                return None
            data = {key: state[key] for key in state.files}
        for k, f in enumerate(files):
            if f.stat().st_size < int(data["bytes"][k]):
                return None
        return data

    def saved_digest(self) -> str | None:
        """The digest the checkpoint was saved with; None without a checkpoint, or an unreadable one."""
        if not self.path.is_file():
            return None
        try:
            with np.load(self.path) as state:
                return str(state["plan_digest"])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            return None

    def save(self, open_files: list, **arrays) -> None:
        sizes = []
        for f in open_files:
            f.flush()
            os.fsync(f.fileno())
            sizes.append(f.tell())
        np.savez(self.staging, bytes=np.asarray(sizes, dtype=np.int64), plan_digest=np.str_(self.plan_digest), **arrays)
        os.replace(self.staging, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def publish(
    prefix: Path, renames: dict[Path, Path], checksummed: list[Path], meta: PackedMeta, known: dict[Path, str] | None = None
) -> PackedMeta:  # fmt: skip
    """Checksum, rename the temporary files into place, write the meta last. Returns the meta written.

    ``renames``: final path -> temporary path; ``checksummed``: other files the output consists of;
    ``known``: (temporary or other) path -> checksum computed while it was written (not read again).
    """
    output_dir = Path(prefix).parent
    known = known or {}
    checksums = {relative_name(output_dir, final): known.get(tmp) or file_checksum(tmp) for final, tmp in renames.items()}
    checksums.update({relative_name(output_dir, path): known.get(path) or file_checksum(path) for path in checksummed})
    for final, tmp in renames.items():
        os.replace(tmp, final)
    meta = meta.replace(checksums=checksums)
    write_json_atomic(meta_path(prefix), meta.to_json())
    return meta
