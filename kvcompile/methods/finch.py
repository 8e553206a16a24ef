"""FINCH (https://doi.org/10.1162/tacl_a_00716): keep the context the question's tokens attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation, QueryWindow, Question, Scorer, pool_groups, protect, register_scorer


def chunk_shares(scores: Tensor, pinned: Tensor, positions: Tensor, valid: Tensor, length: int) -> Tensor:
    """Scores [B, Hkv, S] re-ranked so that a head's top k takes from each chunk of ``length`` positions about k x
    the chunk's share of the head's tokens, and at least one (FINCH keeps max(1, n_kept) per chunk; a scorer does
    not know k): a token ranks by (its rank within its chunk + 1) / the chunk's size, each chunk's best first,
    ``pinned`` tokens first within their chunk, so they use its share. The returned values are the head's
    unpinned scores, sorted, handed out in that order; pins stay pinned."""
    S = scores.shape[-1]
    chunk = torch.where(valid, positions // length, torch.iinfo(torch.long).max)
    by_score = protect(scores, pinned).argsort(dim=-1, descending=True, stable=True)
    order = by_score.gather(-1, chunk.gather(-1, by_score).argsort(dim=-1, stable=True))  # by chunk, then by score
    sorted_chunk = chunk.gather(-1, order).contiguous()
    first = torch.searchsorted(sorted_chunk, sorted_chunk)
    size = torch.searchsorted(sorted_chunk, sorted_chunk, right=True) - first
    rank = torch.arange(S, device=scores.device) - first
    share = ((rank + 1) / size).masked_fill(rank == 0, 0.0)
    key = torch.empty_like(share).scatter_(-1, order, share.masked_fill(~valid.gather(-1, order), float("inf")))
    values = scores.masked_fill(~valid, float("-inf")).sort(-1, descending=True).values
    return protect(torch.empty_like(scores).scatter_(-1, key.argsort(dim=-1, stable=True), values), pinned)


@register_scorer("finch")
@dataclass
class Finch(Scorer):
    """Attention of the question's queries (RoPE applied, causal among themselves) over the held keys; with
    ``normalize_scores`` row t, at position p_t, is multiplied by p_t, undoing the dilution of a later query's
    attention over more keys; mean over the question's queries, mean over each GQA group, no pooling; the
    question itself is always kept. ``chunk_length``: each chunk of that many positions keeps its share.

    Query-aware by design: it declares a ``Question`` source, so ``generate(question_ids, context_ids=context)``
    reads the context, then the question, and compresses both (the budget counting both, as kvpress compresses
    context + question); any other compression is refused. The window is the question's last ``window``
    tokens (kvpress: the whole question, found by a delimiter token; kvcompile is told it by ``context_ids``).
    Keys keep their positions; ``key-rerotation+finch`` is kvpress's default ``rerotate_keys=True``.
    """

    normalize_scores: bool = True
    chunk_length: int | None = None
    window: int = 8192
    block: int = 256

    def __post_init__(self):
        if self.window < 1 or self.block < 1 or self.chunk_length is not None and self.chunk_length < 1:
            raise ValueError(f"need window, block, chunk_length >= 1; got {self.window}, {self.block}, "
                             f"{self.chunk_length}")

    @property
    def observation_window(self) -> int:
        return self.window

    def sources(self):
        return QueryWindow(self.window), Question()

    def score(self, obs: Observation):
        B, Hkv, S, _ = obs.keys.shape
        total = torch.zeros(B, obs.queries.shape[1], S, device=obs.keys.device)
        for queries in obs.query_blocks(self.block):
            qp = obs.query_positions[:, queries]
            weight = qp.clamp_min(0).float() if self.normalize_scores else (qp >= 0).float()
            total += torch.einsum("bhws,bw->bhs", obs.window_attention(queries), weight)
        n = (obs.query_positions >= 0).sum(-1).clamp_min(1)[:, None, None]
        scores = pool_groups(total / n, Hkv)
        first = obs.first_query()  # [B]
        question = obs.positions >= first[:, None, None]
        if self.chunk_length is not None:
            return chunk_shares(scores, question, obs.positions, obs.valid, self.chunk_length)
        return protect(scores, question)
