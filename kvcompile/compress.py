"""Compression of a filled cache: score -> allocate -> fit to whole pages -> select top-k -> compact -> free pages.

Two allocator flags (``methods.base.Allocator``) vary the middle steps: ``page_granular`` allocates and keeps
whole pages (scores projected onto pages by their max), and ``tail_summary`` spends the last counted slot of a head
that evicts on one summary row of its evicted tail, written after the kept tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .cache import PagedKVCache
from .kernels import reference
from .methods import Allocator, Observation, Scorer


def observe(cache: PagedKVCache, layer: int, scale: float, window: int) -> Observation:
    keys, values, positions, valid = cache.dense(layer)
    return Observation(
        keys, values, positions, valid, cache.obs_q[layer], cache.obs_pos, scale, window, layer, cache.num_layers
    )


def score_all(cache: PagedKVCache, scorer: Scorer, scales, windows, allocator: Allocator | None = None):
    """[L, B, Hkv, S] scores, -inf where a head holds nothing (S is the longest head of any layer), and the
    allocator's ``layer_stats`` stacked over layers (None when it needs none)."""
    S = int(cache.lengths.max())
    out = torch.full((*cache.lengths.shape, S), float("-inf"), device=cache.device)
    stats = []
    for layer in range(cache.num_layers):
        obs = observe(cache, layer, scales[layer], windows[layer])
        s = scorer.score(obs).float().nan_to_num(0.0, posinf=torch.finfo(torch.float32).max)
        s = s.clamp_min(-torch.finfo(torch.float32).max).masked_fill(~obs.valid, float("-inf"))
        out[layer, :, :, : s.shape[-1]] = s[..., :S]
        if allocator is not None:
            stats.append(allocator.layer_stats(obs, out[layer]))
    return out, (None if not stats or stats[0] is None else torch.stack(stats))


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


def top_mask(scores: Tensor, counts: Tensor) -> Tensor:
    """[..., S] bool: each head's ``counts`` [...] highest scores (ties go to the earlier token)."""
    rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return rank < counts[..., None]


def kept_indices(kept: Tensor) -> Tensor:
    """Logical indices [..., K] of the ``kept`` [..., S] tokens, ascending; K is the most any head keeps."""
    S = kept.shape[-1]
    idx = torch.arange(S, device=kept.device).expand_as(kept)
    K = max(int(kept.sum(-1).max()), 1)
    return torch.where(kept, idx, S).sort(-1).values[..., :K]


def keep_pages(allocator: Allocator, scores: Tensor, lengths: Tensor, max_pages: Tensor, page_size: int, *stats):
    """Page-granular selection: [L, B, Hkv, S] bool keeping whole logical pages, at most ``max_pages`` [B] per
    sequence. A page scores the max of its tokens; a head's last page may be partial (it still costs a page)."""
    S, P = scores.shape[-1], page_size
    n_pages = -(-S // P)
    page_scores = F.pad(scores, (0, n_pages * P - S), value=float("-inf")).unflatten(-1, (n_pages, P)).amax(-1)
    held = (lengths + P - 1) // P
    pages = allocator.allocate(page_scores, held, max_pages, *stats).long().clamp(min=0).minimum(held)
    kept = top_mask(page_scores, pages).repeat_interleave(P, dim=-1)[..., :S]
    return kept & (scores > float("-inf"))


def summaries(cache: PagedKVCache, allocator: Allocator, kept: Tensor, scales, windows):
    """Each head's summary row of its evicted tokens, from the dense cache before compaction: keys, values
    [L, B, Hkv, D] and positions [L, B, Hkv]."""
    out = []
    for layer in range(cache.num_layers):
        obs = observe(cache, layer, scales[layer], windows[layer])
        evicted = obs.valid & ~F.pad(kept[layer], (0, obs.valid.shape[-1] - kept.shape[-1]), value=False)
        out.append(allocator.summarize(obs, evicted))
    return [torch.stack(x) for x in zip(*out)]


def write_rows(cache: PagedKVCache, index: Tensor, where: Tensor, keys: Tensor, values: Tensor, positions: Tensor):
    """Write one row per head at logical ``index`` [L, B, Hkv] where ``where`` [L, B, Hkv] holds (the page must be
    owned). keys, values [L, B, Hkv, D]; positions [L, B, Hkv]."""
    L, B, Hkv = index.shape
    D = cache.head_dim
    rows = reference.rows_of(cache.page_table.reshape(L * B, Hkv, -1), index.reshape(L * B, Hkv, 1), cache.page_size)
    rows, where = rows.reshape(-1)[where.reshape(-1)], where.reshape(-1)
    cache.k_pages.view(-1, D).index_copy_(0, rows, keys.reshape(-1, D)[where].to(cache.dtype))
    cache.v_pages.view(-1, D).index_copy_(0, rows, values.reshape(-1, D)[where].to(cache.dtype))
    cache.page_pos.view(-1).index_copy_(0, rows, positions.reshape(-1)[where].to(cache.page_pos.dtype))


def compact_heads(cache: PagedKVCache, keep: Tensor, counts: Tensor) -> None:
    """Move each head's first ``counts`` [L, B, Hkv] tokens of ``keep`` [L, B, Hkv, K] (ascending logical indices)
    to the front of its pages (``ops.compact``); lengths and pages are the caller's to update."""
    L, B, Hkv = counts.shape
    ops.compact(
        cache.k_pages, cache.v_pages, cache.page_pos,
        cache.page_table.reshape(L * B, Hkv, -1), keep.reshape(L * B, Hkv, -1), counts.reshape(L * B, Hkv),
    )


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
    max_pages = budget_bytes // cache.page_bytes
    scores, stats = score_all(cache, scorer, scales, windows, allocator)
    stats = () if stats is None else (stats,)
    rows = None
    if allocator.page_granular:
        kept = keep_pages(allocator, scores, lengths, max_pages, cache.page_size, *stats)
        counts = real = kept.sum(-1)
    else:
        counts = allocator.allocate(scores, lengths, budget_bytes // cache.token_bytes, *stats)
        counts = fit_to_pages(counts.long().clamp(min=0).minimum(lengths), max_pages, cache.page_size)
        summary = (counts < lengths) & (counts > 0) & allocator.tail_summary  # the last counted slot summarises
        real = counts - summary.long()
        kept = top_mask(scores, real)
        if allocator.tail_summary:
            rows = summaries(cache, allocator, kept, scales, windows)
    compact_heads(cache, kept_indices(kept), real)
    if rows is not None:  # after compaction, so the row lands right after the kept tokens
        write_rows(cache, real, summary, *rows)
    cache.lengths = counts.to(torch.int32)
    cache.release_unused()
    cache.trim(spare_pages)
