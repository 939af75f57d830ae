"""The run's inputs by content: what a resume must find unchanged, and what must not change while a run reads it.

One digest per input flag, computed when the run starts, recorded in the sample store (a sharded
run's parts record them in their content fingerprint), compared by ``--resume`` and computed again
right before each prefix is published: an input that differs is refused in one line naming its flag,
and nothing is published.

    --data_path          xxh3-128 of the file's bytes (exact: an edit in place with size and mtime
                         put back is caught)
    --image_folder       a .tar: every member's header block as the archive holds it (name, type,
                         size, mtime, mode, owner, link target; long-name and pax records too), in
                         order, so a rebuilt or edited archive differs; no byte of image data is read. A directory: each regular
                         file's relative name, size and mtime (one stat per file, no image read).
                         Both are cheap next to decoding the images, and stable across mount points
                         and copies that keep mtimes (rsync -a, cp -p). Not caught: image bytes
                         changed in place with their size and mtime (or tar header) put back.
    --conv_template      the template as loaded (a shipped name or a YAML file, the
                         --tokenization section applied), its name left out
    --tokenizer_path     a file's bytes; a directory's top-level files by name and bytes
    --hf_vision_encoder  the resolved encoder settings (processor, preprocessor_config, patch size,
                         model config), as read from a directory's files or the shipped record
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from neva_pack.config import SampleConfig
from neva_pack.core import ConfigError, InputError
from neva_pack.files import file_checksum

__all__ = [
    "INPUTS_KEY", "changed_input", "check_resumed_inputs", "check_unchanged", "input_digests", "text_digest", "tokenizer_digest",
]  # fmt: skip

INPUTS_KEY = "inputs"
"""The key under which the sample store's progress file records the digests (a store written before
them lacks it, and resumes as it did)."""


def input_digests(sample: SampleConfig, data_digest: str | None = None, exclude: Path | None = None) -> dict[str, str | None]:
    """The digest of each input, by flag (None: the input is not given). ``data_digest``: the data
    file's, where the caller computed it already. ``exclude``: the run's output directory, left out of
    an image folder that holds it (what the run writes there is not its input)."""
    digests = {flag: digest(sample, exclude) for flag, digest in _DIGESTS.items()}
    if data_digest is not None:
        digests["data_path"] = data_digest
    return digests


def changed_input(sample: SampleConfig, started: dict[str, str | None], exclude: Path | None = None) -> str | None:
    """The first input (its flag) whose content differs from ``started`` (the digests the run started
    with); None when every one is unchanged. One gone or unreadable now has changed all the same."""
    for flag, digest in started.items():
        try:
            now = _DIGESTS[flag](sample, exclude)
        except (ConfigError, InputError, OSError):
            return flag
        if now != digest:
            return flag
    return None


def check_unchanged(sample: SampleConfig, started: dict[str, str | None], what: str, exclude: Path | None = None) -> None:
    """Before ``what`` is published: InputError naming the input that changed since the run started
    (``exclude`` as for ``input_digests``)."""
    flag = changed_input(sample, started, exclude)
    if flag is not None:
        raise InputError(f"--{flag} {getattr(sample, flag)}: changed while the run read it (its content differs from "
                         f"when the run started); {what} was not published: run again with --overwrite")  # fmt: skip


def check_resumed_inputs(store_directory: Path, progress: dict | None, current: dict[str, str | None]) -> None:
    """--resume of the sample store at ``store_directory`` (its ``progress``): every input it recorded
    must have the content it had then; InputError naming the first that differs. A store that recorded
    none (written before the digests were) resumes on its fingerprint, as it did."""
    stored = (progress or {}).get(INPUTS_KEY)
    if not isinstance(stored, dict):
        return
    for flag, digest in current.items():  # the data file's is the store's own input_digest (check_input)
        if flag != "data_path" and flag in stored and stored[flag] != digest:
            raise InputError(f"--resume: --{flag} holds other content than when the sample store in {store_directory} "
                             "was built (edited, rebuilt or replaced); run with --overwrite to start again")  # fmt: skip


def text_digest(text: str) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def tokenizer_digest(path: Path) -> str:
    """By content: a single file's bytes (not its name: the same .model copied under another name is
    the same tokenizer); a directory's files by their names inside it (tokenizer.json, ...) and bytes."""
    if not path.is_dir():
        return file_checksum(path)
    files = sorted(p for p in path.iterdir() if p.is_file())
    return text_digest(json.dumps([[p.name, file_checksum(p)] for p in files]))


