"""Hugging Face flattened batches from PackedSeqDataset items (axolotl's multipack, TRL's padding_free).

``hf_batch(packs)`` lays packs end to end in one row, as ``DataCollatorWithFlattening`` does, with
no padding between samples; a causal LM called with these ``position_ids`` and no attention mask
keeps every sample to itself (sdpa/eager: transformers builds a block-causal mask from the position
restarts; flash attention reads ``cu_seq_lens_q/k``)::

    samples: a (3 tokens), b (2 tokens)          targets y (our labels, already next-token)
    input_ids     [a0 a1 a2 b0 b1]
    position_ids  [ 0  1  2  0  1]               restart per sample
    shift_labels  [ya0 ya1 ya2 yb0 yb1]          target of each position: what the loss uses
    labels        [-100 ya0 ya1 -100 yb0]        Hugging Face's convention (the model shifts it)
    cu_seq_lens_q/k  [0, 3, 5] (int32)     max_length_q/k  3

Labels. Our packs store next-token targets (tokens = ids[:-1], labels = ids[1:]): position i's
target sits at i. Hugging Face's causal-LM loss (``ForCausalLMLoss``) shifts ``labels`` by one
unless it is given ``shift_labels``, which it takes as they are; the Trainer counts
``num_items_in_batch`` from ``shift_labels`` too. So the batch carries the targets as
``shift_labels`` (exact: the per-sample next-token loss) and ``labels`` in the model's own
convention, each sample's first position ignored, so that no label ever crosses from one sample to
the next. ``labels`` alone, shifted by a loss that ignores ``shift_labels``, misses each sample's
last target (its input holds one token fewer than Hugging Face's ids); passing our targets as
``labels`` would shift them twice. Ignored positions are -100 in both.

Images. LLaVA-family models place the k-th image's features where ``input_ids`` equal the
model's image token id, image by image: ``pixel_values`` holds the batch's images in placeholder
order, and ``image_token_id`` replaces every position of every image run (its start and end ids
included, ``meta.image_positions`` per image) by that id.

Outputs of a family whose images each have their own size (items carrying the family's model inputs,
joined as it declares: neva_pack/training/model_keys.py), for example:

    Qwen2-VL / 2.5-VL   pixel_values (sum of patches, 1176), image_grid_thw (N, 3),
                        position_ids (4, 1, T): row 0 the text positions restarting per sample (what
                        the model builds the packed block-causal mask from), rows 1-3 the mRoPE ids
    LLaVA-NeXT / OV     pixel_values (N, 1 + most tiles, 3, S, S), image_sizes (N, 2), position_ids (1, T)
    OneVision           also batch_num_images (samples,): each sample's image count, in row order;
                        the model tiles an image only where its sample's count is 1

Each image's run has its own length there, and only its feature positions are the model's image
token (Qwen's ``<|vision_start|>`` / ``<|vision_end|>`` stay text): ``image_token_id`` replaces every
``image_patch_id`` (the run's patch id, ``meta.image_run.patch_id``) by that id. Qwen2-VL given 3-row
positions and no mask would let samples see each other: the 4-row layout is what keeps them apart.

Bidirectional image blocks. A family whose model attends both ways inside each image on some layers
(``families.AttentionNeeds``: Gemma 4's sliding-window layers) carries a per-token key marking image
tokens (``Join.TOKENS``). transformers builds such a mask from ``position_ids`` and that key only for
one sequence per row: on a packed row it remaps positions per sample before looking up the image
blocks, so every sample after the first reads another sample's blocks. So the batch carries the masks
themselves, ``attention_mask`` = {layer type: (1, 1, T, T) additive float mask}: within each sample,
causal, OR the same image block on the layer types the family names, AND the model's sliding window on
``sliding_attention`` layers; -inf (the dtype's minimum) elsewhere. The model uses a dict of masks as
given (sdpa and eager; flash attention takes no such mask and is refused). ``hf_collate(dataset,
model_config=model.config)`` reads the layer types, window and dtype; memory: T² mask entries per
layer type.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from neva_pack.reading import position_ids_from_cu_seqlens
from neva_pack.core import IGNORE_INDEX
from neva_pack.training.model_keys import attention_needs, dataset_batch_keys, join_model_inputs, position_rows
from neva_pack.training.item_checks import check_items, checked_collate

__all__ = ["HF_IGNORE_INDEX", "MaskSettings", "hf_batch", "hf_collate", "image_run_starts", "packed_attention_masks"]

HF_IGNORE_INDEX = -100
"""The label Hugging Face's losses ignore (torch's cross_entropy default)."""


def hf_batch(
    packs: list[dict[str, torch.Tensor]],
    image_token_id: int | None = None,
    *,
    image_run: np.ndarray | None = None,
    image_patch_id: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    batch_keys=None,
    masks: MaskSettings | None = None,
) -> dict:
    """One flattened row from ``PackedSeqDataset`` items (packs, or one-sample items of
    ``PackedSamples``), in order.

    Returns input_ids, labels, shift_labels, position_ids (all (1, T) int64), cu_seq_lens_q/k
    (int32, the samples' boundaries in the row, alignment padding included in its sample),
    max_length_q/k (int), and pixel_values ((N, 3, H, W), in placeholder order) when the packs hold
    images. ``image_token_id`` needs ``image_run``, the ids of one image run as the output spells
    it (``meta.image_run.ids()``; ``hf_collate(dataset)`` reads it). Items that carry a family's model
    inputs give them joined as ``batch_keys`` declares (a family's ``batch_keys``; None: every
    registered family's); where each image's run has its own length, ``image_token_id`` needs
    ``image_patch_id`` instead of ``image_run``. Items of a family whose model attends bidirectionally
    inside images need ``masks`` (the model's ``MaskSettings``) and give ``attention_mask`` (module docstring).
    """
    if not packs:
        raise ValueError("hf_batch needs at least one pack")
    check_items(packs)  # one output's items (neva_pack/training/item_checks.py)
    needs = attention_needs(packs)
    if needs.bidirectional_images and masks is None:
        raise ValueError(
            "hf_batch: this output's model attends bidirectionally inside each image, which it cannot mask on a packed row "
            "itself: give masks=MaskSettings.of(model.config) (hf_collate(dataset, model_config=model.config) does)"
        )
    stacked = "image" in packs[0]  # the formats' stack of fixed crops (an image-less pack: one zero image)
    if image_token_id is not None and not stacked and image_patch_id is None:
        raise ValueError("image_token_id needs image_patch_id where each image's run has its own length (hf_collate(dataset, image_token_id) reads it)")
    if image_token_id is not None and stacked and image_run is None:
        raise ValueError("image_token_id needs image_run (the meta's run: hf_collate(dataset, image_token_id) reads it)")
    tokens, targets, bounds, images = [], [], [0], []
    for item in packs:
        cu = item["cu_seqlens"].long()
        pack_tokens = item["tokens"].long()
        count = int(item["num_images"].sum())
        if image_token_id is not None and not stacked:
            pack_tokens = torch.where(pack_tokens == image_patch_id, image_token_id, pack_tokens)
        elif image_token_id is not None and count:
            pack_tokens = _with_image_token(pack_tokens, np.asarray(image_run, dtype=np.int64), count, image_token_id)
        tokens.append(pack_tokens)
        targets.append(item["labels"].long())
        bounds += (bounds[-1] + cu[1:]).tolist()
        if stacked:
            images.append(item["image"][:count])  # not the zero image of an image-less pack
    cu_seq_lens = torch.tensor(bounds, dtype=torch.int32)
    shift_labels = torch.cat(targets)
    shift_labels = torch.where(shift_labels == ignore_index, HF_IGNORE_INDEX, shift_labels)
    labels = torch.roll(shift_labels, 1)
    labels[cu_seq_lens[:-1].long()] = HF_IGNORE_INDEX  # the previous sample's last target stays out
    longest = int(torch.diff(cu_seq_lens).max())
    batch = {
        "input_ids": torch.cat(tokens)[None],
        "labels": labels[None],
        "shift_labels": shift_labels[None],
        "position_ids": position_ids_from_cu_seqlens(cu_seq_lens)[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    rows = position_rows(packs)
    if rows is not None:
        batch["position_ids"] = torch.cat([batch["position_ids"], rows])[:, None]
    batch.update(join_model_inputs(packs, batch_keys))
    if needs.bidirectional_images:
        batch["attention_mask"] = packed_attention_masks(cu_seq_lens, batch[needs.marks][0], needs.layer_types, masks)
    if not stacked:
        return batch
    pixels = torch.cat(images)
    if len(pixels):
        batch["pixel_values"] = pixels
    return batch


def _with_image_token(tokens: torch.Tensor, run: np.ndarray, count: int, image_token_id: int) -> torch.Tensor:
    """``tokens`` with each of its ``count`` image runs (``run``'s ids) replaced by ``image_token_id``."""
    ids = tokens.numpy()
    starts = image_run_starts(ids, run)
    if len(starts) != count:
        raise ValueError(f"a pack with {count} images holds {len(starts)} whole image runs of {run[:3].tolist()}...")
    replaced = ids.copy()
    replaced[(starts[:, None] + np.arange(len(run))).reshape(-1)] = image_token_id
    return torch.from_numpy(replaced)


def image_run_starts(tokens: np.ndarray, run: np.ndarray) -> np.ndarray:
    """Start positions of the whole image runs in ``tokens``, left to right.

    A run that opens (or closes) with its own id is found by that id; a run of patch ids only is
    found in stretches of patch ids, which must then hold whole runs (a text token equal to the patch
    id next to an image would make its place ambiguous: ValueError).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    size, patch = len(run), run[len(run) // 2]
    if run[0] != patch or run[-1] != patch:
        anchor, shift = (0, 0) if run[0] != patch else (size - 1, size - 1)
        starts = np.flatnonzero(tokens == run[anchor]) - shift
        starts = starts[(starts >= 0) & (starts + size <= len(tokens))]
        whole = (tokens[starts[:, None] + np.arange(size)] == run).all(axis=1) if len(starts) else starts.astype(bool)
        return starts[whole]
    is_patch = np.concatenate([[False], tokens == patch, [False]])
    edges = np.flatnonzero(np.diff(is_patch.astype(np.int8)))
    first, stretch = edges[::2], edges[1::2] - edges[::2]
    if np.any(stretch % size):
        at = int(first[np.flatnonzero(stretch % size)[0]])
        raise ValueError(f"a stretch of patch ids at position {at} is not a whole number of {size}-position image runs")
    return np.concatenate([start + size * np.arange(n) for start, n in zip(first, stretch // size)] or [np.zeros(0)]).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class MaskSettings:
    """What a model's attention masks depend on beyond the row (its config's)."""

    layer_types: tuple[str, ...]
    """The model's layer types (config ``layer_types``): one mask each."""
    sliding_window: int | None
    """Keys more than this many positions back are out of a ``sliding_attention`` layer's reach."""
    dtype: torch.dtype
    """The masks' float dtype: the model's (sdpa wants the query's)."""

    @classmethod
    def of(cls, config, dtype: torch.dtype | None = None) -> MaskSettings:
        """From a transformers model config (its text config's); ``dtype``: the model's parameters'
        (default: the config's dtype when it names a float dtype, else float32). ValueError for
        flash attention, which takes no such mask."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        implementation = str(getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None) or "")
        if "flash" in implementation:
            raise ValueError(f"attention {implementation!r} takes no mask that opens an image's block: use sdpa or eager")
        named = getattr(config, "dtype", None)
        dtype = dtype or (named if isinstance(named, torch.dtype) and named.is_floating_point else torch.float32)
        return cls(tuple(dict.fromkeys(text.layer_types)), getattr(text, "sliding_window", None), dtype)


def packed_attention_masks(cu_seq_lens: torch.Tensor, marks: torch.Tensor, bidirectional: tuple[str, ...], settings: MaskSettings) -> dict[str, torch.Tensor]:
    """{layer type: (1, 1, T, T) additive mask} of one packed row (module docstring): ``cu_seq_lens``
    the samples' boundaries, ``marks`` (T,) nonzero on image tokens, ``bidirectional`` the layer types
    where an image's block attends both ways."""
    bounds = cu_seq_lens.long()
    length = int(bounds[-1])
    index = torch.arange(length)
    sample = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.diff(bounds))
    marked = marks.reshape(-1) != 0
    opens = marked & ~torch.cat([torch.tensor([False]), marked[:-1]])
    opens[bounds[:-1][bounds[:-1] < length]] |= marked[bounds[:-1][bounds[:-1] < length]]  # a block never spans samples
    block = torch.where(marked, torch.cumsum(opens.long(), 0), -1)
    same_sample = sample[:, None] == sample[None, :]
    causal = same_sample & (index[None, :] <= index[:, None])
    same_block = same_sample & marked[:, None] & (block[:, None] == block[None, :])
    masks = {}
    for layer_type in settings.layer_types:
        allowed = causal | same_block if layer_type in bidirectional else causal
        if layer_type == "sliding_attention" and settings.sliding_window:
            allowed = allowed & (index[None, :] > index[:, None] - settings.sliding_window)
        blocked = torch.zeros((length, length), dtype=settings.dtype).masked_fill(~allowed, torch.finfo(settings.dtype).min)
        masks[layer_type] = blocked[None, None]
    return masks


def hf_collate(dataset, image_token_id: int | None = None, *, model_config=None, mask_dtype: torch.dtype | None = None):
    """A DataLoader collate_fn: ``hf_batch`` with the dataset meta's ignore value and image run
    (its patch id where each image's run has its own length), and the model-input keys of the
    dataset's family. A family whose model attends bidirectionally inside images needs
    ``model_config`` (the model's config: its masks' layer types, window, dtype, or ``mask_dtype``)."""
    masks = None
    if attention_needs([], dataset).bidirectional_images:
        if model_config is None:
            raise ValueError(
                "hf_collate: this output's model attends bidirectionally inside each image: pass model_config=model.config "
                "so that every batch carries the masks keeping each image's block inside its sample"
            )
        masks = MaskSettings.of(model_config, mask_dtype)
    meta = dataset.meta
    run = meta.image_run
    own_lengths = run.positions is None
    return checked_collate(functools.partial(
        hf_batch,
        image_token_id=image_token_id,
        image_run=None if own_lengths else run.ids(),
        image_patch_id=run.patch_id if own_lengths else None,
        ignore_index=int(meta.ignore_index),
        batch_keys=dataset_batch_keys(dataset),
        masks=masks,
    ), dataset)  # fmt: skip
