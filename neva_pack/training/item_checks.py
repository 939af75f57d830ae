"""The collates' check that a batch's items belong together: one output's ignore value, pad id, image run
and family (``reading.ItemSource``).

Without it, items of two outputs batch without an error and train wrongly: labels of -7 (another
output's ignore value) pass as targets with a loss mask of 1, or one output's image ids are read as
another's text; items of two families fail deep inside with a bare ``KeyError``. Three checks, each
refusing in one line (ValueError) that names the item and the field:

- the items' markers (``PackItem.source``, set by ``PackedSeqDataset`` and ``PackedSamples``) agree
  with each other and with the collate's dataset, field by field;
- every item has the same keys (a family's model inputs, or a fixed crop's ``image``): what an item
  without a marker (a dict rebuilt by user code) still shows of its family;
- with the collate's ignore value known, no label is negative unless it is that value (token ids are
  never negative: a negative label is another output's ignore value).

Each costs a comparison per item and one vectorised pass over the labels: nothing next to a batch's
tensors. ``checked_collate(collate_fn, dataset)`` is what ``hf_collate`` / ``thd_collate`` return;
``check_items(items)`` alone (markers and keys) is what ``hf_batch`` / ``thd_batch`` run on items given
directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neva_pack.reading import ItemSource, source_of

__all__ = ["CheckedCollate", "check_items", "checked_collate"]

_WHAT = {
    "ignore_index": "ignore values",
    "pad_id": "pad ids",
    "image_run": "image runs",
    "family": "families",
    "image_shape": "image shapes",
}


def check_items(items: Sequence[dict], expected: ItemSource | None = None, ignore_index: int | None = None) -> None:
    """ValueError, one line, when ``items`` do not belong in one batch (module docstring). ``expected``:
    the collate's dataset's source; ``ignore_index``: the ignore value labels are checked against."""
    reference, whose = (expected, "the collate's output") if expected is not None else (None, "item 0's output")
    for k, item in enumerate(items):
        source = getattr(item, "source", None)
        if source is None:
            continue
        if reference is None:
            reference, whose = source, f"item {k}'s output"
            continue
        for name, ours, theirs in reference.differences(source)[:1]:
            raise ValueError(f"batch item {k} comes from an output with {name} {theirs!r}, {whose} has {ours!r}: "
                             f"items of outputs with different {_WHAT[name]} cannot share a batch")  # fmt: skip
    keys = set(items[0]) if items else set()
    for k, item in enumerate(items[1:], start=1):
        if set(item) != keys:
            extra, lacking = sorted(set(item) - keys), sorted(keys - set(item))
            said = f"has {', '.join(extra)}" if extra else f"lacks {', '.join(lacking)}"
            raise ValueError(f"batch item {k} {said} that item 0 does not: items of different families or outputs cannot share a batch")
    if ignore_index is None:
        return
    for k, item in enumerate(items):
        labels = item.get("labels")
        if not isinstance(labels, torch.Tensor):
            continue
        stray = labels[(labels < 0) & (labels != ignore_index)]
        if len(stray):
            raise ValueError(f"batch item {k} holds label {int(stray[0])}, neither a token id nor this collate's ignore value "
                             f"{ignore_index}: items of outputs with different ignore values cannot share a batch")  # fmt: skip


class CheckedCollate:
    """A collate_fn that checks its batch (``check_items`` against the dataset's source and ignore
    value) before it collates. Picklable, for DataLoader workers."""

    def __init__(self, collate: Callable, source: ItemSource):
        self.collate, self.source = collate, source

    def __call__(self, items: Sequence[dict]):
        check_items(items, self.source, self.source.ignore_index)
        return self.collate(items)


def checked_collate(collate: Callable, dataset) -> CheckedCollate:
    """``collate`` behind the checks of the items against ``dataset``'s source (a ``PackedSeqDataset``,
    a ``PackedSamples``, or anything with the meta of a packed output)."""
    source = getattr(dataset, "source", None)
    if source is None:
        source = source_of(dataset.meta, getattr(dataset, "processor", None))
    return CheckedCollate(collate, source)
