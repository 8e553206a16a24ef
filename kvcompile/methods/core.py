"""CORE (arXiv 2610.02235; docs/methods_allocators.md#core): coverage-aware retention, and the evicted attention mass
written into a few memory entries instead of dropped."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import MEMORY, Allocator, Observation, per_head_share, register_allocator
from .certkv import reference_query
from .shares import attention_mass

_TINY = 1e-12  # the floor of an attention mass under its log


@register_allocator("core")
@dataclass
class Core(Allocator):
    """Each head keeps an equal share of the budget, ``memory`` of its slots spent on memory entries when it evicts.

    Retention (the paper's offline teacher objective, computed exactly instead of distilled into its learned
    indexer, which we cannot train here: inferred): the kept set S greedily maximises
    sum_{j in S} log pi_j + gamma log det(K_S), pi the scorer's scores as attention masses (``attention_mass``), K
    the Gram matrix of the unit keys plus ``delta`` I. A token's gain is log pi_j + gamma log(delta (1 + x_j)), x_j =
    k_j^T (K_S' + delta I)^{-1} k_j over the kept unit keys (its conditional variance under K), updated by
    Sherman-Morrison at each pick: O(S D) a step. Pinned tokens are picked first.

    Memory (the key identity O - O_S = m_E (c_E - O_S)): the evicted tokens, in position order, fall into
    ``memory`` groups of equal pi-mass; each group becomes one weighted entry (``cache.weights``) whose key and
    value are the group's attention-weighted means under the reference query (the mean observed window query) and
    whose log-weight is the group's log-mass under that query less its mean key's logit: attention of that query
    over kept tokens + memory equals attention over the full cache exactly. The paper's gated recurrent write and
    query-adaptive read are replaced by these exact entries (inferred). With ``merged=False`` (a control) the same
    tokens are kept and no memory is written.
    """

    memory: int = 4
    gamma: float = 1.0
    delta: float = 0.1
    merged: bool = True

    strategy = MEMORY

    def __post_init__(self):
        if self.memory < 1:
            raise ValueError(f"memory must be >= 1 entry per head, got {self.memory}")
        if self.gamma < 0 or self.delta <= 0:
            raise ValueError(f"need gamma >= 0 and delta > 0, got {self.gamma}, {self.delta}")

    def allocate(self, scores, lengths, budget):
        return per_head_share(lengths, budget)[None, :, None].minimum(lengths.long())

    def retain(self, obs: Observation, scores: Tensor, counts: Tensor) -> Tensor:
        """[B, Hkv, S] the ``counts`` [B, Hkv] tokens each head keeps (the greedy of the class docstring).

        A token's gain never exceeds log pi_j + gamma log(1 + delta) (x_j <= 1 / delta for a unit key) and never
        falls below log pi_j + gamma log delta, so a token whose bound from above is under the ``counts``-th best
        bound from below is never picked: the greedy runs over the other candidates only (the same picks)."""
        mass, pinned = attention_mass(scores)
        S = scores.shape[-1]
        quality = mass.clamp_min(_TINY).log().masked_fill(scores == float("-inf"), float("-inf"))
        quality = quality.masked_fill(pinned, float("inf"))
        candidates = self._candidates(quality, counts)  # [B, Hkv, C] slots, in slot order
        quality = quality.gather(-1, candidates)
        unit = F.normalize(obs.keys[:, :, :S].float(), dim=-1)
        B, Hkv, _, D = unit.shape
        unit = unit.gather(2, candidates[..., None].expand(B, Hkv, -1, D))
        inverse = torch.eye(D, device=unit.device).expand(B, Hkv, D, D) / self.delta
        x = unit.pow(2).sum(-1) / self.delta  # k^T A^-1 k with A = delta I
        kept = torch.zeros_like(quality, dtype=torch.bool)
        for step in range(int(counts.max())):
            gain = (quality + self.gamma * (self.delta * (1 + x)).clamp_min(_TINY).log()).masked_fill(
                kept, -float("inf"))
            pick = gain.argmax(-1, keepdim=True)  # [B, Hkv, 1]
            live = (step < counts[..., None]) & (gain.gather(-1, pick) > -float("inf"))
            kept.scatter_(-1, pick, live | kept.gather(-1, pick))  # a head with nothing left picks a kept slot
            k = unit.gather(2, pick[..., None].expand(B, Hkv, 1, D))  # [B, Hkv, 1, D]
            w = torch.matmul(k, inverse)  # k^T A^-1 (A is symmetric)
            update = live[..., None].float() / (1 + (k * w).sum(-1, keepdim=True))
            inverse = inverse - update * w.transpose(-1, -2) * w
            x = x - update[..., 0] * torch.matmul(w, unit.transpose(-1, -2))[:, :, 0].pow(2)
        return torch.zeros(B, Hkv, S, dtype=torch.bool, device=kept.device).scatter_(-1, candidates, kept)

    def _candidates(self, quality: Tensor, counts: Tensor) -> Tensor:
        """[B, Hkv, C] the slots the greedy can pick, in slot order (a head with fewer pads with repeats of its
        last candidate slot, which cannot be picked twice: see ``retain``)."""
        lift = self.gamma * (math.log(1 + self.delta) - math.log(self.delta)) + 1e-3  # the most a gain can move,
        # and a margin for rounding
        floor = quality.sort(-1, descending=True).values  # the counts-th best quality of each head
        floor = floor.gather(-1, (counts.long() - 1).clamp(0, quality.shape[-1] - 1)[..., None])
        able = (quality >= floor - lift) & (quality > -float("inf"))
        C = max(1, int(able.sum(-1).max()))
        order = torch.sort(able.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :C]
        return order.sort(-1).values
    def memorize(self, obs: Observation, evicted: Tensor, scores: Tensor, counts: Tensor):
        """The memory entries of each head: keys, values [B, Hkv, M, D], positions, log-weights [B, Hkv, M] and how
        many each head writes [B, Hkv] (at most ``counts``, at most its evicted tokens; none with ``merged=False``)."""
        M = self.memory
        S = evicted.shape[-1]
        mass, _ = attention_mass(scores)
        mass = (mass.clamp_min(_TINY) * evicted).double()
        share = mass.cumsum(-1) / mass.sum(-1, keepdim=True).clamp_min(_TINY)
        n = counts.minimum(evicted.sum(-1)) * self.merged  # [B, Hkv] groups asked of each head
        group = (share * n[..., None] - 1e-9).floor().long().clamp(min=0).minimum((n - 1).clamp_min(0)[..., None])
        group = group.masked_fill(~evicted | (n == 0)[..., None], M)  # M: no group (a head asked for none writes none)
        present = torch.zeros(*n.shape, M + 1, device=n.device).scatter_(-1, group, 1.0)[..., :M] > 0
        relabel = F.pad(present.long().cumsum(-1) - 1, (0, 1), value=M)  # empty groups (one heavy token) closed up
        group, n = relabel.gather(-1, group), present.sum(-1) * self.merged
        onehot = F.one_hot(group, M + 1)[..., :M].float()  # [B, Hkv, S, M]
        q = reference_query(obs)
        keys, values = obs.keys[:, :, :S].float(), obs.values[:, :, :S].float()
        logits = torch.einsum("bhd,bhsd->bhs", q, keys) * obs.scale
        if obs.log_weights is not None:
            logits = logits + obs.log_weights[..., :S]
        member = logits[..., None].masked_fill(onehot == 0, float("-inf"))  # [B, Hkv, S, M]
        lse = torch.logsumexp(member, 2)  # [B, Hkv, M]
        weights = (member - lse[:, :, None].nan_to_num(0.0, neginf=0.0)).exp().nan_to_num(0.0)
        mean_k = torch.einsum("bhsm,bhsd->bhmd", weights, keys)
        mean_v = torch.einsum("bhsm,bhsd->bhmd", weights, values)
        written = torch.arange(M, device=n.device) < n[..., None]
        log_weight = (lse - obs.scale * torch.einsum("bhd,bhmd->bhm", q, mean_k)).nan_to_num(0.0) * written
        position = (obs.positions[..., :S, None] * onehot.long()).amax(2)
        return mean_k, mean_v, position, log_weight, n
