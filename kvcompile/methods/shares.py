"""How allocators turn scores into shares of a budget: scores read as attention masses, and integer shares
proportional to weights under caps (water-filling)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import descending_rank, is_pinned


def attention_mass(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Scores read as attention masses, for allocators that reason about the mass they drop.

    scores [..., S] -> mass [..., S] (each head's held, unprotected scores clamped at 0 and normalised to sum to 1;
    uniform where they are all 0; 0 elsewhere) and pinned [..., S] (tokens ``protect`` pinned: always kept).
    Meaningful for attention-like scores (SnapKV's window attention); for others it is a heuristic.
    """
    pinned = is_pinned(scores)
    free = (scores > float("-inf")) & ~pinned
    raw = scores.clamp_min(0).masked_fill(~free, 0.0)
    total = raw.sum(-1, keepdim=True)
    uniform = free.float() / free.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(total > 0, raw / total.clamp_min(torch.finfo(raw.dtype).tiny), uniform), pinned


def water_fill(weights: Tensor, caps: Tensor, total: Tensor) -> Tensor:
    """Integer shares [..., N] of ``total`` [...] proportional to ``weights`` [..., N] (>= 0), each at most
    ``caps`` [..., N]: what a capped item cannot take goes to the others (water-filling), the rounding remainder to
    the largest fractions. Items of weight 0 get nothing; the shares sum to at most ``total``."""
    w, cap = weights.double().clamp_min(0), caps.double().clamp_min(0)
    room = torch.minimum(total.double(), (cap * (w > 0)).sum(-1))[..., None]
    lo = torch.zeros_like(room)
    hi = (cap / w).masked_fill(w == 0, 0.0).amax(-1, keepdim=True)  # at this level every item is capped
    for _ in range(64):  # bisection on the water level t: share_i = min(cap_i, t * w_i)
        mid = (lo + hi) / 2
        fits = torch.minimum(cap, mid * w).sum(-1, keepdim=True) <= room
        lo, hi = torch.where(fits, mid, lo), torch.where(fits, hi, mid)
    share = torch.minimum(cap, lo * w)
    counts = share.floor()
    frac = (share - counts).masked_fill((counts >= cap) | (w == 0), -1.0)
    rank = descending_rank(frac)
    counts = counts + ((rank < room - counts.sum(-1, keepdim=True)) & (frac >= 0))
    return counts.long()
