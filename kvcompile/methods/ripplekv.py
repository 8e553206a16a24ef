"""RippleKV (https://arxiv.org/abs/2608.08684): layer budgets from the KL a perturbed value cache causes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Allocator, register_allocator
from .shares import water_fill


@register_allocator("ripplekv")
@dataclass
class RippleKV(Allocator):
    """Layer l's share of the budget grows as ``ratio ** s_l`` with its min-max normalised sensitivity s_l (the
    most sensitive layer gets ``ratio`` times the least sensitive one's share); the layer's KV heads split it
    evenly, and what a head cannot hold goes to the others (total preserved).

    Inferred from the abstract alone: the noise form, the KL measure, the normalisation
    and the exponential map with its ratio. ``layer_sensitivity`` comes from ``calibration.ripplekv.calibrate``
    (measured once per model and cached on disk); without it every layer weighs the same, which is the uniform
    allocation.
    """

    layer_sensitivity: tuple[float, ...] | None = None
    ratio: float = 4.0

    def __post_init__(self):
        if self.ratio < 1:
            raise ValueError(f"ratio must be >= 1, got {self.ratio}")
        if self.layer_sensitivity is not None:
            if any(not s >= 0 for s in self.layer_sensitivity):  # also rejects NaN
                raise ValueError(f"layer_sensitivity must be >= 0, got {self.layer_sensitivity}")
            self.layer_sensitivity = tuple(float(s) for s in self.layer_sensitivity)

    def layer_weights(self, num_layers: int) -> Tensor:
        """[L] budget weight per layer."""
        if self.layer_sensitivity is None:
            return torch.ones(num_layers, dtype=torch.float64)
        if len(self.layer_sensitivity) != num_layers:
            raise ValueError(f"layer_sensitivity has {len(self.layer_sensitivity)} layers, the model has {num_layers}")
        s = torch.tensor(self.layer_sensitivity, dtype=torch.float64)
        spread = s.max() - s.min()
        normalised = (s - s.min()) / spread if spread > 0 else torch.zeros_like(s)
        return self.ratio**normalised

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, _ = scores.shape
        weights = self.layer_weights(L).to(scores.device)[None, :, None].expand(B, L, Hkv).reshape(B, L * Hkv)
        caps = lengths.long().permute(1, 0, 2).reshape(B, L * Hkv)
        return water_fill(weights, caps, budget).reshape(B, L, Hkv).permute(1, 0, 2)
