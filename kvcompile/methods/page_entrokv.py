"""Page-EntroKV (https://arxiv.org/abs/2610.03135): entropy-weighted GQA pooling, eviction by whole pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGES, Allocator, Observation, Scorer, protect, register_allocator, register_scorer
from .shares import water_fill


@register_scorer("page-entrokv")
@dataclass
class PageEntroKV(Scorer):
    """Each query head's window attention, pooled over its GQA group with weights softmax(-H2 / ``tau``), where
    H2 = -ln sum_t A(t)^2 is the head's Renyi-2 (collision) entropy over the non-sink tokens (attention
    renormalised without the first ``sinks`` positions), so focused heads weigh more and a head that only looks
    at the sinks does not pass for focused. The sinks are kept.

    From the abstract; inferred: the observed queries (the last ``window`` of the prompt, as SnapKV), the sink
    count, and removing + renormalising for "sink-isolated". ``tau`` is the group temperature of the unofficial
    Entro-Prefill code. Pair with the ``page-entrokv`` allocator, which projects these scores onto pages.
    """

    window: int = 32
    sinks: int = 4
    tau: float = 1.0

    def __post_init__(self):
        if self.window < 1 or self.sinks < 0 or self.tau <= 0:
            raise ValueError(f"need window >= 1, sinks >= 0, tau > 0; got {self.window}, {self.sinks}, {self.tau}")

    @property
    def observation_window(self) -> int:
        return self.window

    def score_per_query_head(self, obs: Observation):
        return obs.window_attention().mean(2)  # [B, Hq, S]

    def group_weights(self, attn: Tensor, sink: Tensor, num_kv_heads: int) -> Tensor:
        """Entropy weights [B, Hkv, G] of the query heads of each group; attn [B, Hq, S], sink [B, Hkv, S]."""
        B, Hq, S = attn.shape
        rest = attn.reshape(B, num_kv_heads, Hq // num_kv_heads, S).masked_fill(sink[:, :, None], 0.0)
        rest = rest / rest.sum(-1, keepdim=True).clamp_min(torch.finfo(rest.dtype).tiny)
        collision = rest.pow(2).sum(-1).clamp_min(torch.finfo(rest.dtype).tiny)  # 0 only if a head saw nothing
        return torch.softmax(collision.log() / self.tau, -1)  # -H2 = ln sum A^2

    def score(self, obs: Observation):
        B, Hkv, S, _ = obs.keys.shape
        attn = self.score_per_query_head(obs)
        sink = obs.valid & (obs.positions < self.sinks)
        weights = self.group_weights(attn, sink, Hkv)
        pooled = (attn.reshape(B, Hkv, -1, S) * weights[..., None]).sum(2)
        return protect(pooled, sink)


@register_allocator("page-entrokv")
@dataclass
class PageEviction(Allocator):
    """The eviction unit is a (layer, KV group, page): each head keeps the same number of whole pages, the pages
    whose best token scores highest (pages a head cannot fill go to the others). One selection per KV head is
    shared by its query heads, so the union overhead ratio is 1 by construction.

    From the abstract; the unofficial code's entropy-based layer budgets and pinned anchor pages are left out.
    """

    strategy = PAGES

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, _ = scores.shape
        pages = lengths.long().permute(1, 0, 2).reshape(B, L * Hkv)
        counts = water_fill(torch.ones_like(pages, dtype=torch.float64), pages, budget)
        return counts.reshape(B, L, Hkv).permute(1, 0, 2)
