"""KVCompose (https://arxiv.org/abs/2509.05165): composite tokens, one rank-aligned budget per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Allocator, Observation, pool_groups, pooled_rank, protect, register_allocator, register_scorer
from .kvzip import GlobalTopK, KVzip
from .tova import _layer_mean as mean_by_position  # TOVA's head mean, heads matched by position

_AGGREGATES = ("mean", "max")


@register_scorer("kvcompose")
@dataclass
class KVCompose(KVzip):
    """The attention the context's second reading pays each context token. The second reading is KVzip's context
    reconstruction, whose plumbing this inherits (with no instruction and no sinks by default, as kvpress reads
    the context alone again): the runtime prefills it on top of the context and drops it after compression. Per
    query head the ``agg_task`` ("max" or "mean") over its queries, then the ``agg_group`` over each GQA group;
    optionally x ||v|| (``add_v_norm``); plus the mean over the layer's KV heads of the same token's score
    (``add_mean_across_heads``, a stabiliser). Pair with the ``kvcompose`` allocator."""

    n_sink: int = 0
    agg_task: str = "max"
    agg_group: str = "mean"
    add_v_norm: bool = False
    add_mean_across_heads: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.agg_task not in _AGGREGATES or self.agg_group not in _AGGREGATES:
            raise ValueError(f"agg_task and agg_group must be 'mean' or 'max', got {self.agg_task!r}, "
                             f"{self.agg_group!r}")

    def score_per_query_head(self, obs: Observation):
        return None  # the head mean mixes query heads' scores

    def score(self, obs: Observation):
        B, Hkv, S, _ = obs.keys.shape
        if self.agg_task == "max":
            agg = self.probe_max(obs)  # KVzip's probe maximum
        else:
            agg = torch.zeros(B, Hkv, obs.queries.shape[1] // Hkv, S, device=obs.keys.device)
            buffer = obs.block_buffer(self.block)
            for queries in obs.query_blocks(self.block):
                attn, keys = obs.attention_span(queries, buffer=buffer)  # [B, Hkv, G, w, s] over the keys they see
                agg[..., keys] += attn.sum(3)
        agg = agg.flatten(1, 2)
        if self.agg_task == "mean":
            agg = agg / (obs.query_positions >= 0).sum(-1).clamp_min(1)[:, None, None]
        scores = pool_groups(agg, Hkv, self.agg_group)
        if self.add_v_norm:
            scores = scores * obs.values.float().norm(dim=-1)
        if self.add_mean_across_heads:
            scores = scores + mean_by_position(scores.masked_fill(~obs.valid, 0.0), obs)
        first = obs.first_query()  # [B]
        scores = scores.masked_fill(obs.positions >= first[:, None, None], float("-inf"))  # the second reading's own
        return protect(scores, obs.positions < self.n_sink)


@register_allocator("kvcompose")
@dataclass
class KVComposeAllocator(Allocator):
    """Each head's scores sorted descending give a curve c_{l,h,r} (r = rank). ``structured``: the layer's
    composite curve C_{l,r} = ``agg_head`` over its heads of c_{l,h,r} (layer 0's replaced by the max over layers,
    so it never gets the least); the budget's top (layer, rank) entries of C give layer l its count m_l, and every
    head of the layer keeps its own top m_l ("composite tokens": sum_l m_l * Hkv = budget, rectangular per layer).
    Unstructured: the top over every (layer, head, rank) of c, i.e. one global top-k (ragged per head). Ranks below
    ``keep_token_lower_bound`` (structured: below at least 1) are kept first.

    ``whole_pages``: the competition is between whole pages, since a byte budget pays for them: structured, layer
    l's p-th block of ranks (one page in each of its heads) is worth the sum of C_{l,r} over the block's ranks, and
    the blocks worth most within the budget's pages are kept (C falls with r, so each layer keeps a prefix of its
    ranks); unstructured, ``GlobalTopK``'s competition between pages. Without it, the engine rounds m_l down to
    pages by partial-page size alone, which at 0.1 of SmolLM2's cache emptied whole layers (docs/kvpress.md).

    Inferred: kvpress floors every layer at one token on top of its budget; here that floor comes out of it (with
    ``whole_pages``, a layer's first page, as a token costs one)."""

    structured: bool = True
    agg_head: str = "mean"
    keep_token_lower_bound: int = 0
    whole_pages: bool = False

    def __post_init__(self):
        if self.agg_head not in _AGGREGATES or self.keep_token_lower_bound < 0:
            raise ValueError(f"agg_head must be 'mean' or 'max' and keep_token_lower_bound >= 0, got "
                             f"{self.agg_head!r}, {self.keep_token_lower_bound}")

    def _curves(self, scores):
        """Each head's scores sorted descending, the kept-first ranks boosted; and, structured, the composite
        curve [B, L, S] (-inf at ranks no head of the layer holds)."""
        L, B, Hkv, S = scores.shape
        curves = scores.sort(-1, descending=True).values  # -inf past each head's length
        held = curves > float("-inf")
        floor = max(self.keep_token_lower_bound, 1 if self.structured else 0)
        curves = curves + 1e9 * (torch.arange(S, device=scores.device) < floor)
        if not self.structured:
            return curves, None
        if self.agg_head == "mean":  # [L, B, S], over the heads that hold rank r
            composite = curves.masked_fill(~held, 0.0).sum(2) / held.sum(2).clamp_min(1)
        else:
            composite = curves.amax(2)
        composite[0] = composite.amax(0)
        return curves, composite.masked_fill(~held.any(2), float("-inf")).permute(1, 0, 2)

    def allocate_pages(self, scores, lengths, max_pages, page_size):
        if not self.whole_pages:
            return None
        curves, composite = self._curves(scores)
        if composite is None:
            return GlobalTopK(whole_pages=True).allocate_pages(curves, lengths, max_pages, page_size)
        L, B, Hkv, S = scores.shape
        n = -(-S // page_size)
        worth = torch.nn.functional.pad(composite.clamp_min(0).double(), (0, n * page_size - S))
        worth = worth.unflatten(-1, (n, page_size)).sum(-1)  # [B, L, n]
        held = -(-lengths.long().amax(2).T // page_size)  # [B, L] the pages of the layer's longest head
        worth = worth.masked_fill(torch.arange(n, device=scores.device) >= held[..., None], float("-inf"))
        chosen = (pooled_rank(worth) < (max_pages // Hkv)[:, None]) & (worth.flatten(-2) > float("-inf"))
        blocks = chosen.view(B, L, n).sum(-1).T  # [L, B]
        return (blocks[..., None] * page_size).minimum(lengths.long())

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, S = scores.shape
        curves, composite = self._curves(scores)
        if composite is None:
            return GlobalTopK().allocate(curves, lengths, budget)
        chosen = (pooled_rank(composite).view(B, L, S) < (budget // Hkv)[:, None, None]) & (composite > float("-inf"))
        return chosen.sum(-1).T[..., None].expand(L, B, Hkv).minimum(lengths.long())
