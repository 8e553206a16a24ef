"""CriticalKV (https://arxiv.org/abs/2502.03805): re-weight a base score by how much each value moves the output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Wrapper, merge_rankings, register_scorer


@register_scorer("criticalkv")
@dataclass
class CriticalKV(Wrapper):
    """Two-stage selection over a ``base`` scorer (built from ``base_args``): a ``first_stage_ratio`` share of
    each head's kept tokens is the base score's top, the rest the top of (base + epsilon) * ||v||_1. Tokens the
    base protects stay protected.

    Inferred: (1) the paper weights by ||W_o v||_1; scorers do not see model weights, so ||v||_1 stands in
    (W_o = identity). (2) The stages split a budget the scorer does not know, so they are merged into one ranking
    that is right at every budget (``merge_rankings``): any top-k of the unprotected tokens holds the base's top
    ~r*k and the re-weighted top ~(1 - r)*k, r = first_stage_ratio, and carries the base's score values, so
    Ada-KV's allocation compares heads by the base's scores."""

    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

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
        vnorm = obs.values.float().abs().sum(-1).repeat_interleave(G, 1)
        reweighted = ((base.masked_fill(~free, 0) + self.epsilon) * vnorm).masked_fill(~free, float("-inf"))
        merged = merge_rankings(base, reweighted, self.first_stage_ratio)
        return merged.masked_fill(kept, torch.finfo(torch.float32).max)

    def score_per_query_head(self, obs: Observation):
        scores = self._base.score_per_query_head(obs)
        return None if scores is None else self._two_stage(scores, obs)

    def score(self, obs: Observation):
        return self._two_stage(self._base.score(obs), obs)
