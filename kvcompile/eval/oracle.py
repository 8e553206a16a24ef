"""The oracle policy: keep the tokens the *future* queries attend to most (an upper bound, not a method).

It needs the attention of queries that have not been read yet, so it cannot run online: ``fidelity`` reads the
continuation once over the full cache, sums each context token's attention over those queries
(``future_attention``) and hands the sums to ``Oracle`` as its scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import PagedKVCache
from ..methods.base import Observation, Scorer, register_scorer
from ..observation import observe


@register_scorer("oracle")
@dataclass
class Oracle(Scorer):
    """Precomputed scores per layer (``scores[l]``: [B, Hkv, S]); ``window`` only sizes the cache's observation
    window, so a full-budget model built with it remembers the last ``window`` queries (the future ones)."""

    scores: tuple = ()
    window: int = 0

    @property
    def observation_window(self) -> int:
        return self.window

    def score(self, obs: Observation) -> Tensor:
        if not self.scores:
            raise ValueError("the oracle has no scores: build it from fidelity.future_attention")
        s = self.scores[obs.layer].to(obs.keys.device)
        n = min(s.shape[-1], obs.positions.shape[-1])
        out = torch.full(obs.positions.shape, float("-inf"), device=obs.keys.device)
        out[..., :n] = s[..., :n]
        return out


def future_attention(cache: PagedKVCache, layers, n_context: int) -> tuple:
    """Per layer, [B, Hkv, n_context]: attention mass each of the first ``n_context`` held tokens receives from the
    observed queries (summed over queries and each GQA group). ``cache`` holds the context then the continuation,
    uncompressed, and observed the continuation's queries."""
    out = []
    for layer in layers:
        obs = observe(cache, layer)
        attn = obs.window_attention()  # [B, Hq, W, S]
        B, Hkv = obs.keys.shape[:2]
        out.append(attn.sum(2).reshape(B, Hkv, -1, attn.shape[-1]).sum(2)[..., :n_context])
    return tuple(out)
