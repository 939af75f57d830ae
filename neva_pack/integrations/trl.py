"""TRL's ``SFTTrainer`` on a packed output: the SFTConfig packs need, a dataset of pack indices and
the collate that reads them.

    args = sft_config(output_dir=..., per_device_train_batch_size=1, **yours)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         **sft_data(packs, image_token_id=model.config.image_token_id))

What TRL 1.x does, and why each piece is needed (``trl/trainer/sft_trainer.py``):

- it takes only a ``datasets.Dataset`` or ``IterableDataset`` (a torch dataset is a TypeError), and
  reads its first row to decide whether the data are "vision" (an ``image`` or ``images`` key: then it
  refuses a tokenizer, re-runs a processor per row and keeps only chat columns). Our items carry an
  ``image`` tensor, so the dataset TRL sees holds pack indices only (``index``), and ``PackRows``
  reads each batch's packs and hands them to ``hf_collate``;
- ``dataset_kwargs={"skip_prepare_dataset": True}``: otherwise it prepares the rows again (tokenizes,
  truncates, packs), as text it does not find in ours;
- ``packing=False`` and ``padding_free=False``: its own packing and padding-free modes refuse a custom
  collator (and vision data); ``hf_collate`` already gives the padding-free row (``position_ids``
  restarting, ``cu_seq_lens_*``);
- ``remove_unused_columns=False``: otherwise the index column, not a model argument, is dropped;
- its loss is a fused LM head that scores ``shift_labels`` as given when the batch has them (ours
  does), divided by the Trainer's ``num_items_in_batch``: the mean per-sample next-token loss; its
  ``compute_loss`` passes ``use_cache=False`` itself (the Trainer's rows need ``NoCacheRows``).

``processing_class`` must still be a tokenizer or processor (TRL loads one from the model's name
otherwise); with these settings it tokenizes nothing and is saved with the checkpoints.
"""

from __future__ import annotations

import numpy as np

from neva_pack.integrations.hf_trainer import REQUIRED as TRAINER_REQUIRED
from neva_pack.training import hf_collate

__all__ = ["INDEX_COLUMN", "REQUIRED", "PackRows", "check_sft_config", "sft_config", "sft_data"]

INDEX_COLUMN = "index"
"""The one column of the dataset TRL sees: an item's index in our dataset."""

REQUIRED = {**TRAINER_REQUIRED, "dataset_kwargs": {"skip_prepare_dataset": True}, "packing": False, "padding_free": False}
"""The SFTConfig settings packs need, against TRL's defaults."""

_WHY = {
    "remove_unused_columns": f"it drops the {INDEX_COLUMN!r} column, not a model argument, that PackRows reads",
    "dataset_kwargs": "without skip_prepare_dataset TRL prepares the rows again, as text to tokenize",
    "packing": "TRL's own packing refuses a custom data collator; the packs are already packed",
    "padding_free": "TRL's padding-free mode refuses a custom data collator; hf_collate already gives that row",
}


def _mismatch(name: str, value) -> bool:
    if name == "dataset_kwargs":
        return not (value or {}).get("skip_prepare_dataset", False)
    return value != REQUIRED[name]


def _refusal(name: str, value) -> str:
    wanted = 'dataset_kwargs={"skip_prepare_dataset": True}' if name == "dataset_kwargs" else f"{name}={REQUIRED[name]!r}"
    return f"{name}={value!r} breaks training on packs: {_WHY[name]}; set {wanted}"


def check_sft_config(args) -> None:
    """Raise ValueError, in one line, for an ``SFTConfig`` that would break training on our packs
    (``REQUIRED``)."""
    for name in REQUIRED:
        if _mismatch(name, getattr(args, name)):
            raise ValueError(_refusal(name, getattr(args, name)))


def sft_config(**settings):
    """``trl.SFTConfig(**settings)`` with ``REQUIRED`` set (``dataset_kwargs`` merged); a setting given
    against them is refused in one line. Mind TRL's own defaults: ``bf16=True`` (pass ``bf16=False`` to
    train in the model's dtype) and ``gradient_checkpointing=True``."""
    for name in REQUIRED:
        if name in settings and _mismatch(name, settings[name]):
            raise ValueError(_refusal(name, settings[name]))
    try:
        from trl import SFTConfig
    except ImportError as error:
        raise ImportError(f"TRL's SFTTrainer needs trl and accelerate: pip install 'neva-pack[trl]' ({error})") from error
    dataset_kwargs = {**(settings.get("dataset_kwargs") or {}), **REQUIRED["dataset_kwargs"]}
    return SFTConfig(**{**settings, **REQUIRED, "dataset_kwargs": dataset_kwargs})


class PackRows:
    """A ``data_collator`` for rows of the index dataset: reads each row's item from ``dataset`` (in the
    DataLoader's worker, as a torch dataset would be read) and lays them out with ``collate``."""

    def __init__(self, dataset, collate):
        self.dataset = dataset
        self.collate = collate

    def __call__(self, rows: list[dict]) -> dict:
        return self.collate([self.dataset[int(row[INDEX_COLUMN])] for row in rows])


def sft_data(dataset, image_token_id: int | None = None) -> dict:
    """``train_dataset`` and ``data_collator`` for ``SFTTrainer(...)``: a ``datasets.Dataset`` of the
    indices of ``dataset``'s items (packs, or samples of ``PackedSamples``), shuffled and sharded by the
    Trainer like any dataset, and ``PackRows`` over ``hf_collate`` (``image_token_id``: the model's
    ``config.image_token_id``)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"TRL's SFTTrainer needs trl and accelerate: pip install 'neva-pack[trl]' ({error})") from error
    rows = datasets.Dataset.from_dict({INDEX_COLUMN: np.arange(len(dataset), dtype=np.int64)})
    return {"train_dataset": rows, "data_collator": PackRows(dataset, hf_collate(dataset, image_token_id=image_token_id))}
