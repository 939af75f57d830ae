"""Pack assembly, in one place: plan + sample store -> typed packs that any format writes.

Which samples share a pack, where a sample is cut for a smaller pack size, which images it
keeps and in which order are decided here once. What the bytes look like (dtype, normalisation,
padding, the zero image of an image-less pack, deduplication) is each format's decision::

    plan bin b = [s7, s2]           s7: 5 positions (1 image), s2: 3 positions, pad_to_multiple_of 4
    lengths        = [5, 3]
    padded_lengths = [8, 4]         the format writes 3 + 1 pad positions after the samples' tokens
    tokens         = [t7 t7 t7 t7 t7 | t2 t2 t2]          real tokens only, int32
    image_indices  = [pool index of s7's image]           pixels = uint8 (1, 3, H, W) if asked for
    image_starts   = [where its run starts in tokens]     image_lengths = [its run's length]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from neva_pack.packing import PackingPlan, padded_lengths, with_padding


@dataclass(frozen=True, slots=True, kw_only=True)
class AssembledPack:
    lengths: np.ndarray
    """int64 real positions of each sample, in pack order."""
    padded_lengths: np.ndarray
    """int64 positions each sample occupies (lengths rounded up to pad_to_multiple_of)."""
    tokens: np.ndarray
    """int32 real token ids of the samples, concatenated (no padding)."""
    labels: np.ndarray
    """int32 labels of the samples, concatenated (ignore value outside trained positions)."""
    record_indices: np.ndarray
    """int64 input record of each sample."""
    num_images: np.ndarray
    """int64 images of each sample."""
    image_indices: np.ndarray
    """int64 image-pool index of each image, in placeholder order: the images' content keys."""
    image_starts: np.ndarray
    """int64 position in ``tokens`` where each image's run of positions starts."""
    pixels: np.ndarray | None
    """uint8 (N, 3, H, W) of the images, or None when the writer did not ask for pixels (or the
    store is dynamic: its images have no one shape, formats refer to them by pool index)."""
    padded_tokens: np.ndarray | None = None
    """``tokens`` with the pad id after each sample up to its padded length (``tokens`` itself when
    nothing is padded), built once by assembly for the pack checks and the writer; None: not built."""
    padded_labels: np.ndarray | None = None
    """``labels`` padded the same way with the ignore value."""
    image_lengths: np.ndarray | None = None
    """int64 run length of each image, in placeholder order (fixed stores: all the run's length)."""
    whole_runs: np.ndarray | None = None
    """bool per image: its run is kept whole, its ids its family's own (a video clip's), not the
    store's ``[start] patch ... [end]``; None: none is."""


def rows_at(store, size: int, ignore_index: int) -> tuple[np.ndarray, dict[int, tuple[int, int]], np.ndarray]:
    """The store's rows as they are for a pack size; for each sample that must be cut for it,
    (tokens kept, images kept); and the samples the cut leaves without a trained label (skipped at
    this size as ``no_supervised_tokens``, as a run at this size would skip them). ``size`` is the
    aligned capacity when samples are padded, so that a cut sample's padded length still fits its pack.

    The rows are the store's (``SAMPLE_ROW``) and a ``video_tokens`` field: the positions of each
    sample's video clips' runs (``SampleStore.video_tokens``; they are in ``image_tokens`` too).
    A cut sample's row keeps the image tokens, video tokens and vision cost of the images it keeps, exactly:
    each image's run length is in the store; a dynamic image's cost is recomputed from its stored
    image's record with the store's processor (its family's ``vision_cost_of_stored``: a function of
    the image's size, parts and tokens and the processor settings the store records, so the store need not
    keep it per image; only cut samples' kept images' records are read, never their pixels), a fixed image's is the sample's cost over its images (they cost alike)."""
    from neva_pack.samples import truncation  # the builder's own cut (imports torch: only when asked)

    rows = with_video_tokens(store.rows, store.video_tokens())
    cuts = {}
    unsupervised = []
    cost = _image_costs(store)
    for i in np.flatnonzero(rows["length"] > size).tolist():
        starts, lengths = store.image_runs(i)
        cut, kept = truncation(starts, lengths if store.dynamic else store.run.fixed_length, size)
        cuts[i] = (cut - 1, kept)
        video = int(lengths[:kept][store.video_runs(i)[:kept]].sum()) if rows["video_tokens"][i] else 0
        rows[i] = (rows["record_index"][i], cut - 1, kept, 1, int(lengths[:kept].sum()), cost(i, kept), video)
        if not np.any(store.tokens_labels(i)[1][: cut - 1] != ignore_index):
            unsupervised.append(i)
    return rows, cuts, np.asarray(unsupervised, dtype=np.int64)


def with_video_tokens(rows: np.ndarray, video_tokens: np.ndarray) -> np.ndarray:
    """The store's rows with a ``video_tokens`` field (int64, one per row) after their own."""
    out = np.empty(len(rows), dtype=np.dtype(rows.dtype.descr + [("video_tokens", "<i8")]))
    for name in rows.dtype.names:
        out[name] = rows[name]
    out["video_tokens"] = video_tokens
    return out


