"""Compression of a filled cache: score -> allocate -> fit to whole pages -> select top-k -> compact -> free pages."""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .cache import PagedKVCache
from .methods import Allocator, Observation, Scorer


def observe(cache: PagedKVCache, layer: int, scale: float, window: int) -> Observation:
    keys, values, positions, valid = cache.dense(layer)
    return Observation(
        keys, values, positions, valid, cache.obs_q[layer], cache.obs_pos, scale, window, layer, cache.num_layers
    )


def score_all(cache: PagedKVCache, scorer: Scorer, scales, windows) -> Tensor:
    """[L, B, Hkv, S] scores, -inf where a head holds nothing; S is the longest head of any layer."""
    S = int(cache.lengths.max())
    out = torch.full((*cache.lengths.shape, S), float("-inf"), device=cache.device)
    for layer in range(cache.num_layers):
        obs = observe(cache, layer, scales[layer], windows[layer])
        s = scorer.score(obs).float().nan_to_num(0.0, posinf=torch.finfo(torch.float32).max)
        s = s.clamp_min(-torch.finfo(torch.float32).max).masked_fill(~obs.valid, float("-inf"))
        out[layer, :, :, : s.shape[-1]] = s[..., :S]
    return out


def fit_to_pages(counts: Tensor, max_pages: Tensor, page_size: int) -> Tensor:
    """Round the heads with the smallest partial page down until each sequence fits ``max_pages`` [B] pages.

    Heads that would be left empty are rounded down last.

    counts [L, B, Hkv]. If the counts sum to at most ``max_pages * page_size`` tokens, the overflow is at most the
    number of partly filled pages, so rounding that many heads down always suffices.
    """
    L, B, Hkv = counts.shape
    flat = counts.permute(1, 0, 2).reshape(B, L * Hkv)
    rem = flat % page_size
    over = ((flat + page_size - 1) // page_size).sum(-1) - max_pages  # [B]
    cost = rem + page_size * (flat < page_size)  # emptying a head is the last resort
    order = cost.masked_fill(rem == 0, 2 * page_size).argsort(dim=-1, stable=True).argsort(dim=-1)
    cut = (order < over[:, None]) & (rem > 0)
    flat = torch.where(cut, flat - rem, flat)
    return flat.reshape(B, L, Hkv).permute(1, 0, 2).contiguous()


def select(scores: Tensor, counts: Tensor) -> Tensor:
    """Kept logical indices [..., K], ascending in their first ``counts`` entries: each head's top scores."""
    rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    keep = rank < counts[..., None]
    S = scores.shape[-1]
    idx = torch.arange(S, device=scores.device).expand_as(scores)
    K = max(int(counts.max()), 1)
    return torch.where(keep, idx, S).sort(-1).values[..., :K]


def compress(
    cache: PagedKVCache,
    scorer: Scorer,
    allocator: Allocator,
    budget_bytes: Tensor,
    scales,
    windows,
    spare_pages: int = 0,
) -> None:
    """Shrink every sequence of ``cache`` to at most ``budget_bytes`` [B] bytes of K/V pages, in place."""
    lengths = cache.lengths.long()
    budget_tokens = budget_bytes // cache.token_bytes
    max_pages = budget_bytes // cache.page_bytes
    scores = score_all(cache, scorer, scales, windows)
    counts = allocator.allocate(scores, lengths, budget_tokens).long().clamp(min=0).minimum(lengths)
    counts = fit_to_pages(counts, max_pages, cache.page_size)
    keep = select(scores, counts)
    L, B, Hkv = counts.shape
    ops.compact(
        cache.k_pages, cache.v_pages, cache.page_pos,
        cache.page_table.reshape(L * B, Hkv, -1), keep.reshape(L * B, Hkv, -1), counts.reshape(L * B, Hkv),
    )
    cache.lengths = counts.to(torch.int32)
    cache.release_unused()
    cache.trim(spare_pages)
