"""Prefill compression: score -> allocate -> plan (by the allocator's declared strategy) -> ``PagedKVCache.keep``.

Strategies (``PLANNERS``, one per ``methods.Strategy`` an allocator declares): ``tokens`` keeps each head's top
tokens; ``pages`` allocates and keeps whole pages (scores projected onto pages by their max); ``tail-summary``
spends the last counted slot of a head that evicts on one new weighted entry summarising its evicted tail;
``prototypes`` and ``memory`` let the allocator choose kept tokens and weighted entries. Every one ends in a
``plan.Plan`` whose budget holds after page rounding. With a page format, tokens cost what the format stores
(``PagedKVCache.stored_token_bytes``) and the plan stores every kept entry in it: one byte budget spent on
eviction and quantization together.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from .cache import PagedKVCache
from .encoding import encoder_of
from .kernels.formats import get_format
from .methods import Allocator, Scorer
from .methods.base import MEMORY, PAGES, PROTOTYPES, TAIL_SUMMARY, TOKENS, is_pinned
from .observation import observe
from .plan import DTYPE_FORMAT, STORED_FORMAT, NewEntries, Plan, padded, pinned_levels, rank, select
from .spec import LayerSpec

NEVER = -torch.finfo(torch.float32).max  # a scorer's -inf as ``score_all`` passes it: ranked last, and no candidate


def score_all(cache: PagedKVCache, scorer: Scorer, layers: tuple[LayerSpec, ...], allocator: Allocator | None = None,
              dense: dict | None = None):
    """[L, B, Hkv, S] scores, -inf where a head holds nothing (S is the longest head of any layer), and the
    allocator's ``layer_stats`` stacked over layers (None when it needs none). ``dense``: what the dense passes
    supplied (``observation.reconstructing``)."""
    S = int(cache.held().max())
    out = torch.full((*cache.lengths.shape, S), float("-inf"), device=cache.device)
    stats = []
    for layer in layers:
        obs = observe(cache, layer, dense)
        s = scorer.score(obs).float().nan_to_num(0.0, posinf=torch.finfo(torch.float32).max)
        s = s.clamp_min(NEVER).masked_fill(~obs.valid, float("-inf"))
        out[layer.index, :, :, : s.shape[-1]] = s[..., :S]
        if allocator is not None:
            stats.append(allocator.layer_stats(obs, out[layer.index]))
    return out, (() if not stats or stats[0] is None else (torch.stack(stats),))


def fit_to_pages(counts: Tensor, max_pages: Tensor, page_size: int, floor: Tensor | None = None) -> Tensor:
    """Round the heads with the smallest partial page down until each sequence fits ``max_pages`` [B] pages.

    Heads that would be left empty are rounded down last; none goes below ``floor`` [L, B, Hkv] (then it may not fit).

    counts [L, B, Hkv]. If the counts sum to at most ``max_pages * page_size`` tokens, the overflow is at most the
    number of partly filled pages, so rounding that many heads down always suffices (without a floor).
    """
    L, B, Hkv = counts.shape
    flat = counts.permute(1, 0, 2).reshape(B, L * Hkv)
    rem = flat % page_size
    over = ((flat + page_size - 1) // page_size).sum(-1) - max_pages  # [B]
    cost = rem + page_size * (flat < page_size)  # emptying a head is the last resort
    stays = rem == 0 if floor is None else (rem == 0) | (flat - rem < floor.permute(1, 0, 2).reshape(B, L * Hkv))
    order = cost.masked_fill(stays, 2 * page_size).argsort(dim=-1, stable=True).argsort(dim=-1)
    cut = (order < over[:, None]) & ~stays
    flat = torch.where(cut, flat - rem, flat)
    return flat.reshape(B, L, Hkv).permute(1, 0, 2).contiguous()


def out_of_window(cache: PagedKVCache, layers, seen: Tensor) -> Tensor:
    """[L, B, Hkv, S] True at the entries of a sliding-window layer that no query from position ``seen`` [B] on can
    see (position <= seen - window): attention masks them anyway, so evicting them is lossless (S the longest head).
    Queries only move forward from ``seen`` (a rewind never goes behind the last compression)."""
    pos = cache.positions()
    windows = torch.tensor([layer.window for layer in layers], device=pos.device)[:, None, None, None]
    return (windows > 0) & (pos >= 0) & (pos <= seen[None, :, None, None] - windows)


def token_counts(cache: PagedKVCache, allocator: Allocator, scores: Tensor, stats, budget_bytes: Tensor,
                 lengths: Tensor, floor: Tensor | None = None) -> Tensor:
    """[L, B, Hkv] tokens each head keeps: the allocator's counts, at most ``lengths`` (what it holds that is still
    visible: ``out_of_window``), fit to whole pages, none below ``floor`` (restore entries, ranked first: the
    allocator is asked again for fewer tokens while the pages they leave do not fit). An allocator that chooses
    whole pages itself (``Allocator.allocate_pages``) does so where there is no floor."""
    tokens, max_pages = budget_bytes // cache.stored_token_bytes, budget_bytes // cache.stored_page_bytes
    if floor is None:
        counts = allocator.allocate_pages(scores, lengths, max_pages, cache.page_size)
        if counts is not None:
            return counts
    while True:
        counts = allocator.allocate(scores, lengths, tokens, *stats).long().clamp(min=0).minimum(lengths)
        counts = fit_to_pages(counts, max_pages, cache.page_size, floor)
        over = cache.pages_held(counts).sum((0, 2)) - max_pages
        if floor is None or not bool((over > 0).any()):
            return counts
        tokens = tokens - over.clamp_min(0) * cache.page_size
        if bool((tokens < floor.sum((0, 2))).any()):  # steps refuses such a budget before reading: not reached
            raise ValueError("the budget cannot hold the pages of the entries every head must keep")


def plan_tokens(cache, allocator, scores, stats, budget_bytes, layers, lengths, floor=None) -> Plan:
    """Each head keeps its ``token_counts`` best tokens (at least ``floor``), pinned ones first."""
    counts = token_counts(cache, allocator, scores, stats, budget_bytes, lengths, floor)
    return select(scores, counts, pinned_levels(scores, is_pinned(scores)))


def plan_pages(cache, allocator, scores, stats, budget_bytes, layers, lengths) -> Plan:
    """Whole logical pages, at most the budget's pages per sequence. A page scores the max of its tokens; a head's
    last page may be partial (it still costs a page). Pages count as held while any of their tokens is (``lengths``
    is not read: a page of out-of-window tokens scores -inf and ranks last)."""
    S, P = scores.shape[-1], cache.page_size
    n_pages = -(-S // P)
    page_scores = F.pad(scores, (0, n_pages * P - S), value=float("-inf")).unflatten(-1, (n_pages, P)).amax(-1)
    held = cache.pages_held()
    pages = allocator.allocate(page_scores, held, budget_bytes // cache.page_bytes, *stats).long().clamp(min=0)
    kept = rank(page_scores) < pages.minimum(held)[..., None]
    return Plan.of_mask(kept.repeat_interleave(P, dim=-1)[..., :S] & (scores > float("-inf")))


def plan_tail_summary(cache, allocator, scores, stats, budget_bytes, layers, lengths) -> Plan:
    """``plan_tokens`` with the last counted slot of every head that evicts spent on a summary of its evicted tail
    (``Allocator.summarize``, from the dense cache before compaction), written after the kept tokens."""
    counts = token_counts(cache, allocator, scores, stats, budget_bytes, lengths)
    summary = ((counts < cache.held()) & (counts > 0)).long()
    kept = rank(scores, pinned_levels(scores, is_pinned(scores))) < (counts - summary)[..., None]
    rows = []
    for layer in layers:
        obs = observe(cache, layer)
        candidate = padded(scores[layer.index] > NEVER, obs.valid.shape[-1])  # not apart, in window, not NEVER
        evicted = obs.valid & candidate & ~padded(kept[layer.index], obs.valid.shape[-1])
        rows.append(allocator.summarize(obs, evicted))
    keys, values, positions, log_weights = (torch.stack(x) for x in zip(*rows))  # [L, B, Hkv, D] x 2, [L, B, Hkv] x 2
    new = NewEntries(keys[..., None, :], values[..., None, :], positions[..., None], summary, log_weights[..., None])
    return Plan.of_mask(kept, new=new)


def plan_prototypes(cache, allocator, scores, stats, budget_bytes, layers, lengths) -> Plan:
    """Every entry an allocator's choice of original tokens and prototypes (``Allocator.prototypes``),
    within the budget's pages of each row; when every held token fits, all are kept as they are. Tokens that are no
    candidates (out of a sliding window, kept apart, or scored -inf by the scorer: ``NEVER``) are left out of the
    allocator's view: neither kept nor stood for."""
    held = cache.held().long()
    max_pages = budget_bytes // cache.stored_page_bytes
    if bool((cache.pages_held(held).sum((0, 2)) <= max_pages).all()):
        return Plan.of_mask(scores > float("-inf"))
    observations = []
    for layer in layers:
        obs = observe(cache, layer)
        candidate = padded(scores[layer.index] > NEVER, obs.valid.shape[-1])
        observations.append(dataclasses.replace(obs, valid=obs.valid & candidate))
    kept, keys, values, positions, log_weights, counts = allocator.prototypes(observations, scores, max_pages,
                                                                             cache.page_size)
    return Plan.of_mask(kept, new=NewEntries(keys, values, positions, counts, log_weights))


