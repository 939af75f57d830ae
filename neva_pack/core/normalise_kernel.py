"""numba kernel of the readers: uint8 pixels -> normalised float32 with the processor's float ops.

    r = float32(float64(v) * rescale_factor);  x = (r - mean[c]) / std[c]     (float32)

The same IEEE operations in the same order as transformers' rescale + normalize (no fused
multiply-add: fastmath is off), so the values are bit-identical; vectorised, so that normalising on
read costs little beside the read (tests compare it with the processor on every uint8 value).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def normalise(pixels, scale, mean, std, out):
    """out[n, c] = (float32(float64(pixels[n, c]) * scale) - mean[c]) / std[c] for uint8 (N, C, H, W)."""
    count, channels = pixels.shape[0], pixels.shape[1]
    plane = pixels.shape[2] * pixels.shape[3]
    source = pixels.reshape(count * channels, plane)
    target = out.reshape(count * channels, plane)
    for k in range(count * channels):
        m = mean[k % channels]
        s = std[k % channels]
        row, dest = source[k], target[k]
        for i in range(plane):
            dest[i] = (np.float32(np.float64(row[i]) * scale) - m) / s
