"""CertKV (https://arxiv.org/abs/2608.21541): a tail-summary slot per head, budgets by evicted-value dispersion."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import TAIL_SUMMARY, Allocator, Observation, register_allocator
from .shares import attention_mass

_FLOOR = 30.0  # a summary of a tail the reference query does not see: this much less logit than the max


@register_allocator("certkv")
@dataclass
class CertKV(Allocator):
    """Every head that evicts keeps one summary row of its evicted tail, charged to the budget; the remaining
    slots go where the evicted values are most dispersed.

    Allocation (paper): with r_h the head's scores as attention masses (``attention_mass``)
    and the head keeping its top b tokens, the tail costs c_h(b) = m_h(b) * sqrt(E_{r_h(b)} ||v - v*_h(b)||^2)
    (tail mass times the spread of the tail's values around their r-weighted mean). The real slots, the budget
    less one per head, minimise sum_h c_h(b_h): b_h(lam) = argmin_b c_h(b) + lam * b with bisection on lam, then
    a best-marginal repair adds single slots until the integer budget is met exactly. A head left evicting a
    single token keeps it instead of summarising it.

    Summary entry (``summarize``): one weighted entry (``cache.weights``). For the reference query q (the mean of
    the head's observed window queries), its key and value are the tail's attention-weighted mean key and value
    under q (the paper's centroids, with q's attention as the importance), and its log-weight is the tail's
    log-mass under q less the mean key's own logit, log sum_T exp(l_j) - scale * q . k_mean: it gets the tail's
    whole mass. The paper leaves open whether the summary gets a mass term; this log-weight is our choice (it
    replaced a synthetic key moved along q, version 1, which skewed every other query's logit). Attention of q over
    kept tokens + summary then equals attention over the full cache exactly (the paper's sketch is exact for this
    one query); for other queries it is an approximation, a mean key that stands for the tail's tokens. A tail
    holding weighted entries (a summary of an earlier compression) counts each with its weight. The entry sits at
    the head's latest position, so every later query sees it.
    """

    iterations: int = 48  # bisection steps on lam

    strategy = TAIL_SUMMARY

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")

    def layer_stats(self, obs: Observation, scores: Tensor) -> Tensor:
        """c_h(b) for b = 0..S tokens kept in score order: [B, Hkv, S + 1] (0 once nothing is evicted)."""
        S = scores.shape[-1]
        mass, _ = attention_mass(scores)
        order = scores.argsort(dim=-1, descending=True, stable=True)
        a = mass.gather(-1, order)[..., None]  # [B, Hkv, S, 1]
        v = obs.values[:, :, :S].float().gather(2, order[..., None].expand(-1, -1, -1, obs.values.shape[-1]))
        v = v - (a * v).sum(2, keepdim=True)  # centre on the head's mean value: same spread, less cancellation
        m, u, sq = _suffix_sum(a)[..., 0], _suffix_sum(a * v), _suffix_sum(a * v.pow(2).sum(-1, keepdim=True))[..., 0]
        cost = (m * sq - u.pow(2).sum(-1)).clamp_min(0).sqrt()  # m * sqrt(E||v||^2 - ||E v||^2)
        return F.pad(cost, (0, 1))

    def allocate(self, scores, lengths, budget, stats):
        L, B, Hkv, S = scores.shape
        lengths = lengths.long()
        cost = stats  # [L, B, Hkv, S + 1]
        heads = L * Hkv
        real = (budget - heads).clamp_min(0)  # one slot per head goes to its summary
        _, pinned = attention_mass(scores)
        floor = pinned.sum(-1).minimum(lengths)
        fits = (floor.sum((0, 2)) <= real)[None, :, None]
        floor = torch.where(fits, floor, floor.minimum((real // heads)[None, :, None]))  # else an even share of pins
        b = torch.arange(S + 1, device=scores.device)
        allowed = (b >= floor[..., None]) & (b <= lengths[..., None])

        def kept(lam: Tensor) -> Tensor:  # b_h(lam) [L, B, Hkv] for lam [B]
            objective = cost + lam[None, :, None, None] * b
            return objective.masked_fill(~allowed, float("inf")).argmin(-1)

        lo = torch.zeros(B, device=scores.device)
        hi = cost.amax((0, 2, 3)) + 1.0  # above any marginal gain: every head at its floor
        for _ in range(self.iterations):
            mid = (lo + hi) / 2
            fits = kept(mid).sum((0, 2)) <= real
            lo, hi = torch.where(fits, lo, mid), torch.where(fits, mid, hi)
        counts = self._repair(kept(hi), cost, lengths, real)
        counts = torch.minimum(counts + (counts < lengths).long(), lengths)  # + the summary slot
        counts = counts * (budget >= heads)[None, :, None]  # under one slot per head: no room for summaries
        return torch.where((budget >= lengths.sum((0, 2)))[None, :, None], lengths, counts)

    @staticmethod
    def _repair(counts: Tensor, cost: Tensor, lengths: Tensor, real: Tensor) -> Tensor:
        """Add one slot at a time where it lowers the cost most, until each sequence has ``real`` real slots."""
        L, B, Hkv = counts.shape
        missing = (real - counts.sum((0, 2))).clamp_min(0)
        missing = torch.minimum(missing, (lengths - counts).sum((0, 2)))
        for _ in range(int(missing.max())):
            nxt = (counts + 1).minimum(lengths)
            gain = cost.gather(-1, counts[..., None]) - cost.gather(-1, nxt[..., None])
            gain = gain[..., 0].masked_fill(counts >= lengths, float("-inf"))
            best = gain.permute(1, 0, 2).reshape(B, L * Hkv).argmax(-1)
            step = F.one_hot(best, L * Hkv).reshape(B, L, Hkv).permute(1, 0, 2) * (missing > 0)[None, :, None]
            counts, missing = counts + step, missing - (missing > 0).long()
        return counts

    def summarize(self, obs: Observation, evicted: Tensor):
        q = reference_query(obs)  # [B, Hkv, D]
        keys, values = obs.keys.float(), obs.values.float()
        logits = torch.einsum("bhd,bhsd->bhs", q, keys) * obs.scale
        if obs.log_weights is not None:  # an entry standing for w tokens has w times their mass
            logits = logits + obs.log_weights
        last = obs.query_positions.amax(-1)[:, None, None]  # the latest observed query position [B, 1, 1]
        visible = obs.valid & (obs.positions <= last)
        if obs.window > 0:
            visible = visible & (last - obs.positions < obs.window)
        tail = logits.masked_fill(~(visible & evicted), float("-inf"))
        weights = torch.softmax(tail, -1).nan_to_num(0.0)  # 0 where the tail has no visible token: then uniform
        uniform = evicted / evicted.sum(-1, keepdim=True).clamp_min(1)
        weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, uniform)
        mean_k, mean_v = torch.einsum("bhs,bhsd->bhd", weights, keys), torch.einsum("bhs,bhsd->bhd", weights, values)
        ceiling = logits.masked_fill(~visible, float("-inf")).amax(-1).nan_to_num(0.0, neginf=0.0)
        lse = torch.logsumexp(tail, -1).maximum(ceiling - _FLOOR)  # the summary's logit under q, its weight included
        log_weight = lse - obs.scale * (q * mean_k).sum(-1)
        position = obs.positions.masked_fill(~obs.valid, -1).amax(-1).clamp_min(0)
        return mean_k, mean_v, position, log_weight


def _suffix_sum(x: Tensor) -> Tensor:
    """Sums over slots b..S-1 along dim 2, for every b."""
    return x.flip(2).cumsum(2).flip(2)


def reference_query(obs: Observation) -> Tensor:
    """The query a summary is exact for: the mean of each KV head's observed window queries over its GQA group,
    [B, Hkv, D] (zeros when nothing was observed)."""
    B, Hq, W, D = obs.queries.shape
    Hkv = obs.keys.shape[1]
    seen = (obs.query_positions >= 0).float()  # [B, W]
    q = obs.queries.float().reshape(B, Hkv, Hq // Hkv, W, D) * seen[:, None, None, :, None]
    return q.sum((2, 3)) / (seen.sum(-1) * (Hq // Hkv)).clamp_min(1)[:, None, None]
