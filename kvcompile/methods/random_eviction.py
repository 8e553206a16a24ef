"""Random eviction: the control every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer, register_scorer


@register_scorer("random")
@dataclass
class RandomScores(Scorer):
    """Uniform random scores, reproducible for a seed (each layer draws from ``seed + layer``)."""

    seed: int = 0

    def score(self, obs: Observation):
        g = torch.Generator(device=obs.keys.device).manual_seed(self.seed + obs.layer)
        return torch.rand(obs.positions.shape, generator=g, device=obs.keys.device)
