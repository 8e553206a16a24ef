"""ThinK (https://arxiv.org/abs/2407.21018, as kvpress 0.5.5 ThinKPress computes it): which key channels a head
keeps. Not a scorer (it ranks channels, not tokens): the compression asks it when the page format drops key
channels (``kernels.formats.PrunedCodec``), and the format stores only the channels it picks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .base import Observation


@dataclass(frozen=True)
class ThinK:
    """Per KV head, channel i scores mean(q_i^2) * mean(k_i^2): the queries are the last ``window`` observed ones
    (post-RoPE, the mean also over the head's GQA group), the keys every one the head holds. Since
    ||Q_i K_i^T||_F = ||Q_i|| ||K_i||, this ranks channels as the paper's Frobenius criterion does. The
    floor(d * ``ratio``) lowest-scoring channels are dropped."""

    ratio: float = 0.5
    window: int = 32

    def __post_init__(self):
        if not 0 <= self.ratio < 1 or self.window < 1:
            raise ValueError(f"ThinK needs 0 <= ratio < 1 and window >= 1, got {self.ratio}, {self.window}")

    def channels(self, obs: Observation) -> Tensor:
        """[B, Hkv, W] the kept channels of each head, ascending (W = d - floor(d * ratio))."""
        B, Hkv, _, D = obs.keys.shape
        newest = obs.query_positions.amax(-1, keepdim=True)  # [B, 1]
        seen = (obs.query_positions >= 0) & (obs.query_positions > newest - self.window)  # [B, W]
        q2 = (obs.queries.float().square() * seen[:, None, :, None]).sum(2) / seen.sum(-1).clamp_min(1)[:, None, None]
        q2 = q2.view(B, Hkv, -1, D).mean(2)
        held = obs.valid[..., None]
        k2 = (obs.keys.float().square() * held).sum(2) / held.sum(2).clamp_min(1)
        kept = D - math.floor(D * self.ratio)
        return (q2 * k2).topk(kept, -1).indices.sort(-1).values