def _image_costs(store):
    """(sample, images kept) -> the vision cost of the sample's first images (``rows_at``)."""
    if not store.dynamic:
        def fixed(i: int, kept: int) -> int:
            return kept * (int(store.rows["vision_cost"][i]) // max(int(store.rows["num_images"][i]), 1))

        return fixed
    from neva_pack.families import processor_from_record

    processor = processor_from_record(store.image_processor)

    def dynamic(i: int, kept: int) -> int:
        records = store.pool.stored_rows(store.image_indices(i)[:kept])
        return sum(processor.vision_cost_of_stored((int(r["width"]), int(r["height"])), int(r["parts"]), int(r["tokens"])) for r in records)

    return dynamic


PACKS_PER_READ = 32
"""Packs whose samples' text is read back with one ``SampleStore.texts`` call: its array work
is paid once per group, not once per pack."""


def assemble_packs(
    store, plan: PackingPlan, cuts: dict[int, tuple[int, int]], *, pad_to_multiple_of: int = 1, start: int = 0,
    stop: int | None = None, with_pixels: bool = True, pad_id: int, ignore_index: int,
) -> Iterator[AssembledPack]:  # fmt: skip
    """Packs ``start`` .. ``stop`` - 1 of the plan (to its last pack when ``stop`` is None). ``cuts``: sample -> (tokens kept, images kept) for samples
    longer than this pack size, cut as the sample builder would have cut them. ``pad_id`` and
    ``ignore_index`` fill the padded view (``padded_tokens``/``padded_labels``)."""
    stop = plan.num_bins if stop is None else stop
    for first in range(start, stop, PACKS_PER_READ):
        yield from _assemble_group(
            store, plan, cuts, first, min(first + PACKS_PER_READ, stop), pad_to_multiple_of, with_pixels, pad_id, ignore_index
        )


def _assemble_group(
    store, plan: PackingPlan, cuts, start: int, stop: int, multiple: int, with_pixels: bool, pad_id: int, ignore_index: int
) -> Iterator[AssembledPack]:  # fmt: skip
    """Packs [start, stop): their samples' text read at once, then cut into packs::

        group members  [s7 s2 | s4 s9 s1]      sample_bounds [0, 2, 5]
        text.lengths   [5  3  | 2  6  4 ]      token_bounds  [0, 8, 20]
    """
    uncut = np.iinfo(np.int64).max
    members = np.asarray(plan.indices[plan.offsets[start] : plan.offsets[stop]], dtype=np.int64)
    sample_bounds = np.asarray(plan.offsets[start : stop + 1], dtype=np.int64) - int(plan.offsets[start])
    keep = [cuts[i][0] if i in cuts else uncut for i in members.tolist()] if cuts else None
    text = store.texts(members, keep)
    token_bounds = np.concatenate([[0], np.cumsum(text.lengths)])
    padded = padded_lengths(text.lengths, multiple)
    record_indices = store.rows["record_index"][members].astype(np.int64)
    with_images = np.flatnonzero(store.rows["num_images"][members] > 0).tolist()
    no_images = np.zeros(0, dtype=np.int64)
    indices = [no_images] * len(members)
    starts = [no_images] * len(members)
    run_lengths = [no_images] * len(members)
    whole = [np.zeros(0, dtype=bool)] * len(members)
    for k in with_images:  # text-only samples need no per-sample work
        i = int(members[k])
        sample_images = store.image_indices(i)
        if i in cuts:
            sample_images = sample_images[: cuts[i][1]]
        indices[k] = sample_images.astype(np.int64)
        starts[k] = text.image_starts[k][: len(sample_images)]
        run_lengths[k] = text.image_lengths[k][: len(sample_images)]
        whole[k] = text.image_whole[k][: len(sample_images)]
    with_pixels = with_pixels and not store.dynamic
    for b in range(stop - start):
        low, high = int(sample_bounds[b]), int(sample_bounds[b + 1])
        first_token, end_token = int(token_bounds[low]), int(token_bounds[high])
        lengths, pack_padded = text.lengths[low:high], padded[low:high]
        tokens, labels = text.tokens[first_token:end_token], text.labels[first_token:end_token]
        positions = token_bounds[low:high] - first_token  # where each sample starts in the pack
        image_indices = np.concatenate(indices[low:high]) if with_images else no_images
        yield AssembledPack(
            lengths=lengths,
            padded_lengths=pack_padded,
            tokens=tokens,
            labels=labels,
            record_indices=record_indices[low:high],
            num_images=np.array([len(sample) for sample in indices[low:high]], dtype=np.int64),
            image_indices=image_indices,
            image_starts=np.concatenate([positions[k] + starts[low + k] for k in range(high - low)]) if with_images else no_images,
            pixels=store.pool.read(image_indices) if with_pixels else None,
            padded_tokens=with_padding(tokens, lengths, pack_padded, pad_id),
            padded_labels=with_padding(labels, lengths, pack_padded, ignore_index),
            image_lengths=np.concatenate(run_lengths[low:high]) if with_images else no_images,
            whole_runs=np.concatenate(whole[low:high]) if with_images else np.zeros(0, dtype=bool),
        )
