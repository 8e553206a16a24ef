"""H2O (https://arxiv.org/abs/2306.14048): heavy hitters, the tokens with the most cumulative attention."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Observation, Scorer, merge_rankings, pool_groups, register_scorer


@register_scorer("h2o")
@dataclass
class H2O(Scorer):
    """The paper's cache: heavy hitters plus the most recent tokens, a ``heavy_ratio`` share of the budget each
    way (half and half in the paper). Heavy = attention each held key received, summed over every prefill query the
    cache observed (up to ``window``), averaged over each GQA group. The sum runs over blocks of ``block`` queries,
    so no query x key matrix of the whole prompt is ever built. The two halves become one ranking that is right at
    any budget (``merge_rankings``); ``heavy_ratio=1`` is pure cumulative attention.

    Inferred: the paper evicts greedily at every decoding step; here the prompt is ranked once after prefill with
    the cumulative scores of all its queries (as keys_values' ``h2o`` does at its first eviction)."""

    window: int = 8192
    block: int = 256
    heavy_ratio: float = 0.5

    def __post_init__(self):
        if self.window < 1 or self.block < 1 or not 0.0 <= self.heavy_ratio <= 1.0:
            raise ValueError(f"need window, block >= 1 and 0 <= heavy_ratio <= 1; got {self.window}, {self.block}, "
                             f"{self.heavy_ratio}")

    @property
    def observation_window(self) -> int:
        return self.window

    def cumulative_attention(self, obs: Observation):
        """[B, Hq, S] attention each held key received from every observed query, summed block by block."""
        return obs.received_attention(self.block)

    def _split(self, heavy, obs: Observation):
        G = heavy.shape[1] // obs.keys.shape[1]
        valid = obs.valid.repeat_interleave(G, 1)
        recent = obs.positions.float().repeat_interleave(G, 1).masked_fill(~valid, float("-inf"))
        return merge_rankings(heavy.masked_fill(~valid, float("-inf")), recent, self.heavy_ratio)

    def score_per_query_head(self, obs: Observation):
        return self._split(self.cumulative_attention(obs), obs)

    def score(self, obs: Observation):
        return self._split(pool_groups(self.cumulative_attention(obs), obs.keys.shape[1]), obs)
