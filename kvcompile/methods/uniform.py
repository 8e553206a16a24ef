"""Every (layer, KV head) keeps the same number of tokens: the allocation most published methods use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Allocator, per_head_share, register_allocator
from .shares import water_fill


@register_allocator("uniform")
@dataclass
class Uniform(Allocator):
    """Equal share per (layer, KV head), capped by what each head holds; what a capped head leaves (a
    sliding-window layer holding only its window: ``compress.out_of_window``) goes to the others in equal parts
    (water-filling). With no head capped, every head gets exactly the share."""

    def allocate(self, scores, lengths, budget):
        L, B, Hkv = lengths.shape
        caps = lengths.long().permute(1, 0, 2).reshape(B, L * Hkv)
        counts = water_fill(torch.ones(caps.shape, device=caps.device), caps, per_head_share(lengths, budget) * L * Hkv)
        return counts.reshape(B, L, Hkv).permute(1, 0, 2)
