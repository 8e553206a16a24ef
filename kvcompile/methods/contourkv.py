"""ContourKV (https://arxiv.org/abs/2608.25230): every head keeps tokens down to one shared dropped-mass level."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Allocator, descending_rank, register_allocator
from .shares import attention_mass


@register_allocator("contourkv")
@dataclass
class ContourKV(Allocator):
    """One level for all layers and KV heads of a sequence; each head keeps the fewest top tokens that bring its
    dropped attention mass down to that level, and the level is the lowest whose total fits the budget.

    Inferred from the abstract alone: the per-head mass curve, the level set ("contour")
    and the ``"balancing"`` variant. Scores are read as attention masses (``attention_mass``: clamped at 0 and
    normalised per head), so pair it with an attention scorer such as SnapKV's window attention; pinned tokens
    come first, spread evenly over the heads when the budget cannot hold them all. ``variant``: ``"contour"``
    equalises the dropped mass (minimises the largest one); ``"balancing"`` equalises the mass of the last token
    kept instead (keeps every token above one mass level, which minimises the total dropped mass).

    The level is what bisection on it converges to, computed exactly: the level at which a head wants its b-th
    slot is its dropped mass with b - 1 tokens (``"contour"``) or the mass of its b-th token (``"balancing"``);
    granting the budget's highest such levels over every slot of every head is the lowest feasible level plus the
    integer slack, handed out in level order. Heads keep a prefix of their slots because the levels fall with b.
    """

    variant: str = "contour"

    def __post_init__(self):
        if self.variant not in ("contour", "balancing"):
            raise ValueError(f"variant must be 'contour' or 'balancing', got {self.variant!r}")

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, S = scores.shape
        mass, pinned = attention_mass(scores)
        held = scores > float("-inf")
        order = torch.where(pinned, 2.0, torch.where(held, mass, -1.0)).argsort(dim=-1, descending=True, stable=True)
        a = mass.gather(-1, order)  # each head's masses, largest first (pinned first, with mass 0)
        if self.variant == "contour":
            level = 1.0 - F.pad(a.cumsum(-1)[..., :-1], (1, 0))  # dropped mass before the slot is granted
        else:
            level = a
        slot = torch.arange(S, device=scores.device, dtype=level.dtype)
        level = torch.where(pinned.gather(-1, order), 2.0 + 1.0 / (1.0 + slot), level)  # pins first, round-robin
        slot_held = held.gather(-1, order)
        level = level.masked_fill(~slot_held, float("-inf"))
        flat = level.permute(1, 0, 2, 3).reshape(B, L * Hkv * S)
        rank = descending_rank(flat)
        granted = (rank < budget[:, None]).reshape(B, L, Hkv, S).permute(1, 0, 2, 3) & slot_held
        return granted.sum(-1).minimum(lengths.long())
