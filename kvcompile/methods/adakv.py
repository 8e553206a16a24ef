"""Ada-KV (https://arxiv.org/abs/2407.11550): within a layer, heads compete for one budget by score."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Allocator, descending_rank, per_head_share, pooled_rank, protect, register_allocator


@register_allocator("adakv")
@dataclass
class AdaKV(Allocator):
    """Each layer keeps its uniform share of tokens, chosen as the top scores across all its KV heads, after
    guaranteeing every head its own top ``alpha_safeguard`` fraction of the per-head share (the paper's floor).
    Heads therefore hold different numbers of tokens; the cache stores them ragged, so the bytes really differ."""

    alpha_safeguard: float = 0.2

    def __post_init__(self):
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}")

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, S = scores.shape
        share = per_head_share(lengths, budget)  # [B] per head
        floor = (self.alpha_safeguard * share).long()[None, :, None, None]
        held = scores > float("-inf")
        rank = descending_rank(scores)
        layer_rank = pooled_rank(protect(scores, held & (rank < floor)))
        chosen = (layer_rank < (share * Hkv)[None, :, None]) & held.reshape(L, B, Hkv * S)
        return chosen.reshape(L, B, Hkv, S).sum(-1).minimum(lengths.long())
