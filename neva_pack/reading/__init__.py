"""Reading a packed output of any format back, as training does: ``PackedSeqDataset`` (NeMo's reader's
items, plus the model inputs of a family's images).
"""

from neva_pack.reading.dataset import PackedSamples, PackedSeqDataset, collate, position_ids_from_cu_seqlens
from neva_pack.reading.items import dynamic_pack_item, sample_of_pack
from neva_pack.reading.item_source import ItemSource, PackItem, source_of

__all__ = [
    "ItemSource",
    "PackItem",
    "PackedSamples",
    "PackedSeqDataset",
    "collate",
    "dynamic_pack_item",
    "position_ids_from_cu_seqlens",
    "sample_of_pack",
    "source_of",
]
