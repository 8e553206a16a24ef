"""FastKVzip (kvpress ``FastKVzipPress``, arXiv 2601.17668): a small gate per layer scores each
token from its attention input h_j alone, trained to reproduce KVzip's scores, so the cache is ranked in the one
prefill that reads the context (no reconstruction pass, no attention map).

The gate is "sink attention" in a 16-dim space: each of the KV head's g query projections of h_j attends over h_j's
own key and 16 learned sink keys; the weight it pays itself, averaged over the g, is the score in (0, 1). A token
that only attends to the sinks scores low. The architecture follows kvpress's gate (RMS-normed projections, a query
bias, zero-initialised sinks and logit bias); the loss it was trained with is not published, so the one used here
(squared error on log scores, ``train.kvzap``) is inferred. The gates are larger than the other learned scorers
(3.3M parameters for SmolLM2-135M), so they do not ship: ``kvcompile train fastkvzip --model NAME`` makes them,
and ``apply`` refuses without them, naming that command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from .base import Observation, protect, register_scorer
from .kvzap import KVzap


class Gate(nn.Module):
    """The gates of every layer, parameters with a leading [L]; ``forward`` maps attention inputs to the log of the
    gate's score per KV head, for all layers at once (training) or one (``layer``: scoring)."""

    def __init__(self, layers: int, heads: int, group: int, features: int, rank: int = 16, sinks: int = 16,
                 seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wq = nn.Parameter(torch.randn(layers, heads, features, group * rank, generator=g) / features**0.5)
        self.bq = nn.Parameter(torch.zeros(layers, heads, group * rank))
        self.wk = nn.Parameter(torch.randn(layers, heads, features, rank, generator=g) / features**0.5)
        self.q_norm = nn.Parameter(torch.ones(layers, 1, 1, 1, rank))  # RMSNorm gains, shared by the heads
        self.k_norm = nn.Parameter(torch.ones(layers, 1, 1, rank))
        self.sinks = nn.Parameter(torch.zeros(layers, heads, sinks, rank))
        self.b = nn.Parameter(torch.zeros(layers, heads, group))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, input features), as ``Surrogate.shape``."""
        return tuple(self.wk.shape[:3])

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Gate:
        L, H, F, rank = tensors["wk"].shape
        net = cls(L, H, tensors["b"].shape[-1], F, rank, tensors["sinks"].shape[2])
        net.load_state_dict(tensors)
        return net.requires_grad_(False)

    def forward(self, x: Tensor, layer: int | None = None) -> Tensor:
        """x [..., Hkv, N, F] (with ``layer``) or [L, Hkv, N, F] -> log score [..., Hkv, N]."""
        p = {k: (v if layer is None else v[layer]) for k, v in self.state_dict(keep_vars=True).items()}
        rank, group = p["wk"].shape[-1], p["b"].shape[-1]
        q = _rms((x @ p["wq"] + p["bq"].unsqueeze(-2)).unflatten(-1, (group, rank))) * p["q_norm"]
        k = _rms(x @ p["wk"]) * p["k_norm"]
        own = (q * k.unsqueeze(-2)).sum(-1) / math.sqrt(rank) + p["b"].unsqueeze(-2)  # [..., H, N, g]
        sink = q @ p["sinks"].transpose(-1, -2).unsqueeze(-3) / math.sqrt(rank)  # [..., H, N, g, sinks]
        log_gate = -nn.functional.softplus(torch.logsumexp(sink - own.unsqueeze(-1), -1))  # log 1/(1 + sum e^(z-l))
        return torch.logsumexp(log_gate, -1) - math.log(group)  # log of the mean over the g query projections


def _rms(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@register_scorer("fastkvzip")
@dataclass
class FastKVzip(KVzap):
    """Log gate scores from trained gates (``weights``/``sha256`` as ``KVzap``'s). As kvpress, the first ``n_sink``
    tokens and the newest ``recent`` fraction of the context (at least one token; 4096 from 32,000 tokens on) are
    kept."""

    method: ClassVar[str] = "fastkvzip"
    net_class: ClassVar[type] = Gate
    inputs: str = "hidden"
    recent: float = 0.02

    def __post_init__(self):
        if self.inputs != "hidden":
            raise ValueError(f"{self.method}: the gate reads hidden states only, got inputs={self.inputs!r}")
        if not 0 <= self.recent < 1:
            raise ValueError(f"{self.method}: recent must be in [0, 1), got {self.recent}")
        super().__post_init__()

    @property
    def trained(self) -> str:
        return self.method

    def score(self, obs: Observation) -> Tensor:
        n = (obs.positions.masked_fill(~obs.valid, -1).amax((1, 2)) + 1).view(-1, 1, 1)  # context tokens, per row
        recent = torch.where(n >= 32_000, 4096, (n * self.recent).long().clamp_min(1))
        return protect(super().score(obs), obs.positions >= n - recent)
