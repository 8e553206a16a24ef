"""KNorm (https://arxiv.org/abs/2406.11430): keys with a small L2 norm draw attention, so keep those."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Observation, Scorer, register_scorer


@register_scorer("knorm")
@dataclass
class KeyNorm(Scorer):
    """Score = -||k||; needs no attention weights."""

    def score(self, obs: Observation):
        return -obs.keys.float().norm(dim=-1)
