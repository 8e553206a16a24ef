"""TwinKV (arXiv 2608.27128, https://arxiv.org/abs/2608.27128): value energy discounted by repeated keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Allocator, Observation, Scorer, per_head_share, protect, register_allocator, register_scorer
from .shares import attention_mass, water_fill


@register_scorer("twinkv")
@dataclass
class TwinKV(Scorer):
    """Token score = ||v||^2 / (1 + lam * f), f = how many other held keys are its near-twins (post-RoPE cosine
    >= ``tau``) more than ``local`` positions away: repeated content is down-weighted, unique content kept. Each
    head's scores are a distribution scaled by the head's prefix attention (the attention mass its last
    ``window`` prompt queries pay to tokens before that window), which the ``twinkv`` allocator turns into head
    capacities. The first ``n_sink`` tokens and the window itself are always kept. Twins are counted over blocks
    of ``block`` keys, so no key x key matrix is built.

    Inferred (only the abstract of this version was read): the discount 1 / (1 + lam * f) with a count f, tau and
    ``local`` (tau 0.90 and the local exclusion come from the paper's v1), the definition of prefix attention,
    and capacities proportional to it."""

    tau: float = 0.9
    local: int = 32
    lam: float = 1.0
    window: int = 32
    n_sink: int = 4
    block: int = 256

    def __post_init__(self):
        if not -1.0 <= self.tau <= 1.0 or self.lam < 0:
            raise ValueError(f"need -1 <= tau <= 1 and lam >= 0, got {self.tau}, {self.lam}")
        if min(self.window, self.block) < 1 or min(self.local, self.n_sink) < 0:
            raise ValueError("window and block must be >= 1, local and n_sink >= 0")

    @property
    def observation_window(self) -> int:
        return self.window

    def twins(self, obs: Observation):
        """[B, Hkv, S] number of held keys at distance > ``local`` whose cosine with this key is >= ``tau``."""
        unit = F.normalize(obs.keys.float(), dim=-1)
        S = unit.shape[2]
        counts = []
        for i in range(0, S, self.block):
            cos = unit[:, :, i : i + self.block] @ unit.transpose(-1, -2)  # [B, Hkv, b, S]
            far = (obs.positions[:, :, i : i + self.block, None] - obs.positions[:, :, None, :]).abs() > self.local
            counts.append(((cos >= self.tau) & far & obs.valid[:, :, None, :]).sum(-1))
        return torch.cat(counts, -1)

    def score(self, obs: Observation):
        energy = obs.values.float().pow(2).sum(-1) / (1 + self.lam * self.twins(obs))
        energy = energy * obs.valid
        first = obs.first_query()[:, None, None]  # [B,1,1]
        prefix = (obs.positions < first) & obs.valid
        attn = obs.window_attention()  # [B, Hq, W, S]
        B, Hq, W, S = attn.shape
        Hkv = obs.keys.shape[1]
        real = (obs.query_positions >= 0).sum(-1).clamp_min(1)[:, None]  # [B, 1]
        mass = (attn * prefix.repeat_interleave(Hq // Hkv, 1)[:, :, None]).sum((-1, -2)) / real  # [B, Hq]
        head = mass.reshape(B, Hkv, -1).mean(-1)  # [B, Hkv] prefix attention
        scores = energy / energy.sum(-1, keepdim=True).clamp_min(1e-30) * head[..., None]
        return protect(scores, (obs.positions < self.n_sink) | (obs.positions >= first))


@register_allocator("twinkv")
@dataclass
class TwinKVCapacities(Allocator):
    """Head capacities proportional to each head's score mass (with the ``twinkv`` scorer: its prefix attention),
    over all layers and KV heads of a sequence, summing to the budget; every head first gets ``floor`` x the
    uniform share, so no head is emptied. Protected tokens (sinks, window) do not count as mass.

    Inferred: the paper's abstract says only that capacities come from prefix attention under an exact budget;
    the proportional rule and the floor (Ada-KV's safeguard of 0.2) are this implementation's."""

    floor: float = 0.2

    def __post_init__(self):
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, _ = scores.shape
        lengths = lengths.long()
        _, pinned = attention_mass(scores)
        mass = scores.clamp_min(0).masked_fill(pinned, 0.0).sum(-1)  # [L, B, Hkv]
        mass = torch.where(mass.sum((0, 2), keepdim=True) > 0, mass, 1.0)  # no mass anywhere: uniform
        base = (self.floor * per_head_share(lengths, budget)).long()[None, :, None].minimum(lengths)
        flat = [x.permute(1, 0, 2).reshape(B, -1) for x in (mass, lengths - base)]
        extra = water_fill(*flat, budget - base.sum((0, 2)))
        return base + extra.reshape(B, L, Hkv).permute(1, 0, 2)
