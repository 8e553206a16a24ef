"""CurDKV (https://arxiv.org/abs/2509.15038): keys and values ranked by locally normalised energies (CUR view)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Observation, Scorer, protect, register_scorer

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


@register_scorer("cur")
@dataclass
class CUR(Scorer):
    """Row norms stand in for the leverage scores of a CUR decomposition: key energy ||k||^2 and value energy
    ||v||^2, each divided by its sum over a window of ``local_window_size`` consecutive held tokens
    (``use_local_approximation``), combined by ``leverage_type``, normalised to sum 1 over the head. With
    ``use_random_leverage`` keys and values are first projected on 20 shared Gaussian directions. The first
    ``num_sinks`` positions are always kept. Attention-free. Algorithm and defaults follow kvpress's ``CURPress``.

    Inferred: windows follow each head's held order (after an earlier compression, held tokens, not positions);
    a window of zero energy scores 0 (kvpress: NaN); the projection is drawn from ``seed`` + layer."""

    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: bool = False
    use_local_approximation: bool = True
    local_window_size: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ValueError(f"leverage_type must be one of {LEVERAGE_TYPES}, got {self.leverage_type!r}")
        if self.num_sinks < 0 or self.local_window_size < 1:
            raise ValueError(f"need num_sinks >= 0, local_window_size >= 1; got {self.num_sinks}, "
                             f"{self.local_window_size}")

    def score(self, obs: Observation):
        keys, values = obs.keys.float(), obs.values.float()
        if self.use_random_leverage:
            g = torch.Generator(device=keys.device).manual_seed(self.seed + obs.layer)
            project = torch.randn(keys.shape[-1], 20, generator=g, device=keys.device) / 20**0.5
            keys, values = keys @ project, values @ project
        k, v = (x.pow(2).sum(-1).masked_fill(~obs.valid, 0.0) for x in (keys, values))
        if self.use_local_approximation:
            k, v = self._local(k), self._local(v)
        scores = {"key": k, "value": v, "kv_avg": (k + v) / 2, "kv_product": k * v}[self.leverage_type]
        scores = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
        return protect(scores, obs.positions < self.num_sinks)

    def _local(self, x):
        """[B, Hkv, S] energies divided by their sum over each window of consecutive held tokens."""
        B, Hkv, S = x.shape
        w = self.local_window_size
        windows = F.pad(x, (0, -S % w)).reshape(B, Hkv, -1, w)
        share = windows / windows.sum(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        return share.reshape(B, Hkv, -1)[..., :S]
