"""The processor's rescale + normalise as the numbers a reader needs: uint8 pixels stay uint8 on
disk and are normalised on read, bit-identically to transformers' image processors.

Normalisation of a uint8 pixel ``v`` of channel ``c``, with the float ops of transformers'
image processors (``rescale`` in float64 then float32, ``normalize`` in float32)::

    r = float32(float64(v) * rescale_factor)
    x = (r - float32(mean[c])) / float32(std[c])          # float32 subtraction, float32 division

The CPU reader runs exactly these ops in a numba kernel (``normalise_kernel``); on an accelerator
the 3 x 256 values are computed once with them (``Normalisation.lut``) and pixels are looked up.
Either way the result is bit-identical to the processor's (tested on every uint8 value). It lives in
core because the families make it (from a processor's settings) and the formats and readers use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from neva_pack.core.errors import InputError

__all__ = ["Normalisation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Normalisation:
    """The processor's rescale + normalise, as the numbers a reader needs."""

    rescale_factor: float
    """Multiplier applied to the uint8 values in float64 (1/255 for CLIP and SigLIP; 1.0 when off)."""
    mean: tuple[float, float, float]
    """Per-channel mean subtracted after rescaling (0.0 when normalising is off)."""
    std: tuple[float, float, float]
    """Per-channel standard deviation divided by (1.0 when normalising is off)."""

    def lut(self) -> np.ndarray:
        """float32 (3, 256): the normalised value of every uint8 value of every channel."""
        return _lut(self.rescale_factor, tuple(self.mean), tuple(self.std))

    def apply(self, pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 (N, 3, H, W) -> float32 (N, 3, H, W), into ``out`` if given (a writer reuses one buffer).

        The kernel releases the GIL: a writer thread normalises while the main thread assembles."""
        out = np.empty(pixels.shape, dtype=np.float32) if out is None else out
        if out.shape != pixels.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 array of shape {pixels.shape}")
        if pixels.size:
            from neva_pack.core.normalise_kernel import normalise

            mean, std = np.asarray(self.mean, dtype=np.float32), np.asarray(self.std, dtype=np.float32)
            normalise(np.ascontiguousarray(pixels), np.float64(self.rescale_factor), mean, std, out)
        return out

    def apply_views(self, views: list[np.ndarray]) -> np.ndarray:
        """Like ``apply`` on the stacked (1, 3, H, W) views, without copying the uint8 pixels first."""
        from neva_pack.core.normalise_kernel import normalise

        out = np.empty((len(views), *views[0].shape[1:]), dtype=np.float32)
        mean, std = np.asarray(self.mean, dtype=np.float32), np.asarray(self.std, dtype=np.float32)
        for k, view in enumerate(views):
            normalise(view, np.float64(self.rescale_factor), mean, std, out[k : k + 1])
        return out

    def apply_torch(self, pixels, device=None, dtype=None):
        """uint8 tensor or array (N, 3, H, W) -> normalised tensor on ``device`` in ``dtype``.

        On an accelerator the uint8 pixels travel (a quarter of float32's bytes) and the lookup
        happens there; either way each value is the float32 value above, then cast to ``dtype``.
        """
        import torch

        if device is None or torch.device(device).type == "cpu":
            values = torch.from_numpy(self.apply(np.asarray(pixels)))
            return values if dtype is None or dtype == torch.float32 else values.to(dtype)
        pixels = torch.as_tensor(pixels).to(device, non_blocking=True)
        table = torch.tensor(self.lut(), device=device)
        channel = (torch.arange(3, device=device) * 256).view(1, 3, 1, 1)
        values = torch.take(table, pixels.long() + channel)
        return values if dtype is None or dtype == torch.float32 else values.to(dtype)

    def invert(self, values: np.ndarray) -> np.ndarray:
        """float32 (N, 3, H, W) normalised -> uint8, exactly; InputError if a value is not one of the 256."""
        table = self.lut()
        out = np.empty(values.shape, dtype=np.uint8)
        for c in range(3):
            order = np.argsort(table[c])
            where = np.searchsorted(table[c][order], values[:, c])
            where = np.minimum(where, 255)
            found = order[where]
            if not np.array_equal(table[c][found], values[:, c]):
                raise InputError("image values that this normalisation does not produce (not written by neva_pack?)")
            out[:, c] = found
        return out

    def to_json(self) -> dict:
        return {"rescale_factor": self.rescale_factor, "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_json(cls, data: dict) -> "Normalisation":
        return cls(rescale_factor=float(data["rescale_factor"]), mean=tuple(map(float, data["mean"])),
                   std=tuple(map(float, data["std"])))  # fmt: skip


@functools.cache
def _lut(rescale_factor: float, mean: tuple, std: tuple) -> np.ndarray:
    rescaled = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    table = (rescaled[None, :] - np.asarray(mean, dtype=np.float32)[:, None]) / np.asarray(std, dtype=np.float32)[:, None]
    table.setflags(write=False)
    return table
