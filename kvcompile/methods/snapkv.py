"""SnapKV (https://arxiv.org/abs/2404.14469): rank keys by the attention the last prompt queries pay them."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from .base import Observation, Scorer, protect, register_scorer


@register_scorer("snapkv")
@dataclass
class SnapKV(Scorer):
    """Mean attention from the observation window (the last ``window`` queries of what was prefilled), pooled over
    each GQA group (``pool`` = "mean" or "max"), smoothed over ``kernel`` neighbours; the window itself is always
    kept. Query-agnostic when the context is compressed before the question is read. ``smoothing``: "max" (a
    max-pool, the SnapKV paper's code) or "avg" (kvpress's: an average pool, zero-padded, over the tokens before the
    window alone)."""

    window: int = 32
    kernel: int = 7
    pool: str = "mean"
    smoothing: str = "max"

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window must be >= 1 and kernel a positive odd number, got {self.window}, {self.kernel}")
        if self.pool not in ("mean", "max") or self.smoothing not in ("max", "avg"):
            raise ValueError(f"pool must be 'mean' or 'max' and smoothing 'max' or 'avg', got {self.pool!r}, "
                             f"{self.smoothing!r}")

    @property
    def observation_window(self) -> int:
        return self.window

    def score(self, obs: Observation):
        B, Hkv, S, _ = obs.keys.shape
        attn = obs.window_attention().mean(2)  # [B, Hq, S]
        grouped = attn.reshape(B, Hkv, -1, S)
        pooled = grouped.mean(2) if self.pool == "mean" else grouped.amax(2)
        first_observed = obs.first_query()  # [B]
        observed = obs.positions >= first_observed[:, None, None]
        if self.smoothing == "avg":
            smooth = F.avg_pool1d(pooled.masked_fill(observed, 0.0), self.kernel, stride=1, padding=self.kernel // 2)
        else:
            smooth = F.max_pool1d(pooled, self.kernel, stride=1, padding=self.kernel // 2)
        return protect(smooth, observed)
