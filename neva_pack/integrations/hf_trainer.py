"""transformers' ``Trainer`` on a packed output: the arguments packs need, the dataset and its collate.

    args = training_arguments(output_dir=..., per_device_train_batch_size=1, **yours)
    trainer = Trainer(model=model, args=args, **trainer_data(packs, image_token_id=model.config.image_token_id))

The Trainer takes ``PackedSeqDataset`` (or ``PackedSamples``) as it is, a torch dataset, and
``hf_collate`` lays each batch's items end to end in one row (``training/hf.py``), which
``NoCacheRows`` hands the model with ``use_cache=False`` (with a cache, the model builds no packed mask).
One setting must change from its default: ``remove_unused_columns=True`` wraps the collate in transformers'
``RemoveColumnsCollator``, which keeps only the keys the model's ``forward`` names, so our items reach
``hf_collate`` without ``tokens`` or ``cu_seqlens`` and the first step fails. The loss needs no setting:
the batch carries ``shift_labels``, which the model's ``ForCausalLMLoss`` uses as they are and from
which the Trainer counts ``num_items_in_batch`` (every trained target of the row), so a step's loss is
the mean over the row's targets of the per-sample next-token loss (tests/integrations/).
"""

from __future__ import annotations

from neva_pack.training import hf_collate

__all__ = ["REQUIRED", "NoCacheRows", "check_training_arguments", "trainer_data", "training_arguments"]

REQUIRED = {"remove_unused_columns": False}
"""The TrainingArguments packs need, against the Trainer's defaults."""

_WHY = {
    "remove_unused_columns": "it strips our items down to the model's forward arguments before hf_collate reads "
    "their tokens and cu_seqlens",
}


def _refusal(name: str, value, why: str) -> str:
    return f"{name}={value!r} breaks training on packs: {why}; set {name}={REQUIRED[name]!r}"


def check_training_arguments(args) -> None:
    """Raise ValueError, in one line, for a ``TrainingArguments`` (or ``SFTConfig``) that would break
    training on our packs (``REQUIRED``)."""
    for name, needed in REQUIRED.items():
        if getattr(args, name) != needed:
            raise ValueError(_refusal(name, getattr(args, name), _WHY[name]))


def training_arguments(**settings):
    """``transformers.TrainingArguments(**settings)`` with ``REQUIRED`` set; a setting given against
    them is refused in one line. ``per_device_train_batch_size`` counts items per row: packs for a
    ``PackedSeqDataset`` (a step trains on up to that many packs' positions), samples for ``PackedSamples``."""
    for name, needed in REQUIRED.items():
        if name in settings and settings[name] != needed:
            raise ValueError(_refusal(name, settings[name], _WHY[name]))
    try:
        from transformers import TrainingArguments

        return TrainingArguments(**{**settings, **REQUIRED})
    except ImportError as error:
        raise ImportError(f"the Hugging Face Trainer needs accelerate: pip install 'neva-pack[hf]' ({error})") from error


class NoCacheRows:
    """A ``data_collator``: ``collate``'s row with ``use_cache=False``, which the Trainer passes on to the
    model. The Trainer calls ``model(**batch)`` as it is, and a model whose config says ``use_cache=True``
    (the default) builds a cache and, with it, no packed mask from the restarting positions: Qwen2.5-VL
    then lets a row's samples attend to each other (tests/integrations/). TRL sets it itself."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items: list[dict]) -> dict:
        return {**self.collate(items), "use_cache": False}


def trainer_data(dataset, image_token_id: int | None = None) -> dict:
    """``train_dataset`` and ``data_collator`` for ``Trainer(...)``: the dataset as it is (packs or
    ``PackedSamples``) and ``hf_collate`` with its meta's ignore value and image run, its rows carrying
    ``use_cache=False`` (``NoCacheRows``); ``image_token_id`` (the model's ``config.image_token_id``)
    replaces every image run's feature positions."""
    return {"train_dataset": dataset, "data_collator": NoCacheRows(hf_collate(dataset, image_token_id=image_token_id))}
