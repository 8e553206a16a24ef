"""CaM (ICML 2024, https://openreview.net/forum?id=LCTmppB165) as kvpress's CAMPress (docs/decode_compression.md#cam):
at each decode-time eviction, evicted values are merged, each with a seeded Bernoulli draw, into the kept tokens that
follow them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .decoding import LayerState, MergingPolicy, register_policy
from .h2o_decode import H2ODecode


@register_policy("cam")
@dataclass
class CaM(H2ODecode, MergingPolicy):
    """H2O's cumulative attention A (``H2ODecode``) ranks the tokens; then, per KV head, of the evicted tokens the
    ``every`` best-scored (the tokens generated since the last run; ties to later positions) are merge candidates.
    Candidate i's window W_i is the next ``merge_budget`` kept tokens after it (truncated at the end); it merges
    with probability p_i = clamp(A_i / mean_{j in W_i} A_j, 0, 1), drawn from a generator seeded by ``seed`` and
    the run's step, and then v_j += v_i / |W_i| for every j in W_i. Values only: keys, positions and bytes are
    those of plain eviction. kvpress evicts one set shared by the KV heads (their scores averaged); here each head
    selects its own, as every decode schedule does (inferred)."""

    merge_budget: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.merge_budget < 1:
            raise ValueError(f"merge_budget must be >= 1, got {self.merge_budget}")

    def merge(self, state: LayerState, values: Tensor, valid: Tensor, kept: Tensor, candidates: int,
              step: int) -> Tensor | None:
        """values [B, Hkv, S, D] of one layer with the merges of this run folded into the ``kept`` [B, Hkv, S]
        entries (None: nothing merges); ``candidates``: evicted tokens considered per head; ``step``: decode steps
        so far (with ``seed``, the draw's seed)."""
        S = kept.shape[-1]
        score = state.tokens[..., :S].nan_to_num(0.0)
        evicted = valid[..., :S] & ~kept
        flipped = torch.where(evicted, score, -float("inf")).flip(-1)  # ties to later positions
        order = S - 1 - flipped.argsort(dim=-1, descending=True, stable=True)
        place = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=kept.device).expand_as(order))
        chosen = evicted & (place < candidates)
        before = kept.long().cumsum(-1)  # kept tokens up to each index: for an evicted i, the kept rank after it
        n_kept = before[..., -1:]
        size = (n_kept - before).clamp(min=0, max=self.merge_budget)  # |W_i|
        a_kept = F.pad(torch.zeros_like(score).scatter_add_(-1, (before - 1).clamp_min(0), score * kept).cumsum(-1),
                       (1, 0))  # prefix sums of A over kept tokens in order
        window_sum = a_kept.gather(-1, (before + size).clamp_max(S)) - a_kept.gather(-1, before.clamp_max(S))
        p = (score / (window_sum / size.clamp_min(1))).nan_to_num(0.0, posinf=1.0).clamp(0, 1)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        draw = torch.rand(p.shape, generator=gen).to(p.device) < p
        go = chosen & draw & (size > 0)
        if not bool(go.any()):
            return None
        v = values.float()
        share = v * (go / size.clamp_min(1))[..., None]  # [B, Hkv, S, D]
        delta = torch.zeros(*v.shape[:2], S + 1, v.shape[-1], device=v.device)  # over kept ranks: add at the start
        delta.scatter_add_(2, before[..., None].expand_as(v).clamp_max(S), share)  # of W_i, remove past its end
        delta.scatter_add_(2, (before + size)[..., None].expand_as(v).clamp_max(S), -share)
        added = delta.cumsum(2)[:, :, :S].gather(2, (before - 1).clamp_min(0)[..., None].expand_as(v))
        return torch.where(kept[..., None], v + added, v).to(values.dtype)
