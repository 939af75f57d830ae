"""Megatron Bridge's packed SFT files in Parquet, as its ``write_packed_parquet`` writes them.

    output_dir/training_<size>.idx.parquet    columns input_ids list<int64>, loss_mask list<int8>,
                                              seq_start_id list<int64>; one row per pack, row groups of 500
    output_dir/<size>_metadata.jsonl          as the .npy variant's

Bridge's ``GPTSFTPackedParquetDataset`` reads ``*.idx.parquet`` (its default packed path); everything
but the rows' file is the .npy variant's (``formats/bridge.py``). Needs pyarrow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from neva_pack.core import ConfigError, parsing
from neva_pack.files import regular_output
from neva_pack.formats.bridge import BridgeFormat, RowFile

__all__ = ["FORMAT", "ParquetRows", "read_parquet_rows", "write_parquet_rows"]

ROW_GROUP_SIZE = 500
"""Bridge's row group size."""


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"the {FORMAT.name} format needs pyarrow: pip install pyarrow") from None
    return pa, pq


def write_parquet_rows(path: Path, rows: list[dict]) -> None:
    pa, pq = _pyarrow()
    table = pa.table({
        "input_ids": pa.array([row["input_ids"] for row in rows], type=pa.list_(pa.int64())),
        "loss_mask": pa.array([[int(v) for v in row["loss_mask"]] for row in rows], type=pa.list_(pa.int8())),
        "seq_start_id": pa.array([row["seq_start_id"] for row in rows], type=pa.list_(pa.int64())),
    })  # fmt: skip
    pq.write_table(table, str(path), row_group_size=ROW_GROUP_SIZE)


class ParquetRows:
    def __init__(self, table):
        self.columns = {name: table.column(name).combine_chunks() for name in ("input_ids", "loss_mask", "seq_start_id")}

    def __len__(self) -> int:
        return len(self.columns["input_ids"])

    def row(self, p: int):
        ids, mask, starts = (self.columns[name][p].values.to_numpy(zero_copy_only=False)
                             for name in ("input_ids", "loss_mask", "seq_start_id"))  # fmt: skip
        return ids.astype(np.int64), mask.astype(bool), starts.astype(np.int64)


def read_parquet_rows(path: Path) -> ParquetRows:
    pa, pq = _pyarrow()
    with parsing(path):
        regular_output(path)
        try:  # pyarrow names a damaged file an OSError (of several lines), which ``parsing`` leaves to the disk's failures
            table = pq.read_table(str(path))
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(" ".join(f"not the Parquet file Bridge reads ({exc})".split())) from None
        missing = {"input_ids", "loss_mask", "seq_start_id"} - set(table.column_names)
        if missing:
            raise ValueError(f"no column {sorted(missing)[0]}")
        return ParquetRows(table)


PARQUET = RowFile(name_template="training_{size}.idx.parquet", tmp_suffix=".bridge.idx.parquet",
                  write=write_parquet_rows, read=read_parquet_rows)  # fmt: skip

FORMAT = BridgeFormat(
    "bridge_parquet", PARQUET, "Megatron Bridge's packed SFT Parquet, text only (Bridge's GPTSFTPackedParquetDataset)"
)
