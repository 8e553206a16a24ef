"""PyramidKV (https://arxiv.org/abs/2406.02069): budgets shrink linearly from the first layer to the last."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Allocator, per_head_share, register_allocator


@register_allocator("pyramid")
@dataclass
class Pyramid(Allocator):
    """Layer l keeps ``window + floor(top - l * (top - bottom) / (L - 1))`` tokens per head, where bottom =
    (share - window) / beta and top = 2 (share - window) - bottom keep the average at the uniform share: the
    schedule of the authors' code (``PyramidKVCluster``), the window outside the pyramid. Falls back to the uniform
    share only when the share is not above the window.

    Inferred: kvpress 0.5.5's ``PyramidKVPress`` differs in two ways. It keeps SnapKV's uniform share unless
    share / beta >= window, i.e. for every context under beta * window / (1 - compression_ratio) tokens (2,560 at
    compression_ratio 0.75 and window 32), where it is SnapKV exactly; here the pyramid applies at every length.
    Where it does build one, the window sits inside it (bottom = share / beta)."""

    beta: float = 20.0
    window: int = 64

    def __post_init__(self):
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")

    def allocate(self, scores, lengths, budget):
        L = lengths.shape[0]
        share = per_head_share(lengths, budget).double()  # [B]
        room = (share - self.window).clamp_min(0)
        bottom = room / self.beta
        top = 2 * room - bottom
        steps = torch.arange(L, dtype=torch.float64, device=lengths.device)[:, None] / max(L - 1, 1)
        per_layer = self.window + (top - steps * (top - bottom)).floor()  # [L, B]
        per_layer = torch.where(room > 0, per_layer, share)
        return per_layer.long()[:, :, None].minimum(lengths.long())
