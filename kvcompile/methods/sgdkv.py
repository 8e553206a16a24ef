"""SGD-KV (https://arxiv.org/abs/2609.03235): per-head budgets from scores on a chunk-summarisation diagnostic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Allocator, register_allocator
from .shares import water_fill


@register_allocator("sgd-kv")
@dataclass
class SGDKV(Allocator):
    """Every head first gets ``reserve`` tokens (its sinks + recent window; at most the uniform share), then the
    rest of the budget is shared in proportion to the head's diagnostic score, capped at what the head holds, the
    excess water-filled to the other heads (paper).

    ``head_scores`` [L][Hkv] come from ``calibration.sgdkv.calibrate`` (measured once per model, cached on disk);
    without them every head scores the same, which is the uniform allocation. Inferred: the reserve size (the
    observation window SnapKV keeps, 128 in the paper's pairing).
    """

    head_scores: tuple[tuple[float, ...], ...] | None = None
    reserve: int = 128

    def __post_init__(self):
        if self.reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {self.reserve}")
        if self.head_scores is not None:
            rows = tuple(tuple(float(s) for s in row) for row in self.head_scores)
            if len({len(r) for r in rows}) != 1 or any(not s >= 0 for r in rows for s in r):
                raise ValueError("head_scores must be a [layers][kv_heads] table of scores >= 0")
            self.head_scores = rows

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, _ = scores.shape
        if self.head_scores is None:
            weights = torch.ones(L, Hkv, dtype=torch.float64)
        elif (len(self.head_scores), len(self.head_scores[0])) != (L, Hkv):
            raise ValueError(f"head_scores is {len(self.head_scores)}x{len(self.head_scores[0])}, the cache {L}x{Hkv}")
        else:
            weights = torch.tensor(self.head_scores, dtype=torch.float64)
        caps = lengths.long().permute(1, 0, 2).reshape(B, L * Hkv)
        floor = caps.clamp_max(self.reserve).minimum((budget // (L * Hkv))[:, None])
        weights = weights.to(scores.device).reshape(1, L * Hkv).expand(B, -1)
        counts = floor + water_fill(weights, caps - floor, budget - floor.sum(-1))
        return counts.reshape(B, L, Hkv).permute(1, 0, 2)
