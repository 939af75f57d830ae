"""Which ids a fixed-length image run is written with, for a tokenizer and a tokenization convention:
NeMo's <extra_id_4>/<extra_id_5> delimited run where the tokenizer has them, else explicit ids; and
the checks that a run's ids, the pad id and the ignore index can be stored and trained as they mean.
(A family whose images each have their own length spells its run with the model's own tokens:
``base.model_image_run``.)
"""

from __future__ import annotations

from neva_pack.core import ConfigError, IGNORE_INDEX, ImageRun, PAD_ID
from neva_pack.text import DEFAULT_TOKENIZATION, TOKENIZATIONS, Tokenizer

__all__ = ["NEMO_IM_END", "NEMO_IM_START", "check_token_ids", "image_run_for", "missing_nemo_specials"]

NEMO_IM_START = "<extra_id_4>"
NEMO_IM_END = "<extra_id_5>"

def image_run_for(
    tokenizer: Tokenizer,
    encoder_tokens: int,
    use_im_start_end: bool = False,
    patch_id: int | None = None,
    start_id: int | None = None,
    end_id: int | None = None,
    tokenization: str = DEFAULT_TOKENIZATION,
    patch_token: str | None = None,
) -> ImageRun:
    """NeMo's image run when the convention is ``nemo`` and the tokenizer has <extra_id_4>/<extra_id_5>,
    else the given ids (LLaVA: N patch ids).

    NeMo: start + patch x (N - 2) + end (N positions), or start + patch x N + end with
    use_im_start_end. Without those tokens: N patch ids, with optional explicit start/end.
    The patch id is the given one, else ``patch_token``'s id under NeMo's image run (NeMo
    leaves <extra_id_3> in some templates), else 0.
    """
    nemo_run = False
    if start_id is None and end_id is None and TOKENIZATIONS[tokenization].auto_image_delimiters:
        start_id = tokenizer.token_to_id(NEMO_IM_START)
        end_id = tokenizer.token_to_id(NEMO_IM_END)
        if start_id is None or end_id is None:
            start_id = end_id = None
        nemo_run = start_id is not None
    if patch_id is None:
        token = tokenizer.token_to_id(patch_token) if patch_token is not None and nemo_run else None
        patch_id = 0 if token is None else token
    delimiters = (start_id is not None) + (end_id is not None)
    positions = encoder_tokens + delimiters if use_im_start_end or delimiters == 0 else encoder_tokens
    if positions - delimiters < 1:
        raise ConfigError(f"an image of {encoder_tokens} positions cannot hold its start/end tokens")
    return ImageRun(positions=positions, patch_id=patch_id, start_id=start_id, end_id=end_id)


def missing_nemo_specials(tokenizer: Tokenizer, tokenization: str, image_run: ImageRun) -> str | None:
    """Why an output cannot be NeMo's, or None: under the NeMo convention with a tokenizer that
    has no <extra_id_4>/<extra_id_5>, NeMo's model cannot find the images in the tokens."""
    if not TOKENIZATIONS[tokenization].auto_image_delimiters or image_run.start_id is not None or image_run.end_id is not None:
        return None
    return (
        f"tokenizer {tokenizer.name} has no {NEMO_IM_START}/{NEMO_IM_END}: NeMo's NeVA model locates images "
        f"by those ids and cannot place the images of this output; images are written as "
        f"{image_run.positions} explicit patch ids ({image_run.patch_id}). Use a tokenizer with NeMo's special "
        f"pieces, or select explicit ids on purpose with --tokenization llava "
        f"(or --image_start_id/--image_end_id)"
    )


def check_token_ids(image_run: ImageRun, vocab_size: int, pad_id: int = PAD_ID, ignore_index: int = IGNORE_INDEX,
                    specials: dict[str, int | None] | None = None) -> None:  # fmt: skip
    """Image and pad ids must be ids of the vocabulary (0 .. vocab_size - 1), hence exact in the float32
    packed format: an id like 16777217 would be stored as 16777216. The ignore value must not be one:
    the labels of that token would read as ignored and never be trained. ``specials``: the tokenizer's
    BOS/EOS ids by name, none of which an image run's id may be (a ``tokenizer_config.json`` naming
    ``<|image_pad|>`` its EOS made every turn's end an image position the model has no pixels for)."""
    run_ids = (("image_patch_id", image_run.patch_id), ("image_start_id", image_run.start_id), ("image_end_id", image_run.end_id))
    for name, value in (*run_ids, ("pad_id", pad_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ConfigError(f"--{name} {value}: not an id of the tokenizer's vocabulary (0 .. {vocab_size - 1})")
    for special, special_id in (specials or {}).items():
        for name, value in run_ids:
            if value is not None and value == special_id:
                raise ConfigError(
                    f"{name} {value}: also the tokenizer's {special} id, so every {special} would read as an image position; "
                    f"the image run needs ids of its own (check the tokenizer's tokenizer_config.json, or set --{name})"
                )
    if 0 <= ignore_index < vocab_size:
        raise ConfigError(
            f"--ignore_index {ignore_index}: an id of the tokenizer's vocabulary (0 .. {vocab_size - 1}); "
            "its labels would read as ignored: use a negative value (NeMo: -1)"
        )