def plan_memory(cache, allocator, scores, stats, budget_bytes, layers, lengths) -> Plan:
    """``token_counts`` per head, of which a head that evicts spends up to ``allocator.memory`` on memory entries
    (``memorize``) and keeps the rest by the allocator's own rule (``retain``)."""
    counts = token_counts(cache, allocator, scores, stats, budget_bytes, lengths)
    evicts = (counts < lengths) & (counts > 1)
    memory = torch.where(evicts, (counts - 1).clamp_max(allocator.memory), 0)
    kept, rows = [], []
    for layer in layers:
        obs = observe(cache, layer)
        s = scores[layer.index]
        kept.append(allocator.retain(obs, s, counts[layer.index] - memory[layer.index]))
        rows.append(allocator.memorize(obs, (s > NEVER) & ~kept[-1], s, memory[layer.index]))
    keys, values, positions, log_weights, written = (torch.stack(x) for x in zip(*rows))
    return Plan.of_mask(torch.stack(kept), new=NewEntries(keys, values, positions, written, log_weights))


PLANNERS = {TOKENS: plan_tokens, PAGES: plan_pages, TAIL_SUMMARY: plan_tail_summary, PROTOTYPES: plan_prototypes,
            MEMORY: plan_memory}  # the plan of each ``methods.Strategy``, with one signature


