"""Which ids an image run is written with, for a tokenizer and a tokenization convention: NeMo's
<extra_id_4>/<extra_id_5> delimited run where the tokenizer has them, else explicit ids; for the
dynamic-resolution families, the model's own image tokens (``dynamic_image_run``); and the checks
that those ids, the pad id and the ignore index can be stored and trained as they mean.
"""

from __future__ import annotations

from neva_pack.core import IGNORE_INDEX, PAD_ID
from neva_pack.core import ConfigError
from neva_pack.core import ImageRun
from neva_pack.text import DEFAULT_TOKENIZATION, TOKENIZATIONS
from neva_pack.text import Tokenizer

__all__ = [
    "DYNAMIC_IMAGE_TOKENS", "IMAGE_DELIMITER_PIECES", "NEMO_IM_END", "NEMO_IM_START", "check_token_ids",
    "dynamic_image_run", "image_run_for", "missing_nemo_specials",
]  # fmt: skip

NEMO_IM_START = "<extra_id_4>"
NEMO_IM_END = "<extra_id_5>"

DYNAMIC_IMAGE_TOKENS = {
    "native": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "anyres": (None, "<image>", None),
}
"""(start, patch, end) token of an image run per dynamic-resolution family, as the models' tokenizers
spell them: Qwen2-VL / Qwen2.5-VL ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch +
``<|vision_end|>``; LLaVA-NeXT / OneVision (transformers' models) one ``<image>`` per feature."""

IMAGE_DELIMITER_PIECES = ((NEMO_IM_START, NEMO_IM_END), DYNAMIC_IMAGE_TOKENS["native"][::2])
"""Special pieces that open and close an image run, as a one-call prompt writes an image."""


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


def dynamic_image_run(
    tokenizer: Tokenizer,
    family: str,
    patch_id: int | None = None,
    start_id: int | None = None,
    end_id: int | None = None,
) -> ImageRun:
    """The image run of a dynamic-resolution family (``EncoderSpec.family`` "native" or "anyres"),
    each image its own length, with the model's image tokens from the tokenizer; an id given
    explicitly replaces the token's. ConfigError, one line, for a tokenizer lacking one."""
    tokens = DYNAMIC_IMAGE_TOKENS[family]
    given = (start_id, patch_id, end_id)
    ids = []
    for token, explicit in zip(tokens, given):
        found = explicit if explicit is not None or token is None else tokenizer.token_to_id(token)
        if found is None and token is not None:
            wanted = "/".join(t for t in tokens if t is not None)
            raise ConfigError(
                f"tokenizer {tokenizer.name} has no {token}: a {_FAMILY_MODELS[family]} image is spelled with "
                f"{wanted}; use the model's own tokenizer (or give the ids: --image_patch_id/--image_start_id/--image_end_id)"
            )
        ids.append(found)
    start, patch, end = ids
    return ImageRun(positions=None, patch_id=patch, start_id=start, end_id=end)


_FAMILY_MODELS = {"native": "Qwen2-VL / Qwen2.5-VL", "anyres": "LLaVA-NeXT / OneVision"}


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


def check_token_ids(image_run: ImageRun, vocab_size: int, pad_id: int = PAD_ID, ignore_index: int = IGNORE_INDEX) -> None:
    """Image and pad ids must be ids of the vocabulary (0 .. vocab_size - 1), hence exact in the float32
    packed format: an id like 16777217 would be stored as 16777216. The ignore value must not be one:
    the labels of that token would read as ignored and never be trained."""
    for name, value in (("image_patch_id", image_run.patch_id), ("image_start_id", image_run.start_id),
                        ("image_end_id", image_run.end_id), ("pad_id", pad_id)):  # fmt: skip
        if value is not None and not 0 <= value < vocab_size:
            raise ConfigError(f"--{name} {value}: not an id of the tokenizer's vocabulary (0 .. {vocab_size - 1})")
    if 0 <= ignore_index < vocab_size:
        raise ConfigError(
            f"--ignore_index {ignore_index}: an id of the tokenizer's vocabulary (0 .. {vocab_size - 1}); "
            "its labels would read as ignored: use a negative value (NeMo: -1)"
        )
