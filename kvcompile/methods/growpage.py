"""GrowPage (arXiv 2609.03494; docs/decode_compression.md#growpage): at each full page a head either acquires one more
page or compresses in place, decided by how far its short- and long-term query summaries disagree, under a per-request
cap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .base import Observation
from .decoding import DecodePolicy, LayerState, register_policy, step_attention


@register_policy("growpage")
@dataclass
class GrowPage(DecodePolicy):
    """Two EMAs of each query head's decode queries, ``q_s`` (``beta_short``) and ``q_l`` (``beta_long``).
    Importance of a token: ``max(attn(q_s, k), attn(q_l, k))`` (averaged over the GQA group). Demand of a head:
    ``1 - |W_s & W_l| / |W_s|`` with W the ``working_set`` keys q_s / q_l attend to most. At each run (one page of
    new tokens, the schedule's ``every``) a head whose demand exceeds ``threshold``, or that holds less than
    ``floor`` of the per-head cap, grows (keeps everything); the others compress in place (evict ``every``
    tokens, holding their page count). If the request's total would pass its cap (per-head cap x heads), the
    growing heads with the lowest demand compress instead; no head holds more than ``max_share`` x the per-head
    cap. Inferred (the paper gives neither): the beta values, working-set size, threshold, floor, max_share,
    the demand formula's exact form, and token-level instead of per-block eviction quotas.
    """

    beta_short: float = 0.8
    beta_long: float = 0.98
    working_set: int = 32
    threshold: float = 0.5
    floor: float = 0.5
    max_share: float = 1.5

    def __post_init__(self):
        if not 0.0 <= self.beta_short < self.beta_long < 1.0:
            raise ValueError(f"need 0 <= beta_short < beta_long < 1, got {self.beta_short}, {self.beta_long}")
        if self.working_set < 1 or not 0.0 <= self.floor <= 1.0 or self.max_share < 1.0:
            raise ValueError(
                f"working_set must be >= 1, floor in [0, 1], max_share >= 1; got {self.working_set}, {self.floor}, "
                f"{self.max_share}"
            )

    def score(self, state: LayerState, obs: Observation, fresh):
        newest = obs.query_positions.amax(-1, keepdim=True)  # [B, 1]
        age = (newest - obs.query_positions).float()  # [B, W]
        summaries = []
        for name, beta in (("short", self.beta_short), ("long", self.beta_long)):
            w = torch.where(fresh, (1 - beta) * beta**age, 0.0)  # [B, W]
            decay = beta ** fresh.sum(-1).float()  # [B]
            q, m = state.extra.get(name, (0.0, 0.0))
            q = decay[:, None, None] * q + torch.einsum("bw,bhwd->bhd", w, obs.queries.float())
            m = decay * m + w.sum(-1)
            state.extra[name] = (q, m)
            summaries.append(q / m.clamp_min(1e-12)[:, None, None])
        view = dataclasses.replace(obs, queries=torch.stack(summaries, 2), query_positions=newest.expand(-1, 2))
        attn = step_attention(view)  # [B, Hkv, 2, S]
        attn_s, attn_l = attn[:, :, 0], attn[:, :, 1]
        k = obs.valid.sum(-1).clamp(1, self.working_set)  # [B, Hkv]
        in_s, in_l = (_rank(a, obs.valid) < k[..., None] for a in (attn_s, attn_l))
        state.extra["demand"] = 1 - (in_s & in_l).sum(-1) / k
        return torch.maximum(attn_s, attn_l)

    def allocate(self, states, lengths, target, every):
        L, B, Hkv = lengths.shape
        n = lengths.long()
        demand = torch.stack([s.extra["demand"] for s in states])  # [L, B, Hkv]
        cap = target[None, :, None]
        limit = (self.max_share * (cap + every)).long() - every
        hold = (n - every).clamp_min(0).minimum(limit)
        grow = (demand > self.threshold) | (n < self.floor * cap)
        want = torch.where(grow, n.minimum(limit), hold)
        # over the request's cap: the growing heads with the lowest demand compress instead
        excess = (_per_row(want).sum(-1) - L * Hkv * target).clamp_min(0)  # [B]
        order = _per_row(demand).argsort(-1)
        gain = _per_row(want - hold).gather(-1, order)
        flip_sorted = gain.cumsum(-1) - gain < excess[:, None]
        flip = torch.zeros_like(flip_sorted).scatter(-1, order, flip_sorted).reshape(B, L, Hkv).permute(1, 0, 2)
        want = torch.where(flip, hold, want)
        over = want.sum((0, 2)) > L * Hkv * target  # only while the prompt alone is over the cap
        return torch.where(over[None, :, None], want.minimum(cap), want).minimum(n)


def _per_row(t):
    """[L, B, Hkv] -> [B, L * Hkv]: every head of a sequence in one row."""
    return t.permute(1, 0, 2).reshape(t.shape[1], -1)


def _rank(scores, valid):
    """Rank of each held key by score, 0 = highest; keys not held rank last."""
    return scores.masked_fill(~valid, -1.0).argsort(-1, descending=True).argsort(-1)
