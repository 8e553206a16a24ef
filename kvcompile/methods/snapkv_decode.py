"""SnapKV at decode time (https://arxiv.org/abs/2404.14469, re-applied during generation as R-KV and
Random Attention's baselines do): rank held tokens by the attention of the last ``window`` queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from .base import Observation
from .decoding import DecodePolicy, LayerState, register_policy, step_attention


@register_policy("snapkv-decode")
@dataclass
class SnapKVDecode(DecodePolicy):
    """Mean attention of the last ``window`` queries (the ring; generated tokens' queries once generation has gone
    that far), averaged over each GQA group, max-pooled over ``kernel`` neighbours; re-scored from scratch at every
    run, no state. The recent window is the schedule's protected span."""

    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window must be >= 1 and kernel a positive odd number, got {self.window}, {self.kernel}")

    def ring(self, every: int) -> int:
        return max(every, self.window)

    def score(self, state: LayerState, obs: Observation, fresh):
        qp = obs.query_positions
        last = (qp > qp.amax(-1, keepdim=True) - self.window) & (qp >= 0)  # [B, W]
        attn = (step_attention(obs) * last[:, None, :, None]).sum(2) / last.sum(-1).clamp_min(1)[:, None, None]
        return F.max_pool1d(attn, self.kernel, stride=1, padding=self.kernel // 2)
