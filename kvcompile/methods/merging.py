"""Merge-on-evict of values (kvpress's MergingPress, docs/methods_wrappers.md): what a head evicts is folded into the
value of the kept entry whose key is most like its own, so eviction keeps some of what it drops at no extra bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_EPS = 1e-6  # keeps a weight finite where both values are zero (kvpress's constant is not in the specification)


@dataclass(frozen=True)
class ValueMerging:
    """For each evicted entry i of a head: its target t(i) = the kept entry of highest cosine similarity sigma_i
    between their (post-RoPE) keys. It merges when sigma_i >= ``similarity_threshold`` and, with
    ``merge_fraction`` < 1, sigma_i is at least the (1 - merge_fraction)-quantile of the head's evicted sigmas, with
    weight w_i = max(sigma_i, 0) ||v_i|| / (||v_i|| + ||v_t(i)|| + eps). Each target becomes
    v_t <- (v_t + sum_{i -> t} w_i v_i) / (1 + sum_{i -> t} w_i): a convex combination. Keys never change (a merged
    key would need re-rotation), and no entry carries a weight: the target still counts once in attention."""

    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0
    block: int = 1024  # evicted entries per similarity block: bounds the [block, S] matrix of a head

    def __post_init__(self):
        if not -1.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold is a cosine, in [-1, 1]; got {self.similarity_threshold}")
        if not 0.0 < self.merge_fraction <= 1.0:
            raise ValueError(f"merge_fraction must be in (0, 1]; got {self.merge_fraction}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")

    def merge(self, keys: Tensor, values: Tensor, valid: Tensor, kept: Tensor) -> Tensor:
        """keys, values [B, Hkv, S, D]; valid, kept [B, Hkv, S]. Returns the values with every kept entry's value
        merged (the evicted ones unchanged: they are about to go)."""
        sigma, target = self._targets(keys, valid & ~kept, kept)
        gate = sigma >= self.similarity_threshold
        if self.merge_fraction < 1:
            scored = sigma.masked_fill(sigma == float("-inf"), float("nan"))  # the head's evicted entries
            quantile = torch.nanquantile(scored, 1 - self.merge_fraction, dim=-1, keepdim=True)
            gate = gate & (sigma >= quantile.nan_to_num(float("inf")))
        v = values.float()
        norm = v.norm(dim=-1)
        w = sigma.clamp_min(0) * norm / (norm + norm.gather(-1, target) + _EPS) * gate
        mass = torch.zeros_like(norm).scatter_add_(-1, target, w)
        sums = torch.zeros_like(v).scatter_add_(2, target[..., None].expand_as(v), w[..., None] * v)
        merged = (v + sums) / (1 + mass[..., None])
        return torch.where(kept[..., None], merged, v).to(values.dtype)

    def _targets(self, keys: Tensor, evicted: Tensor, kept: Tensor) -> tuple[Tensor, Tensor]:
        """sigma [B, Hkv, S] (-inf where an entry is not evicted or its head keeps nothing) and target t(i)."""
        unit = F.normalize(keys.float(), dim=-1)
        sigma, target = [], []
        for i0 in range(0, keys.shape[2], self.block):
            sim = torch.matmul(unit[:, :, i0 : i0 + self.block], unit.transpose(-1, -2))  # [B, Hkv, block, S]
            best = sim.masked_fill(~kept[:, :, None], float("-inf")).max(-1)
            sigma.append(best.values)
            target.append(best.indices)
        sigma = torch.cat(sigma, -1).masked_fill(~evicted, float("-inf"))
        return sigma, torch.cat(target, -1)
