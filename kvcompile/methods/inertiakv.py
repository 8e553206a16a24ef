"""InertiaKV, InertiaKV-Lazy and Score-Free decoding ("What Matters for Aggressive Decoding-Time KV Eviction?", arXiv
2609.03515; docs/decode_compression.md#inertiakv): rank held tokens by an exponential moving average of the attention
the current query pays them, refreshed every step, every r steps, or only once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation
from .decoding import DecodePolicy, LayerState, chronological, register_policy, step_attention


@register_policy("inertiakv")
@dataclass
class InertiaKV(DecodePolicy):
    """``s_t(j) = alpha * s_{t-1}(j) + (1 - alpha) * a_t(j)``, a_t = attention of step t's query averaged over
    its GQA group, alpha = 0.8 (the paper's). With ``refresh = r > 1`` (InertiaKV-Lazy-r) the EMA is updated only
    at the first decode step and every r steps after, and a new token starts at the cache's mean score (the
    paper's rule); with r = 1 a new token starts at 0 (inferred: the paper defines s only for held tokens).
    Per (layer, KV head) state: the paper couples layers through one shared state, which is not reproduced."""

    alpha: float = 0.8
    refresh: int = 1

    def __post_init__(self):
        if not 0.0 <= self.alpha < 1.0 or self.refresh < 1:
            raise ValueError(f"alpha must be in [0, 1) and refresh >= 1, got {self.alpha}, {self.refresh}")

    def score(self, state: LayerState, obs: Observation, fresh):
        B, Hkv, S, _ = obs.keys.shape
        attn = step_attention(obs)
        slots, positions, live = chronological(obs, fresh)
        if "first" not in state.extra:  # the first decode step starts the refresh clock
            state.extra["first"] = positions[:, 0]
        first = state.extra["first"]
        s = state.tokens
        for i in range(slots.shape[1]):  # steps in order: a token's start value depends on the scores before it
            p, on = positions[:, i, None, None], live[:, i, None, None]
            appear = on & s.isnan() & obs.valid & (obs.positions <= p)
            start = torch.zeros_like(s) if self.refresh == 1 else s.nanmean(-1, keepdim=True).nan_to_num(0.0)
            s = torch.where(appear, start.expand_as(s), s)
            a = attn.gather(2, slots[:, i].view(B, 1, 1, 1).expand(B, Hkv, 1, S)).squeeze(2)
            update = on & ((p - first[:, None, None]) % self.refresh == 0)
            s = torch.where(update, self.alpha * s + (1 - self.alpha) * a, s)
        state.tokens = s
        return s


@register_policy("score-free")
@dataclass
class ScoreFree(DecodePolicy):
    """Score what the cache holds once, by the attention of the first decode step's query, and freeze that ranking;
    tokens generated later rank below every scored token, newest first (FIFO; inferred: the paper only says later
    tokens are handled FIFO)."""

    def score(self, state: LayerState, obs: Observation, fresh):
        if "frozen" not in state.extra:
            B, Hkv, S, _ = obs.keys.shape
            slots, positions, _ = chronological(obs, fresh)
            a = step_attention(obs).gather(2, slots[:, 0].view(B, 1, 1, 1).expand(B, Hkv, 1, S)).squeeze(2)
            seen = obs.valid & (obs.positions <= positions[:, :1, None])
            state.tokens = torch.where(seen, a, float("nan"))
            state.extra["frozen"] = True
        newest = obs.positions.masked_fill(~obs.valid, -1).amax(-1, keepdim=True)
        return torch.where(state.tokens.isnan(), obs.positions / (newest + 1), 1 + state.tokens)
