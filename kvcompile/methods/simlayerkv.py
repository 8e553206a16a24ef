"""SimLayerKV (https://arxiv.org/abs/2410.13846): a layer whose last prompt queries pay their attention
to the sinks and the recent tokens is lazy and keeps only those; the other layers rank by a base scorer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation, QueryWindow, Wrapper, register_scorer
from .streaming_heads import recent_window, streaming_scores


def lazy_mass(obs: Observation, last: int, sinks: int, recent: int) -> Tensor:
    """[B] attention the ``last`` newest observed queries pay the first ``sinks`` and ``recent`` newest positions,
    averaged over those queries and every query head."""
    newest = obs.query_positions.amax(-1, keepdim=True)  # [B, 1]
    chosen = (obs.query_positions > newest - last) & (obs.query_positions >= 0)  # [B, W]
    window = recent_window(obs, sinks, recent)  # [B, Hkv, S]
    G = obs.queries.shape[1] // obs.keys.shape[1]
    attn = obs.window_attention()  # [B, Hq, W, S]
    mass = (attn * window.repeat_interleave(G, 1)[:, :, None, :]).sum(-1)  # [B, Hq, W]
    return (mass * chosen[:, None]).sum((1, 2)) / (chosen.sum(-1) * attn.shape[1]).clamp_min(1)


@register_scorer("simlayerkv")
@dataclass
class SimLayerKV(Wrapper):
    """In a lazy layer (``lazy_mass`` > ``tau``) every head keeps its ``sinks`` first and ``recent`` newest tokens
    and rules the rest out (pair it with the ``fill-eligible`` allocator, which gives the budget they leave to the
    other layers); elsewhere the ``base`` scorer ranks. Decided per sequence, at each compression.

    Inferred: per sequence (kvpress averages over the batch), and the base ranking the other layers under a budget
    (kvpress keeps them whole)."""

    tau: float = 0.9
    sinks: int = 4
    recent: int = 64
    last: int = 1

    def __post_init__(self):
        if self.sinks < 0 or self.recent < 1 or self.last < 1:
            raise ValueError(f"simlayerkv: need sinks >= 0, recent >= 1 and last >= 1, got {self.sinks}, "
                             f"{self.recent}, {self.last}")
        super().__post_init__()

    @property
    def observation_window(self) -> int:
        return max(self._base.observation_window, self.last)

    def sources(self):
        others = tuple(s for s in self._base.sources() if not isinstance(s, QueryWindow))
        return others + (QueryWindow(self.observation_window),)

    def score(self, obs: Observation) -> Tensor:
        base = self._base.score(obs).float()
        lazy = lazy_mass(obs, self.last, self.sinks, self.recent) > self.tau  # [B]
        local = streaming_scores(obs, recent_window(obs, self.sinks, self.recent))
        return torch.where(lazy[:, None, None], local, base)
