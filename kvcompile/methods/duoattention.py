"""DuoAttention (https://arxiv.org/abs/2410.10819): retrieval heads keep what the budget allows,
streaming heads keep only their attention sinks and recent tokens; which head is which is measured once per model
on offline text (``calibration.duoattention``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation, Wrapper, check_per_head_table, register_scorer
from .streaming_heads import recent_window, streaming_scores


def streaming_error(obs: Observation, sinks: int, recent: int) -> Tensor:
    """[B, Hkv] how far each head's output moves when its observed queries see only the first ``sinks`` and their
    own ``recent`` newest keys: sum over queries of ||O_full - O_stream||^2 / sum of ||O_full||^2, GQA group
    pooled. 0 for a head that streams losslessly (the gate DuoAttention's training drives to 0)."""
    B, Hkv, S, D = obs.keys.shape
    G = obs.queries.shape[1] // Hkv
    q = obs.queries.reshape(B, Hkv, G, -1, D).float()
    logits = torch.einsum("bhgwd,bhsd->bhgws", q, obs.keys.float()) * obs.scale
    qp, kp = obs.query_positions[:, None, None, :, None], obs.positions[:, :, None, None, :]
    visible = obs.valid[:, :, None, None, :] & (kp <= qp) & (qp >= 0)
    local = visible & ((kp < sinks) | (qp - kp < recent))
    values = obs.values.float()[:, :, None]  # [B, Hkv, 1, S, D]
    full, stream = (torch.softmax(logits.masked_fill(~m, float("-inf")), -1).nan_to_num(0.0) @ values
                    for m in (visible, local))
    return ((full - stream).square().sum((2, 3, 4)) / full.square().sum((2, 3, 4)).clamp_min(1e-12))


@register_scorer("duoattention")
@dataclass
class DuoAttention(Wrapper):
    """The ``streaming`` fraction of (layer, KV head) pairs with the lowest ``head_scores`` (L x Hkv, higher =
    retrieval; ``calibration.duoattention.calibrate``) keep their ``sinks`` and ``recent`` tokens and rule the rest
    out (pair it with the ``fill-eligible`` allocator); retrieval heads rank by the ``base`` scorer.

    Uncalibrated (``head_scores`` None), each layer's ``streaming`` fraction of heads whose observed queries lose
    least to the streaming mask (``streaming_error``) stream, per prompt.

    Inferred: the head score (the paper trains a gate per head), the per-prompt fallback, and SnapKV ranking inside
    retrieval heads under a budget (the paper keeps them whole)."""

    head_scores: list | None = None
    streaming: float = 0.5
    sinks: int = 4
    recent: int = 64

    def __post_init__(self):
        if not 0.0 <= self.streaming <= 1.0 or self.sinks < 0 or self.recent < 1:
            raise ValueError(f"duoattention: need 0 <= streaming <= 1, sinks >= 0, recent >= 1, got "
                             f"{self.streaming}, {self.sinks}, {self.recent}")
        super().__post_init__()
        if self.head_scores is not None:
            gates = torch.tensor(self.head_scores, dtype=torch.float64)
            if gates.dim() != 2:
                raise ValueError(f"duoattention: head_scores must be L x Hkv numbers, got shape {tuple(gates.shape)}")
            self._streams = lowest(gates.flatten(), self.streaming).view(gates.shape)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int = 0) -> None:
        """Refuse, at ``apply``, head scores calibrated for another shape of model."""
        if self.head_scores is not None:
            check_per_head_table("duoattention: head_scores", self._streams.shape, num_layers, num_kv_heads)
        super().check_model(num_layers, num_kv_heads, head_dim, hidden_size)

    def score(self, obs: Observation) -> Tensor:
        base = self._base.score(obs).float()
        if self.head_scores is None:
            streams = lowest(streaming_error(obs, self.sinks, self.recent), self.streaming)  # [B, Hkv]
        else:
            streams = self._streams[obs.layer].to(base.device).expand(base.shape[0], -1)
        local = streaming_scores(obs, recent_window(obs, self.sinks, self.recent))
        return torch.where(streams[..., None], local, base)


def lowest(x: Tensor, fraction: float) -> Tensor:
    """[..., N] True at the round(fraction * N) smallest entries of each row (ties: earlier first)."""
    n = round(fraction * x.shape[-1])
    return x.argsort(dim=-1, stable=True).argsort(dim=-1) < n
