"""Compactor (https://arxiv.org/abs/2507.08143): approximate key leverage scores blended with chunked attention."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Observation, Scorer, pool_groups, protect, register_scorer
from .rope import pre_rope


@register_scorer("compactor")
@dataclass
class Compactor(Scorer):
    """Score = blending * z(leverage) + z(attention): ``leverage`` = statistical leverage of the head's centred keys,
    approximated through a right Gaussian sketch of width ``sketch``; ``attention`` = non-causal attention within
    position chunks of ``chunk`` tokens, summed over the observed prompt queries (up to ``window``), times ||v||,
    smoothed over 3 neighbours; z = z-score over the head's held tokens. The first ``sinks_start`` and last
    ``sinks_end`` tokens are always kept and, as kvpress slices them out, take no part in the scores: not in the
    key centring, the chunks (which start after the first sinks), the attention's softmax or queries, the
    smoothing or the z-score statistics. Defaults follow kvpress's ``CompactorPress``.

    The leverage is over the keys before RoPE, as in the paper and kvpress (rotated back by their positions; as held
    on a model whose rotary frequencies kvcompile cannot read). Inferred: (1) version 3 used the post-RoPE keys.
    (2) kvpress sets blending to the compression ratio, which a scorer does not know; ``blending`` is fixed (0.35
    is kvpress's fallback). (3) z-scores are per head (kvpress normalises over the whole layer)."""

    sinks_start: int = 8
    sinks_end: int = 4
    chunk: int = 256
    sketch: int = 48
    blending: float = 0.35
    window: int = 8192
    seed: int = 0

    def __post_init__(self):
        if min(self.chunk, self.sketch, self.window) < 1 or min(self.sinks_start, self.sinks_end) < 0:
            raise ValueError("chunk, sketch and window must be >= 1 and the sink counts >= 0")

    @property
    def observation_window(self) -> int:
        return self.window

    def _attention(self, obs: Observation):
        """[B, Hq, S] chunked non-causal attention each held key receives, times ||v||."""
        total = obs.received_attention(self.chunk, chunk=self.chunk)
        G = total.shape[1] // obs.keys.shape[1]
        return total * obs.values.float().norm(dim=-1).repeat_interleave(G, 1)

    def _without_sinks(self, obs: Observation) -> tuple[Observation, Tensor]:
        """``obs`` with the sinks left out (their keys invalid, their queries gone, positions counted from the
        first token after the first sinks: kvpress's slice), and the sinks [B, Hkv, S]."""
        last = obs.positions.masked_fill(~obs.valid, -1).amax((-1, -2))  # [B]: each row's newest position
        sinks = (obs.positions < self.sinks_start) | (obs.positions > last[:, None, None] - self.sinks_end)
        qp = obs.query_positions
        q_sink = (qp < self.sinks_start) | (qp > last[:, None] - self.sinks_end)
        core = dataclasses.replace(obs, positions=obs.positions - self.sinks_start, valid=obs.valid & ~sinks,
                                   query_positions=torch.where(q_sink | (qp < 0), -1, qp - self.sinks_start))
        return core, sinks

    def _blend(self, attention, core: Observation, sinks: Tensor, keys: Tensor):
        G = attention.shape[1] // core.keys.shape[1]
        valid = core.valid.repeat_interleave(G, 1).float()
        pool = lambda x: F.avg_pool1d(x, 3, stride=1, padding=1, count_include_pad=False)  # noqa: E731
        smooth = pool(attention * valid) / pool(valid).clamp_min(1e-12)  # the mean over free neighbours only
        g = torch.Generator(device=core.keys.device).manual_seed(self.seed + core.layer)
        lev = leverage(keys, core.valid, self.sketch, g).repeat_interleave(G, 1)
        scores = self.blending * zscore(lev, valid.bool()) + zscore(smooth, valid.bool())
        return protect(scores, sinks.repeat_interleave(G, 1))

    def score_per_query_head(self, obs: Observation):
        core, sinks = self._without_sinks(obs)
        return self._blend(self._attention(core), core, sinks, pre_rope(obs, obs.keys, obs.positions))

    def score(self, obs: Observation):
        core, sinks = self._without_sinks(obs)
        return self._blend(pool_groups(self._attention(core), obs.keys.shape[1]), core, sinks,
                           pre_rope(obs, obs.keys, obs.positions))


def leverage(keys, valid, sketch: int, generator: torch.Generator | None = None):
    """Approximate leverage scores [B, Hkv, S] of each head's centred held keys [B, Hkv, S, D].

    Leverage of row i of X = x_i' (X'X)^-1 x_i. With a right sketch Y = X Phi (Phi [D, sketch] Gaussian) it is
    computed on Y; exact whenever the keys span at most ``sketch`` dimensions (Y then spans the same rows)."""
    Hkv, D = keys.shape[1], keys.shape[-1]
    w = valid[..., None].double()
    x = keys.double() * w
    x = (x - x.sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp_min(1)) * w
    phi = torch.randn(Hkv, D, sketch, generator=generator, device=keys.device, dtype=torch.float64)
    y = x @ phi  # [B, Hkv, S, k]
    gram = y.transpose(-1, -2) @ y
    eye = torch.eye(sketch, dtype=gram.dtype, device=gram.device)
    ridge = 1e-9 * gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / sketch + 1e-30
    solved = torch.linalg.solve(gram + ridge * eye, y.transpose(-1, -2))  # (Y'Y)^-1 Y'
    return (y * solved.transpose(-1, -2)).sum(-1).float()


def zscore(x, valid):
    """(x - mean) / std over each head's ``valid`` entries (the last dim); what the Compactor family ranks by."""
    n = valid.sum(-1, keepdim=True).clamp_min(1)
    x = x.masked_fill(~valid, 0.0)
    mean = x.sum(-1, keepdim=True) / n
    std = (((x - mean) * valid) ** 2).sum(-1, keepdim=True).div(n).sqrt().clamp_min(1e-6)
    return (x - mean) / std
