"""What every pack must satisfy, as pure functions: ``verify`` checks published outputs with them,
and the writer checks each pack with them before it is written, so a violation stops the run
instead of being published.

One pack (3 samples, one image run of N positions in the second)::

    cu_seqlens  0        l1                     l1+l2        total
    tokens      [ s1 .. ][ s2 .. <start> 0 .. 0 <end> .. ][ s3 .. ]
    labels      next token or ignore inside a sample; never the first token of the next sample

- cu_seqlens strictly increasing from 0 to len(tokens); len(tokens) == len(labels) <= capacity;
- every image run whole (start, N - 2 patches, end; or N patches without delimiters), and as
  many runs as images in the pack; a dynamic-resolution run (``image_run.positions`` None) is each
  image's own length (``image_lengths``), in order, exactly its ids, and no patch id outside them;
  a run kept whole (``whole_runs``: a video clip's, its ids its family's own) opens with the start id
  and closes with the end id (where the run has them) and holds no image patch id;
- every label is the next token of its sample or the ignore value;
- within the visual budgets the pack was made under (``budget_problems``): its images, the positions
  of its image runs, and those of its video clips' runs (the runs kept whole; image runs too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neva_pack.core import ImageRun, PAD_ID


@dataclass(frozen=True, slots=True, kw_only=True)
class PackSpec:
    """What a run promises about its packs (from its config, or from an output's meta)."""

    max_seq_length: int
    """Pack capacity in positions."""
    ignore_index: int
    """Label of untrained positions."""
    image_run: ImageRun
    """The ids of one image's positions, delimiters included (``positions`` None: each image's own length)."""
    pad_id: int = PAD_ID
    """Token id of alignment padding (after a sample's real tokens, up to its cu_seqlens boundary)."""


def image_runs(tokens: np.ndarray, spec: PackSpec) -> tuple[int, list[int]]:
    """(whole image runs, start positions of incomplete ones).

    With a start id, every start must open a whole run. Without one, patch ids are counted in
    runs of ``image_positions`` (a text token equal to the patch id next to a run is tolerated;
    a cut run then shows as one run too few, which ``pack_problems`` reports as a count mismatch).
    """
    image_run = spec.image_run
    positions = image_run.positions
    if positions <= 0:
        return 0, []
    tokens = np.asarray(tokens, dtype=np.int64)
    if image_run.start_id is not None:
        starts = np.flatnonzero(tokens == image_run.start_id)
        whole = _whole_runs(tokens, starts, image_run.ids())
        return int(whole.sum()), starts[~whole].tolist()
    if image_run.end_id is not None:
        ends = np.flatnonzero(tokens == image_run.end_id)
        run = image_run.ids()
        broken = [int(e) for e in ends if e + 1 < positions or not np.array_equal(tokens[e + 1 - positions : e + 1], run)]
        return len(ends) - len(broken), broken
    is_patch = np.concatenate([[False], tokens == image_run.patch_id, [False]])
    edges = np.flatnonzero(np.diff(is_patch.astype(np.int8)))
    return int(((edges[1::2] - edges[::2]) // positions).sum()), []


def run_ids(image_run: ImageRun, length: int) -> np.ndarray:
    """int64 ids of a dynamic run of ``length`` positions: [start] patch ... [end]."""
    features = length - (image_run.start_id is not None) - (image_run.end_id is not None)
    ids = np.full(max(length, 0), image_run.patch_id, dtype=np.int64)
    if image_run.start_id is not None and length:
        ids[0] = image_run.start_id
    if image_run.end_id is not None and length:
        ids[-1] = image_run.end_id
    return ids if features >= 0 else np.zeros(0, dtype=np.int64)


def dynamic_run_problems(tokens: np.ndarray, image_run: ImageRun, image_lengths, whole_runs=None) -> list[str]:
    """What is wrong with the image runs of a dynamic-resolution pack: image k's run is exactly
    ``run_ids(image_lengths[k])`` (a run kept whole, ``whole_runs[k]``: opened by the start id, closed
    by the end id, no patch id inside), the runs in order, and no start, end or patch id elsewhere."""
    tokens = np.asarray(tokens, dtype=np.int64)
    lengths = np.asarray(image_lengths, dtype=np.int64)
    whole = np.zeros(len(lengths), dtype=bool) if whole_runs is None else np.asarray(whole_runs, dtype=bool)
    delimiters = (image_run.start_id is not None) + (image_run.end_id is not None)
    if np.any(lengths < max(delimiters, 1)):
        return [f"image run lengths {lengths[:8].tolist()}... shorter than a run's delimiters"]
    if len(whole) != len(lengths):
        return [f"{len(whole)} run kinds for {len(lengths)} image runs"]
    marks = np.isin(tokens, [image_run.patch_id] + [i for i in (image_run.start_id, image_run.end_id) if i is not None])
    # walk the marked positions: each opens the next run, which must be whole where it is
    p, k = 0, 0
    while True:
        following = np.flatnonzero(marks[p:])
        if not len(following):
            break
        start = p + int(following[0])
        if k >= len(lengths):
            return [f"an image position at {start} outside the pack's {len(lengths)} image runs"]
        length = int(lengths[k])
        window = tokens[start : start + length]
        if whole[k]:
            sound = (len(window) == length and image_run.patch_id not in window
                     and (image_run.start_id is None or window[0] == image_run.start_id)
                     and (image_run.end_id is None or window[-1] == image_run.end_id))  # fmt: skip
        else:
            sound = np.array_equal(window, run_ids(image_run, length))
        if not sound:
            return [f"image run {k} at position {start} is not its {length} ids"]
        p, k = start + length, k + 1
    if k != len(lengths):
        return [f"{k} image runs in the pack, {len(lengths)} image run lengths"]
    return []


def pack_problems(
    spec: PackSpec, cu_seqlens, tokens, labels, num_images: int, real_lengths=None, image_lengths=None, whole_runs=None
) -> list[str]:  # fmt: skip
    """Everything wrong with one pack (empty when it is sound), one line each.

    ``cu_seqlens`` are the buffer boundaries; ``real_lengths`` the samples' lengths before alignment
    padding (None: no padding). Padding positions must hold the pad id with ignored labels.
    ``image_lengths``: each image's run length, needed for a dynamic-resolution run; ``whole_runs``:
    which of those runs are kept whole (a video clip's ids; None: none).
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    if len(tokens) != len(labels) or len(tokens) > spec.max_seq_length:
        return [f"{len(tokens)} tokens, {len(labels)} labels, max_seq_length {spec.max_seq_length}"]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != len(tokens) or np.any(np.diff(cu) <= 0):
        return [f"cu_seqlens {cu[:8].tolist()}... not strictly increasing from 0 to {len(tokens)}"]
    real = np.diff(cu) if real_lengths is None else np.asarray(real_lengths, dtype=np.int64)
    if len(real) != len(cu) - 1 or np.any(real < 1) or np.any(real > np.diff(cu)):
        return [f"real sample lengths {real[:8].tolist()}... do not fit the cu_seqlens segments {np.diff(cu)[:8].tolist()}"]
    real_ends = cu[:-1] + real
    problems = []
    inner = np.ones(len(tokens), dtype=bool)
    inner[real_ends - 1] = False  # a sample's last label is its next id, which no pack holds
    padding = _padding_mask(len(tokens), real_ends, cu[1:])
    inner &= ~padding
    following = np.append(tokens[1:], 0)
    bad = inner & (labels != spec.ignore_index) & (labels != following)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        problems.append(f"label at position {at} is {labels[at]}, neither the next token nor {spec.ignore_index}")
    wrong_pad = padding & ((tokens != spec.pad_id) | (labels != spec.ignore_index))
    if wrong_pad.any():
        at = int(np.flatnonzero(wrong_pad)[0])
        problems.append(
            f"padding position {at} holds token {tokens[at]} / label {labels[at]}, not {spec.pad_id} / {spec.ignore_index}"
        )
    if spec.image_run.positions is None:
        if image_lengths is None and num_images == 0:
            image_lengths = np.zeros(0, dtype=np.int64)
        if image_lengths is None or len(image_lengths) != num_images:
            problems.append(f"{num_images} images, {'no' if image_lengths is None else len(image_lengths)} image run lengths")
        else:
            problems += dynamic_run_problems(tokens, spec.image_run, image_lengths, whole_runs)
        return problems
    runs, broken = image_runs(tokens, spec)
    if broken:
        problems.append(f"{len(broken)} incomplete image run(s) (first at position {broken[0]})")
    if runs != num_images:
        problems.append(f"{num_images} images for {runs} image runs")
    return problems


def budget_problems(num_images: int, image_lengths=None, whole_runs=None, *, max_images: int | None = None,
                    max_image_tokens: int | None = None, max_video_tokens: int | None = None) -> list[str]:
    """What exceeds a visual budget in one pack (a budget None: none): its images, its image runs'
    positions (``image_lengths``, needed for that budget) and its video clips' (the runs kept whole,
    ``whole_runs``; none when None)."""
    problems = []
    if max_images is not None and num_images > max_images:
        problems.append(f"{num_images} images, over max_images_per_pack {max_images}")
    lengths = np.zeros(0, dtype=np.int64) if image_lengths is None else np.asarray(image_lengths, dtype=np.int64)
    if max_image_tokens is not None and int(lengths.sum()) > max_image_tokens:
        problems.append(f"{int(lengths.sum())} image tokens, over max_image_tokens_per_pack {max_image_tokens}")
    if max_video_tokens is not None and whole_runs is not None:
        video = int(lengths[np.asarray(whole_runs, dtype=bool)].sum())
        if video > max_video_tokens:
            problems.append(f"{video} video tokens, over max_video_tokens_per_pack {max_video_tokens}")
    return problems


def accounting_problem(records: int, packed: int, skipped: int) -> str | None:
    """Every input record is packed or skipped: None when the counts add up."""
    if packed + skipped != records:
        return f"{packed} packed + {skipped} skipped != {records} records"
    return None


def _padding_mask(size: int, real_ends: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """True on the positions between each sample's real end and its buffer boundary."""
    if np.array_equal(real_ends, boundaries):
        return np.zeros(size, dtype=bool)
    marks = np.bincount(real_ends, minlength=size + 1) - np.bincount(boundaries, minlength=size + 1)
    return np.cumsum(marks)[:-1] > 0


def _whole_runs(tokens: np.ndarray, starts: np.ndarray, run: np.ndarray) -> np.ndarray:
    """For each start position, whether the whole run follows it (all runs compared at once)."""
    whole = starts + len(run) <= len(tokens)
    fits = starts[whole]
    if len(fits):
        windows = tokens[fits[:, None] + np.arange(len(run))]
        whole[whole] = (windows == run).all(axis=1)
    return whole
