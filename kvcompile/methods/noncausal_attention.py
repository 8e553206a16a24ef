"""Compactor's attention component (https://arxiv.org/abs/2507.08143) alone: non-causal attention in chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from .base import Observation, Scorer, pool_groups, register_scorer
from .compactor import zscore


@register_scorer("noncausal-attention")
@dataclass
class NonCausalAttention(Scorer):
    """Score = z(smooth(a * ||v||)): ``a`` = attention a key receives from the observed prompt queries (up to
    ``window``), each attending non-causally within its position chunk of ``chunk`` tokens, mean over each GQA
    group; smooth = mean with the held neighbour either side; z = z-score over the head's held tokens. The same
    component as ``compactor``'s, without its sinks. Algorithm and defaults follow kvpress's ``NonCausalAttnPress``.

    Inferred: kvpress leaves logits unscaled, lets the zero padding of its last chunk take and add attention mass,
    averages zeros in past the ends and z-scores over the whole layer; here logits carry the layer's softmax
    scale, padding is masked, and smoothing and z-scores see only the head's held tokens (as in ``compactor``).
    Queries are the last ``window`` post-RoPE ones the cache observed (kvpress recomputes every prompt query)."""

    chunk: int = 256
    window: int = 8192

    def __post_init__(self):
        if self.chunk < 1 or self.window < 1:
            raise ValueError(f"chunk and window must be >= 1, got {self.chunk}, {self.window}")

    @property
    def observation_window(self) -> int:
        return self.window

    def score(self, obs: Observation):
        attention = pool_groups(obs.received_attention(self.chunk, chunk=self.chunk), obs.keys.shape[1])
        mass = (attention * obs.values.float().norm(dim=-1)).masked_fill(~obs.valid, 0.0)
        held = obs.valid.float()
        neighbours = F.avg_pool1d(held, 3, stride=1, padding=1).clamp_min(1e-6)
        return zscore(F.avg_pool1d(mass, 3, stride=1, padding=1) / neighbours, obs.valid)
