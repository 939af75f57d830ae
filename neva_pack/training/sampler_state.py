"""The state of a ``PackedBatchSampler`` (``state_dict`` / ``load_state_dict``): where a rank is, and a
fingerprint of what its epochs were planned over, so that a state is resumed only over the same plan.

A resumed sampler re-plans its epoch (the plan is a pure function of the per-sample figures and the
settings) and starts at the saved step. Over other inputs, the same step of another plan hands out
other samples: the rest of the epoch trains samples twice and skips others, silently. So a state
carries, beside ``epoch`` and ``step``:

    lengths_digest      xxh3-128 of the per-sample figures the plan is made of: lengths, images, image
                        tokens, vision cost (another packing of as many records differs here)
    meta_checksum       the packed output's meta checksum (``for_samples``), None for plain lengths
    step_cost_model     the model its steps are balanced by (name#digest; None: the attention order)
    seed capacity num_replicas algorithm drop_last tolerance pack_options batches_of
    max_images_per_pack max_image_tokens_per_pack     the budgets
    num_samples total_length vision_cost              readable summaries of the inputs (in messages)

``load_state_dict`` refuses, in one line naming the field: a missing or unknown key, a fingerprint field
that differs, an epoch or step that is not a non-negative integer, or a step past its epoch's batches.

States of version 1 (saved before the fingerprint) are refused: they cannot be checked against these
inputs (the issue they leave open is exactly a state over another packing of as many records). The
line says how to resume one anyway, knowingly: load this sampler's own state with the old epoch and step.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["STATE_VERSION", "check_state", "lengths_digest", "meta_checksum_of", "state_of"]

STATE_VERSION = 2
"""Version of the state's layout (1: before the fingerprint; refused)."""
_POSITION = ("epoch", "step")


def lengths_digest(*arrays: np.ndarray | None) -> str:
    """xxh3-128 of the per-sample arrays a plan is made of (an absent one hashed as absent)."""
    import xxhash

    digest = xxhash.xxh3_128()
    for array in arrays:
        if array is None:
            digest.update(b"\x00none")
            continue
        values = np.ascontiguousarray(np.asarray(array, dtype="<i8"))
        digest.update(b"\x01" + len(values).to_bytes(8, "little"))
        digest.update(values.tobytes())
    return digest.hexdigest()


def meta_checksum_of(meta) -> str | None:
    """The meta checksum of a packed output's meta (what its file holds: a meta written back is its bytes)."""
    if meta is None or not hasattr(meta, "to_json"):
        return None
    return meta.to_json()["meta_checksum"]


def state_of(fingerprint: dict, epoch: int, step: int) -> dict:
    """A state as ``state_dict`` gives it: JSON-able, flat."""
    return {"version": STATE_VERSION, "epoch": int(epoch), "step": int(step), **fingerprint}


def check_state(state, fingerprint: dict, batches_in) -> tuple[int, int]:
    """(epoch, step) of ``state`` once it is this sampler's (``fingerprint``) and in range
    (``batches_in(epoch)``: the batches of that epoch); ValueError, one line naming the field, otherwise."""
    if not isinstance(state, dict):
        raise ValueError(f"sampler state: a dict expected, got {type(state).__name__}")
    version = state.get("version")
    if version == 1:
        raise ValueError(
            "sampler state of version 1 predates the fingerprint of what it was planned over (lengths digest, meta checksum) "
            "and cannot be checked against these inputs; if you know it was saved over these very inputs, resume it with "
            "sampler.load_state_dict({**sampler.state_dict(), 'epoch': old['epoch'], 'step': old['step']})"
        )
    if version != STATE_VERSION:
        raise ValueError(f"sampler state version {version!r}, this neva_pack reads {STATE_VERSION}")
    expected = {"version", *_POSITION, *fingerprint}
    missing = [name for name in (*_POSITION, *fingerprint) if name not in state]
    if missing:
        raise ValueError(f"sampler state has no {missing[0]!r} (saved by another program, or edited)")
    unknown = sorted(str(name) for name in set(state) - expected)
    if unknown:
        raise ValueError(f"sampler state has an unknown field {unknown[0]!r} (saved by another program, or edited)")
    for name, value in fingerprint.items():
        if state[name] != value or type(state[name]) is not type(value):  # True is not 1, 5.0 is not 5: edited
            why = _WHY.get(name, "")
            raise ValueError(f"the sampler state was saved with {name}={state[name]!r}, this sampler has {value!r}{why}")
    epoch, step = state["epoch"], state["step"]
    for name, value in (("epoch", epoch), ("step", step)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise ValueError(f"sampler state {name}={value!r}: must be a non-negative integer")
    batches = batches_in(int(epoch))
    if step > batches:
        raise ValueError(f"sampler state step={step!r}: epoch {epoch} has {batches} batches (edited, or saved by another plan)")
    return int(epoch), int(step)


_WHY = {
    "lengths_digest": " (planned over other samples: their lengths, images or vision cost differ)",
    "meta_checksum": " (planned over another packed output)",
    "step_cost_model": " (its steps balanced by another step cost model: --step_cost_model / step_cost_model)",
}
"""What a differing fingerprint field means, where its value alone does not say."""
