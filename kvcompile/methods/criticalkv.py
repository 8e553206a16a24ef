"""CriticalKV (https://arxiv.org/abs/2502.03805): re-weight a base score by how much each value moves the output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerWeights, Observation, Wrapper, merge_rankings, register_scorer
from .sources import output_projection


@register_scorer("criticalkv")
@dataclass
class CriticalKV(Wrapper):
    """Two-stage selection over a ``base`` scorer (built from ``base_args``): a ``first_stage_ratio`` share of
    each head's kept tokens is the base score's top, the rest the top of (base + epsilon) * ||W_o v||_1, the value
    through its query head's slice of the output projection (a KV head: the mean over its query heads, as kvpress).
    ``projected=False`` takes ||v||_1 instead (W_o = identity; version 3 and before). Tokens the base protects stay
    protected.

    Inferred: the stages split a budget the scorer does not know, so they are merged into one ranking that is right
    at every budget (``merge_rankings``): any top-k of the unprotected tokens holds the base's top ~r*k and the
    re-weighted top ~(1 - r)*k, r = first_stage_ratio, and carries the base's score values, so Ada-KV's allocation
    compares heads by the base's scores."""

    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    projected: bool = True

    def __post_init__(self):
        if not 0.0 <= self.first_stage_ratio <= 1.0 or self.epsilon < 0:
            raise ValueError(f"need 0 <= first_stage_ratio <= 1 and epsilon >= 0, got {self.first_stage_ratio}, "
                             f"{self.epsilon}")
        super().__post_init__()

    def _two_stage(self, scores, obs: Observation):
        """[B, H, S] base scores (H = Hkv or Hq) -> merged two-stage ranking scores, same shape."""
        scores = scores.float()
        G = scores.shape[1] // obs.values.shape[1]
        valid = obs.valid.repeat_interleave(G, 1)
        kept = scores >= torch.finfo(torch.bfloat16).max  # protected by the base (in float32 or bfloat16)
        free = valid & ~kept  # the two stages split what protection leaves
        base = scores.masked_fill(~free, float("-inf"))
        vnorm = self._value_norms(obs, scores.shape[1])
        reweighted = ((base.masked_fill(~free, 0) + self.epsilon) * vnorm).masked_fill(~free, float("-inf"))
        merged = merge_rankings(base, reweighted, self.first_stage_ratio)
        return merged.masked_fill(kept, torch.finfo(torch.float32).max)

    def sources(self):
        return self._base.sources() + ((LayerWeights("o_proj"),) if self.projected else ())

    def _value_norms(self, obs: Observation, heads: int, chunk: int = 1024):
        """[B, heads, S] ||W_o^r v||_1 per query head r (``heads`` = Hq), or its mean over each KV head's query heads
        (``heads`` = Hkv); ||v||_1 when not ``projected``. Built ``chunk`` entries at a time: [B, Hq, chunk, hidden]."""
        values = obs.values.float()
        B, Hkv, S, _ = values.shape
        if not self.projected:
            return values.abs().sum(-1).repeat_interleave(heads // Hkv, 1)
        per_head = output_projection(obs)  # [hidden, Hq, D]
        Hq = per_head.shape[1]
        norms = torch.cat([torch.einsum("bhsd,ehd->bhse", values[:, :, i:i + chunk].repeat_interleave(Hq // Hkv, 1),
                                        per_head).abs().sum(-1) for i in range(0, S, chunk)], -1)
        return norms if heads == Hq else norms.view(B, Hkv, Hq // Hkv, S).mean(2)

    def score_per_query_head(self, obs: Observation):
        scores = self._base.score_per_query_head(obs)
        return None if scores is None else self._two_stage(scores, obs)

    def score(self, obs: Observation):
        return self._two_stage(self._base.score(obs), obs)