def template_digest(sample: SampleConfig) -> str:
    from neva_pack.text import load_template

    template = load_template(sample.conv_template, sample.tokenization)
    fields = {k: v for k, v in dataclasses.asdict(template).items() if k != "name"}
    return text_digest(json.dumps(fields, sort_keys=True, default=str))


def encoder_digest(sample: SampleConfig) -> str:
    from neva_pack.families import resolve_encoder

    encoder = resolve_encoder(sample.hf_vision_encoder, sample.patch_dim)
    settings = [encoder.processor, encoder.preprocessor_config, encoder.patch_size, encoder.model_config]
    return text_digest(json.dumps(settings, sort_keys=True, default=str))


def image_folder_digest(folder: Path | None, exclude: Path | None = None) -> str | None:
    """The image folder's digest (the module's docstring); a directory ``exclude`` inside it (the
    run's output) is left out."""
    if folder is None:
        return None
    folder = Path(folder)
    if folder.is_file():
        return _tar_digest(folder)
    skipped = os.path.realpath(exclude) if exclude is not None else None
    entries = []
    for directory, subdirectories, files in os.walk(folder):
        subdirectories[:] = sorted(d for d in subdirectories if os.path.realpath(os.path.join(directory, d)) != skipped)
        for name in sorted(files):
            path = os.path.join(directory, name)
            try:
                stat = os.stat(path)
            except OSError:  # a dangling link: no image to read
                continue
            entries.append([os.path.relpath(path, folder), stat.st_size, stat.st_mtime_ns])
    return text_digest(json.dumps(entries))


def _tar_digest(path: Path) -> str:
    """Every member header block as the archive holds it (and the data of the blocks that extend a
    header: long names, pax records), the members' data skipped: one read per member."""
    import xxhash

    digest = xxhash.xxh3_128()
    try:
        with open(path, "rb") as f:
            while len(header := f.read(BLOCK)) == BLOCK and header != bytes(BLOCK):
                digest.update(header)
                field = header[124:136]
                size = int.from_bytes(field[1:], "big") if field[0] & 0x80 else int(field.strip(b"\0 ") or b"0", 8)
                blocks = -(-size // BLOCK) * BLOCK
                if header[156:157] in EXTENDED_HEADERS:
                    digest.update(f.read(blocks))
                else:
                    f.seek(blocks, os.SEEK_CUR)
    except (OSError, ValueError) as exc:
        raise InputError(f"--image_folder {path}: unreadable tar archive ({exc})") from None
    return digest.hexdigest()


BLOCK = 512
EXTENDED_HEADERS = (b"L", b"K", b"x", b"g")
"""Tar members whose data belongs to the next header (GNU long names and links, pax records)."""


_DIGESTS = {
    "data_path": lambda sample, exclude: file_checksum(Path(sample.data_path)),
    "image_folder": lambda sample, exclude: image_folder_digest(sample.image_folder, exclude),
    "conv_template": lambda sample, exclude: template_digest(sample),
    "tokenizer_path": lambda sample, exclude: tokenizer_digest(Path(sample.tokenizer_path)),
    "hf_vision_encoder": lambda sample, exclude: encoder_digest(sample),
}
"""How each input's digest is computed from the run's sample settings, by flag."""