def compress(cache: PagedKVCache, scorer: Scorer | None, allocator: Allocator, budget_bytes: Tensor, layers,
             recipe, apart: int = 0, seen: Tensor | None = None, dense: dict | None = None) -> None:
    """Shrink every sequence of ``cache`` to at most ``budget_bytes`` [B] bytes of K/V pages, in place, as
    ``recipe`` asks; with a page format, store what is kept in it (every token, unscored, when they all fit),
    except the ``recipe.precise_recent`` newest tokens, which stay in the model's dtype: kept first, their dtype
    bytes out of the budget, the rest of which the scorer's tokens share at the format's cost. With
    ``recipe.merge``, evicted values are folded into kept ones first (``PagedKVCache.fold_evicted``). The ``apart``
    newest tokens (model dtype only) are no candidates: kept as they are, on top of ``budget_bytes``
    (``CompressedModel.compress(keep_last=...)``). ``dense``: as ``score_all`` reads it.

    A sliding-window layer's entries that no later query can see (``out_of_window`` of ``seen`` [B], the next
    position; default ``cache.seen``) go first, losslessly: they are no candidates and take nothing of the budget,
    which the allocator then shares among what is still visible (on a hybrid model, mostly the global layers)."""
    precise_recent, anchors = recipe.precise_recent, recipe.precise_anchors
    check_fits(cache, recipe, scorer, budget_bytes, cache.seen)
    encoder = encoder_of(cache.page_format)
    if encoder is not None:  # rows encoded against tables of the whole prompt: every token is kept
        cache.keep(encoder.plan(cache, layers, budget_bytes))
        return
    held = cache.held().long()
    recent = cache.precise(precise_recent, anchors)
    n_recent = recent.sum(-1)
    recent_bytes = cache.pages_held(n_recent).sum(dim=(0, 2)) * cache.page_bytes
    fits = cache.pages_held(held - n_recent).sum(dim=(0, 2)) * cache.stored_page_bytes + recent_bytes <= budget_bytes
    channels = key_channels(cache, layers)
    if cache.page_format is not None and (scorer is None or bool(fits.all())):
        cache.demote(precise_recent, channels=channels, anchors=anchors)
        return
    scores, stats = score_all(cache, scorer, layers, allocator, dense)
    aside = padded(cache.newest(apart), scores.shape[-1])
    dead = padded(out_of_window(cache, layers, cache.seen if seen is None else seen), scores.shape[-1])
    lengths = cache.held().long() - dead.sum(-1)
    scores = scores.masked_fill(aside | dead, float("-inf"))
    restored = _restored(cache, (dense or {}).get("restored"), scores.shape[-1])
    floor = None if restored is None else restored.sum(-1)
    if restored is not None:  # kept first, above every pin (sinks), and charged like any token
        scores = scores.masked_fill(restored, torch.finfo(torch.float32).max)
    if precise_recent or anchors:  # kept apart: the scored tokens compete for what the window leaves of the budget
        window = padded(recent, scores.shape[-1])
        scores = scores.masked_fill(window, float("-inf"))
        budget_bytes = budget_bytes - recent_bytes
    strategy = PLANNERS[allocator.strategy] if floor is None else partial(plan_tokens, floor=floor)
    plan = strategy(cache, allocator, scores, stats, budget_bytes, layers, lengths)
    if apart or bool(dead.any()):
        plan = Plan.of_mask(plan.kept(scores.shape[-1]) & ~dead | aside, new=plan.new)
    if cache.page_format is not None:
        formats = torch.full_like(plan.keep, STORED_FORMAT)
        if precise_recent or anchors:
            plan = Plan.of_mask(plan.kept(window.shape[-1]) | window)
            formats = torch.where(window.gather(-1, plan.keep.clamp_max(window.shape[-1] - 1)), DTYPE_FORMAT,
                                  STORED_FORMAT)
        plan = dataclasses.replace(plan, formats=formats, channels=channels)
    if recipe.merge:
        merger = recipe.merger()
        cache.fold_evicted(plan, lambda layer, keys, values, valid, kept: merger.merge(keys, values, valid, kept))
    cache.keep(plan)


