"""Per-layer budgets (kvpress's PerLayerCompressionPress): a fixed compression ratio for every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Allocator, register_allocator


@register_allocator("per-layer")
@dataclass
class PerLayer(Allocator):
    """Layer l keeps ``1 - compression_ratios[l]`` of what it would keep under one shared ratio, rescaled so the
    layers together spend the budget: at a budget equal to the mean keep fraction, layer l keeps exactly
    ``1 - compression_ratios[l]`` of its tokens, as in kvpress (which takes the ratios as given, so its budget is
    nominal). Every head of a layer keeps the same count; a layer never keeps more than it holds."""

    compression_ratios: tuple = ()

    def __post_init__(self):
        self.compression_ratios = tuple(float(r) for r in self.compression_ratios)
        if not self.compression_ratios or not all(0.0 <= r < 1.0 for r in self.compression_ratios):
            raise ValueError(f"per-layer: compression_ratios must be a non-empty list of ratios in [0, 1), one per "
                             f"layer, got {list(self.compression_ratios)}: pass them with "
                             f"recipes.compose('per-layer', <recipe>, compression_ratios=[...])")

    def check(self, num_layers: int) -> None:
        if len(self.compression_ratios) != num_layers:
            raise ValueError(f"per-layer: {len(self.compression_ratios)} compression_ratios for a model with "
                             f"{num_layers} layers")

    def allocate(self, scores, lengths, budget):
        L, _, Hkv = lengths.shape
        keep = 1 - torch.tensor(self.compression_ratios, dtype=torch.float64, device=lengths.device)
        per_head = budget.double()[None, :] * keep[:, None] / (keep.sum() * Hkv)  # [L, B]
        return per_head.floor().long()[:, :, None].minimum(lengths.long())
