"""Random Attention (arXiv 2609.03430, code SalesforceAIResearch/Random-Attention, ``random_pp``):
keep the prompt and the recent window, evict generated tokens uniformly at random per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation
from .decoding import DecodePolicy, LayerState, register_policy


@register_policy("random-attention")
@dataclass
class RandomAttention(DecodePolicy):
    """i.i.d. U(0, 1) scores per (row, KV head, token), drawn afresh at every run; no attention is computed and no
    query is kept. The prompt and the recent window are the schedule's protected spans (the recipe sets them:
    recent 64, evicting in bursts of 64, as in the paper's code). Reproducible for a seed."""

    seed: int = 0

    def ring(self, every: int) -> int:
        return 0

    def score(self, state: LayerState, obs: Observation, fresh):
        run = state.extra.get("runs", 0)
        state.extra["runs"] = run + 1
        g = torch.Generator(device=obs.positions.device).manual_seed((self.seed * 100_003 + run) * 1_009 + obs.layer)
        return torch.rand(obs.positions.shape, generator=g, device=obs.positions.device)
