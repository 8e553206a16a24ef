"""ObservedAttention (kvpress's H2O-like press, https://arxiv.org/abs/2306.14048): mean attention received."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer, pool_groups, register_scorer


@register_scorer("observed-attention")
@dataclass
class ObservedAttention(Scorer):
    """Score = attention a key received, summed over every observed prompt query, divided by how many of those
    queries could see it (kvpress: n - j), mean over each GQA group. Dividing by the count is what separates it
    from cumulative H2O, where early keys gather mass from more queries. Sums run over blocks of ``block``
    queries, so no query x key matrix of the prompt is built. Formula follows kvpress's ``ObservedAttentionPress``.

    Inferred: the queries are the last ``window`` the cache observed (all of a prompt up to that length); a query
    outside a layer's sliding window cannot see a key and is not counted (kvpress divides by n - j there too)."""

    window: int = 8192
    block: int = 256

    def __post_init__(self):
        if self.window < 1 or self.block < 1:
            raise ValueError(f"window and block must be >= 1, got {self.window}, {self.block}")

    @property
    def observation_window(self) -> int:
        return self.window

    def score_per_query_head(self, obs: Observation):
        G = obs.queries.shape[1] // obs.keys.shape[1]
        return obs.received_attention(self.block) / _viewers(obs).repeat_interleave(G, 1)

    def score(self, obs: Observation):
        return pool_groups(self.score_per_query_head(obs), obs.keys.shape[1])


def _viewers(obs: Observation):
    """[B, Hkv, S] how many observed queries each held key is visible to (at least 1), counted on the sorted query
    positions, so no query x key mask is built."""
    B, Hkv, S = obs.positions.shape
    seen = obs.query_positions.sort(-1).values.contiguous()  # [B, W]; -1 (no query) sorts first
    keys = obs.positions.reshape(B, -1).contiguous()

    def at_or_after(p):  # queries at positions >= p
        return seen.shape[-1] - torch.searchsorted(seen, p)

    count = at_or_after(keys)
    if obs.window > 0:
        count = count - at_or_after(keys + obs.window)
    return count.reshape(B, Hkv, S).clamp_min(1).float()
