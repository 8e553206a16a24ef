"""The orthonormal Walsh-Hadamard transform: rotated codecs spread an outlier channel over every channel with it."""

from __future__ import annotations

import torch
from torch import Tensor


def fwht(x: Tensor) -> Tensor:
    """The orthonormal Walsh-Hadamard transform of rows x [..., D] (D a power of two); its own inverse."""
    D = x.shape[-1]
    if D & (D - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {D}")
    y, h = x.float(), 1
    while h < D:
        pairs = y.unflatten(-1, (D // (2 * h), 2, h))
        y = torch.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], -2).flatten(-3)
        h *= 2
    return y / D**0.5
