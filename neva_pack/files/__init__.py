"""Files written durably and read back, for the sample store and the output formats alike:
Megatron-Core's IndexedDataset (.bin/.idx), an output file that checksums what it writes, and
write-behind. Neither the store nor a format owns them, so neither imports the other for them."""

from __future__ import annotations

import os

__all__ = ["fsync_close"]


def fsync_close(file) -> None:
    """Flush, fsync and close an open file: what it holds is on the disk when this returns."""
    file.flush()
    os.fsync(file.fileno())
    file.close()
