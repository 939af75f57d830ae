"""Where an item of ``PackedSeqDataset`` / ``PackedSamples`` comes from: what a collate must agree with.

A batch is made with one output's conventions: its ignore value (the loss mask is ``labels !=
ignore``), its pad id, its image run (which ids are image positions) and its family (which model-input
keys an item carries, how they join). Items of two outputs that differ in one of these give a batch
that is wrong without an error (labels of -7 with a loss mask of 1) or a bare ``KeyError``. So each item
says where it comes from (``ItemSource``), and the collates check it (``neva_pack.training.item_checks``).

An item is a ``PackItem``: a plain ``dict`` of tensors (its keys, its values, ``==`` and iteration are
those of the dict) with one attribute, ``source``. It pickles with it (DataLoader workers), and code
that builds a new dict from it simply drops the marker: the collates then check what the keys and the
labels themselves show.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ItemSource", "PackItem", "source_of"]


@dataclass(frozen=True, slots=True)
class ItemSource:
    """The conventions of an output that items of one batch must share (compared field by field)."""

    ignore_index: int
    """Label of untrained positions and padding (the loss mask's complement)."""
    pad_id: int
    """Token id of padding positions."""
    image_run: tuple[int | None, int, int | None, int | None]
    """(positions, patch id, start id, end id) of one image's run (positions None: each its own)."""
    family: str
    """The family whose model inputs the items carry, or ``"fixed crop"`` (a stack under ``image``)."""
    image_shape: tuple[int, ...] | None
    """(3, H, W) of every image of a fixed-crop output; None for a family's own sizes."""

    def differences(self, other: ItemSource) -> list[tuple[str, object, object]]:
        """(field, this value, other value) of each field that differs, in declaration order."""
        return [
            (name, getattr(self, name), getattr(other, name))
            for name in self.__slots__
            if getattr(self, name) != getattr(other, name)
        ]


class PackItem(dict):
    """A dataset item: a dict of tensors that remembers its ``ItemSource`` (module docstring)."""

    source: ItemSource | None = None

    def __reduce__(self):  # a DataLoader worker sends it pickled: the marker goes with it
        return (_rebuilt, (dict(self), self.source))


def _rebuilt(items: dict, source: ItemSource | None) -> PackItem:
    item = PackItem(items)
    item.source = source
    return item


def source_of(meta, processor=None) -> ItemSource:
    """The ``ItemSource`` of an output's items, from its meta (and the family object it is read with)."""
    run = meta.image_run
    family = getattr(processor, "family", None) or (getattr(meta, "image_processor", None) or {}).get("family") or "fixed crop"
    return ItemSource(
        ignore_index=int(meta.ignore_index),
        pad_id=int(meta.pad_id),
        image_run=(run.positions, int(run.patch_id), run.start_id, run.end_id),
        family=str(family),
        image_shape=None if meta.image_shape is None else tuple(int(v) for v in meta.image_shape),
    )
