"""LU-KV (https://arxiv.org/abs/2602.08585, kvpress ``LUKVPress``): per-head budgets read off a precomputed curve.

The curve is a model's calibration, made once (``calibration.lukv``): for every global compression ratio 1%..99%,
the share of its tokens each (layer, KV head) prunes. Heads whose scores predict later attention well get fewer
tokens pruned at the same global ratio."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Allocator, register_allocator
from .shares import water_fill

RATIOS = 99  # the curve's rows: global compression ratios 1%, 2%, ..., 99%


@register_allocator("lukv")
@dataclass
class LUKV(Allocator):
    """Head (l, h) wants ``(1 - curve[t][l][h]) * n_lh`` of its n_lh tokens, t the row of the global compression
    ratio the budget implies (round(100 * ratio) - 1, clipped to the curve); the budget is then shared in proportion
    to those wants, capped at what each head holds, with at least one token for every head that holds any (kvpress
    clamps each head to [1, n] too).

    Inferred: kvpress takes each head's count as the curve gives it (its budget is nominal); here the counts are
    rescaled to spend exactly the byte budget, which leaves them unchanged when the curve's mean matches the ratio.
    An empty ``curve`` (no calibration yet) wants the same fraction from every head: uniform allocation."""

    curve: tuple = ()  # [99][L][Hkv] prune ratios in [0, 1], as ``calibration.lukv.calibrate`` returns

    def __post_init__(self):
        self.curve = tuple(tuple(tuple(float(x) for x in layer) for layer in row) for row in self.curve)
        if self.curve:
            table = torch.tensor(self.curve, dtype=torch.float64)
            if table.dim() != 3 or table.shape[0] != RATIOS or not ((table >= 0) & (table <= 1)).all():
                raise ValueError(f"lukv: curve must be [{RATIOS}][layers][kv heads] prune ratios in [0, 1], got shape "
                                 f"{list(table.shape)}: make one with kvcompile.calibration.lukv.calibrate")

    def check(self, num_layers: int) -> None:
        if self.curve and len(self.curve[0]) != num_layers:
            raise ValueError(f"lukv: the curve has {len(self.curve[0])} layers, the model {num_layers}: it was "
                             "calibrated on another model")

    def allocate(self, scores, lengths, budget):
        L, B, Hkv = lengths.shape
        n = lengths.double().permute(1, 0, 2).reshape(B, L * Hkv)  # [B, heads]
        want = n.clone()
        if self.curve:
            table = torch.tensor(self.curve, dtype=torch.float64, device=lengths.device)
            if table.shape[2] != Hkv:
                raise ValueError(f"lukv: the curve has {table.shape[2]} KV heads per layer, the model {Hkv}")
            ratio = 1 - budget.double() / n.sum(-1).clamp_min(1)  # [B] global compression ratio
            row = ((ratio * 100).round().long() - 1).clamp(0, RATIOS - 1)
            want = (1 - table[row].reshape(B, L * Hkv)) * n
        held = n > 0
        floor = held & (budget[:, None] >= held.sum(-1, keepdim=True))  # one token per head, when the budget allows
        counts = water_fill(want, n - floor.double(), budget.double() - floor.sum(-1)) + floor.long()
        return counts.reshape(B, L, Hkv).permute(1, 0, 2).contiguous()
