"""TOVA (https://arxiv.org/abs/2401.06104): keep the tokens the last query attends to most."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Observation, Scorer, at_positions, pool_groups, position_sums, protect, register_scorer


@register_scorer("tova")
@dataclass
class TOVA(Scorer):
    """Attention of the last prefilled query, averaged over every query head of the layer (``pool="layer"``, the
    paper's policy: one ranking shared by all heads) or over each GQA group (``pool="group"``); the last token is
    always kept. The paper evicts one token per step while decoding; compressing once after prefill uses the
    same ranking (as kvpress does)."""

    pool: str = "layer"

    def __post_init__(self):
        if self.pool not in ("layer", "group"):
            raise ValueError(f"pool must be 'layer' or 'group', got {self.pool!r}")

    @property
    def observation_window(self) -> int:
        return 1

    def _last_token(self, obs: Observation):
        return obs.positions == obs.query_positions[:, -1, None, None]  # [B, Hkv, S]

    def score_per_query_head(self, obs: Observation):
        attn = obs.window_attention(slice(-1, None))[:, :, 0]  # [B, Hq, S]
        G = attn.shape[1] // obs.keys.shape[1]
        return protect(attn, self._last_token(obs).repeat_interleave(G, 1))

    def score(self, obs: Observation):
        attn = obs.window_attention(slice(-1, None))[:, :, 0]
        pooled = pool_groups(attn, obs.keys.shape[1]) if self.pool == "group" else _layer_mean(attn, obs)
        return protect(pooled, self._last_token(obs))


def _layer_mean(attn, obs: Observation):
    """Mean over all query heads of the attention each *position* gets, read back per KV head [B, Hkv, S]; a head
    that does not hold a token contributes 0 to its mean."""
    return at_positions(position_sums(attn, obs), obs) / attn.shape[1]
