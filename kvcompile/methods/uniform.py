"""Every (layer, KV head) keeps the same number of tokens: the allocation most published methods use."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Allocator, per_head_share, register_allocator


@register_allocator("uniform")
@dataclass
class Uniform(Allocator):
    """Equal share per (layer, KV head), capped by what each head holds."""

    def allocate(self, scores, lengths, budget):
        return per_head_share(lengths, budget)[None, :, None].minimum(lengths.long())
