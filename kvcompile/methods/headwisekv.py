"""HeadWiseKV (docs/methods_allocators.md#headwisekv): a static history window per physical KV head, picked from a few
levels (fractions of the context), so heads that look far keep far and local heads keep little; SeqCalib chooses the
levels layer by layer on offline text under the aggregate budget (``calibration.headwisekv``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation, Wrapper, check_per_head_table, register_scorer
from .streaming_heads import RULED_OUT

LEVELS = (0.0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)  # the multilevel windows, fractions of the context


def head_windows(obs: Observation, sinks: int, recent: Tensor) -> Tensor:
    """[B, Hkv, S] each head's first ``sinks`` positions and its ``recent`` [Hkv] newest (by position)."""
    newest = obs.positions.masked_fill(~obs.valid, -1).flatten(1).amax(1)[:, None, None]  # [B, 1, 1]
    return obs.valid & ((obs.positions < sinks) | (obs.positions > newest - recent[None, :, None]))


def recent_tokens(levels: Tensor, context: Tensor) -> Tensor:
    """Tokens of history a window level (fraction of the context) keeps: round(level * context)."""
    return (levels.double() * context.double()).round().long()


@register_scorer("headwisekv")
@dataclass
class HeadWiseKV(Wrapper):
    """Each (layer, KV head) keeps its ``sinks`` and the newest ``windows[l][h]`` fraction of the context, ranked
    inside by the ``base`` scorer, and rules the rest out (pair it with ``fill-eligible``: a head then holds its
    window whenever the windows fit the budget). ``windows`` None: every window is the whole context, so the base
    ranks under equal shares (with ``streamingllm``: StreamingLLM, the uniform allocation HeadWiseKV is measured
    against).

    Inferred (the paper was read as a summary): the levels, the sinks, ranking inside a window by the base when the
    budget cuts into it, and SeqCalib's criterion (``calibration.headwisekv``)."""

    windows: list | None = None
    sinks: int = 4
    base: str = "streamingllm"

    def __post_init__(self):
        if self.sinks < 0:
            raise ValueError(f"headwisekv: need sinks >= 0, got {self.sinks}")
        super().__post_init__()
        if self.windows is not None:
            levels = torch.tensor(self.windows, dtype=torch.float64)
            if levels.dim() != 2 or not bool(((levels >= 0) & (levels <= 1)).all()):
                raise ValueError(f"headwisekv: windows must be L x Hkv fractions in [0, 1], got {self.windows!r}")
            self._levels = levels

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int = 0) -> None:
        """Refuse, at ``apply``, a windows table calibrated for another shape of model."""
        if self.windows is not None:
            check_per_head_table("headwisekv: windows", self._levels.shape, num_layers, num_kv_heads)
        super().check_model(num_layers, num_kv_heads, head_dim, hidden_size)

    def score(self, obs: Observation) -> Tensor:
        base = self._base.score(obs).float()
        if self.windows is None:
            return base
        context = obs.positions.masked_fill(~obs.valid, -1).amax() + 1
        recent = recent_tokens(self._levels[obs.layer].to(base.device), context)
        return base.masked_fill(~head_windows(obs, self.sinks, recent), RULED_OUT)


def window_error(obs: Observation, context: int, sinks: int, recent: Tensor) -> Tensor:
    """[Hkv] how far each head's output moves, for the observed queries (a probe read after a context of
    ``context`` tokens was compressed), when the context keeps only its ``sinks`` and ``recent`` [Hkv] newest tokens
    (the probe's own keys stay): sum over queries of ||O_full - O_window||^2 / sum of ||O_full||^2, GQA group pooled,
    first row only. Sliding-window layers attend within their window in both."""
    _, Hkv, S, D = obs.keys.shape
    q = obs.queries[:1].reshape(1, Hkv, -1, obs.queries.shape[2], D).float()
    logits = torch.einsum("bhgwd,bhsd->bhgws", q, obs.keys[:1].float()) * obs.scale
    qp, kp = obs.query_positions[:1, None, None, :, None], obs.positions[:1, :, None, None, :]
    visible = obs.valid[:1, :, None, None, :] & (kp <= qp) & (qp >= 0)
    if obs.window > 0:
        visible = visible & (qp - kp < obs.window)
    kept = (kp < sinks) | (kp >= context - recent.to(kp.device)[None, :, None, None, None]) | (kp >= context)
    values = obs.values[:1].float()[:, :, None]
    full, windowed = (torch.softmax(logits.masked_fill(~m, float("-inf")), -1).nan_to_num(0.0) @ values
                      for m in (visible, visible & kept))
    return ((full - windowed).square().sum((0, 2, 3, 4)) / full.square().sum((0, 2, 3, 4)).clamp_min(1e-12))
