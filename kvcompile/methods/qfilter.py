"""Q-Filters (https://arxiv.org/abs/2503.02812): rank keys by their projection on the head's main query direction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation, QueryWindow, Scorer, register_scorer


def query_moments(queries: Tensor, query_positions: Tensor, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """(gram [B, Hkv, D, D], total [B, Hkv, D]): sum of q qᵀ and of q over the real observed queries ``queries``
    [B, Hq, W, D] (``query_positions`` [B, W], -1 = none) of each GQA group, its query heads taken together."""
    B, Hq, W, D = queries.shape
    real = (query_positions >= 0)[:, None, :, None]
    q = queries.float().masked_fill(~real, 0.0).reshape(B, num_kv_heads, Hq // num_kv_heads * W, D)
    return q.transpose(-1, -2) @ q, q.sum(-2)


def principal_direction(gram: Tensor, total: Tensor) -> Tensor:
    """[..., D] unit filter u: the top eigenvector of ``gram`` [..., D, D] (the queries' first right-singular
    vector), signed so that the queries' sum ``total`` [..., D] projects on it positively."""
    _, vectors = torch.linalg.eigh(gram.double())
    u = vectors[..., -1]
    sign = torch.where((u * total.double()).sum(-1, keepdim=True) < 0, -1.0, 1.0)
    return (u * sign).float()


@register_scorer("qfilter")
@dataclass
class QFilter(Scorer):
    """s_j = ⟨u_h, k_j⟩ on the post-RoPE keys: queries and keys share an anisotropic direction u_h per head, and
    keys far along it get large expected logits from every query (no attention computed; usable at any time).

    ``filters`` [L][Hkv][D]: u for every layer and KV head, from ``calibration.qfilter.calibrate`` (the model's
    own queries on calibration text, cached per model). Sign: u points along the queries, so higher = keep;
    kvpress's published filters are -u (it scores -⟨f, k⟩). Without ``filters``, each prompt calibrates itself:
    u comes from the last ``window`` observed queries (the scorer then reads that query window).
    """

    filters: tuple | None = None
    window: int = 512

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.filters is not None:
            f = torch.tensor(self.filters, dtype=torch.float64)  # a ragged nesting raises here
            if f.dim() != 3 or not torch.isfinite(f).all():
                raise ValueError(f"filters must be finite numbers nested [layers][kv_heads][head_dim], got {f.shape}")
            self.filters = tuple(tuple(tuple(h) for h in layer) for layer in f.tolist())

    @property
    def observation_window(self) -> int:
        return 0 if self.filters is not None else self.window

    def sources(self):
        return () if self.filters is not None else (QueryWindow(self.window),)

    def directions(self, obs: Observation) -> Tensor:
        """[B, Hkv, D] the filter of each head of ``obs``'s layer (calibrated, or from its observed queries)."""
        B, Hkv, _, D = obs.keys.shape
        if self.filters is None:
            return principal_direction(*query_moments(obs.queries, obs.query_positions, Hkv))
        if len(self.filters) != obs.num_layers or len(self.filters[0]) != Hkv or len(self.filters[0][0]) != D:
            raise ValueError(f"filters are for {len(self.filters)} layers x {len(self.filters[0])} KV heads x "
                             f"{len(self.filters[0][0])} dims, the model has {obs.num_layers} x {Hkv} x {D}: "
                             "calibrate them for this model (calibration.qfilter.calibrate)")
        return torch.tensor(self.filters[obs.layer], device=obs.keys.device).expand(B, Hkv, D)

    def score(self, obs: Observation):
        return torch.einsum("bhsd,bhd->bhs", obs.keys.float(), self.directions(obs))