def check_fits(cache: PagedKVCache, recipe, scorer: Scorer | None, budget_bytes: Tensor, seen: Tensor,
               fresh: bool = False) -> None:
    """Raise when ``compress`` could not hold ``budget_bytes`` [B] once each row has read ``seen`` [B] tokens
    (``PagedKVCache.counts_after``; ``fresh``: from an empty cache): the tokens ``recipe`` keeps in the model's dtype
    (``precise_recent``, ``precise_anchors``) alone exceed it, or, with no scorer to evict, every token in its page
    format does. Called before a prefill writes anything, so a refusal leaves the cache as it was."""
    window, anchors = recipe.precise_recent, recipe.precise_anchors
    if cache.page_format is None:
        return
    held, precise = cache.counts_after(window, anchors, seen, fresh)
    budget = f"the budget ({int(budget_bytes.min())} bytes in a sequence)"
    encoder = encoder_of(cache.page_format)
    if encoder is not None:
        encoder.check_fits(cache, held, budget_bytes, budget)
        return
    recent = cache.pages_held(precise).sum(dim=(0, 2)) * cache.page_bytes
    if bool((recent > budget_bytes).any()):
        what = f" and every {anchors}th page (precise_anchors)" if anchors else ""
        raise ValueError(f"the newest {window} tokens in the model's dtype (precise_recent){what} alone exceed "
                         f"{budget}; shorten the window or raise the budget")
    stored = cache.pages_held(held - precise).sum(dim=(0, 2)) * cache.stored_page_bytes
    if scorer is None and bool((recent + stored > budget_bytes).any()):
        raise ValueError(f"every token in {cache.page_format} pages does not fit {budget}; add a scorer that evicts, "
                         "or raise the budget")


def key_channels(cache: PagedKVCache, layers) -> Tensor | None:
    """[L, B, Hkv, W] the key channels each head keeps, for a page format whose keys keep channels chosen per head
    (``PageFormat.prunes_keys``; None for any other), from the queries the cache observed and the keys it holds."""
    fmt = get_format(cache.page_format) if cache.page_format is not None else None
    if fmt is None or not fmt.prunes_keys:
        return None
    return torch.stack([fmt.key_channels(observe(cache, layer)) for layer in layers])


def _restored(cache: PagedKVCache, restored: tuple[Tensor, int] | None, S: int) -> Tensor | None:
    """[L, B, Hkv, S] True at the restore entries (``observation.reconstructing``'s ``"restored"``: [B] where each
    row's begin, how many), None when there are none."""
    if restored is None:
        return None
    start, n = restored
    pos = F.pad(cache.positions(), (0, S), value=-1)[..., :S]
    return (pos >= start[None, :, None, None]) & (pos < start[None, :, None, None] + n)
