"""AnchorKV (arXiv 2608.02901; from a third-party transcription of its method section, provenance
"secondary": constants to check against the paper): no token is dropped; a few anchors per head are stored exactly
and every other token as its most similar anchor scaled, plus a coded residual where that matters most to the output.
Not a scorer: compression asks it for anchors, assignments and utilities (``kvcompile.anchoring``), and the
``anchor2`` page format stores the result (``kernels.anchored``). Keys are compared before RoPE, as the source says."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation
from .rope import rotate
from .snapkv import SnapKV


@dataclass(frozen=True)
class AnchorKV:
    """Per head, k = max(``window``, S / ``per_anchor``) anchors for S held tokens: the ``window`` newest, then a
    ``snap`` share of the rest by SnapKV's score (mean attention of the last ``window`` queries, average-pooled over
    ``kernel``), the others uniformly at random (``seed``)."""

    window: int = 32
    per_anchor: int = 128
    snap: float = 0.7
    kernel: int = 7
    seed: int = 42

    def __post_init__(self):
        if self.window < 1 or self.per_anchor < 1 or not 0 <= self.snap <= 1:
            raise ValueError(f"AnchorKV needs window >= 1, per_anchor >= 1 and 0 <= snap <= 1, got {self.window}, "
                             f"{self.per_anchor}, {self.snap}")

    def anchors(self, obs: Observation) -> Tensor:
        """[B, Hkv, S] True at each head's anchors."""
        valid, pos = obs.valid, obs.positions
        n = valid.sum(-1, keepdim=True)  # [B, Hkv, 1]
        k = torch.maximum(n.clamp_max(self.window), n // self.per_anchor).clamp_max(n)
        newest = (_rank(pos.masked_fill(~valid, -1).float()) < self.window) & valid
        rest = valid & ~newest
        n_snap = ((k - newest.sum(-1, keepdim=True)).clamp_min(0) * self.snap).floor().long()
        score = SnapKV(self.window, self.kernel, smoothing="avg").score(obs).float().masked_fill(~rest, float("-inf"))
        snapped = (_rank(score) < n_snap) & rest
        n_rand = (k - newest.sum(-1, keepdim=True) - n_snap).clamp_min(0)
        g = torch.Generator().manual_seed(self.seed)
        draw = torch.rand(valid.shape, generator=g).to(valid.device).masked_fill(~(rest & ~snapped), -1.0)
        return newest | snapped | (_rank(draw) < n_rand) & rest & ~snapped

    def utilities(self, obs: Observation, key_residuals: Tensor, value_residuals: Tensor) -> tuple[Tensor, Tensor]:
        """[B, Hkv, S] each token's refinement utility for its key and its value (AnchorKV's): the observed queries'
        squared attention times the squared logit change its key residual (before RoPE, ``key_residuals``) causes, times
        ||v_t - y||^2, for keys; times its value residual's squared norm for values; averaged over the queries."""
        B, Hkv, S, _ = obs.keys.shape
        attn = obs.window_attention().float()  # [B, Hq, W, S]
        Hq = attn.shape[1]
        grouped = lambda x: x.repeat_interleave(Hq // Hkv, 1)  # noqa: E731  ([B, Hkv, ...] -> [B, Hq, ...])
        inv_freq = obs.weights.get("inv_freq")
        rotated = key_residuals if inv_freq is None else rotate(key_residuals, obs.positions.clamp_min(0), inv_freq)
        dlogit = torch.matmul(obs.queries.float(), grouped(rotated).transpose(-1, -2)) * obs.scale  # [B, Hq, W, S]
        v = grouped(obs.values.float())
        y = torch.matmul(attn, v)  # [B, Hq, W, D]
        spread = (v.square().sum(-1)[:, :, None] - 2 * torch.matmul(y, v.transpose(-1, -2))
                  + y.square().sum(-1, keepdim=True)).clamp_min(0)
        a2 = attn.square()
        queries = (obs.query_positions >= 0).sum(-1).clamp_min(1).view(B, 1, 1) * (Hq // Hkv)
        u_k = (a2 * dlogit.square() * spread).sum(2).view(B, Hkv, -1, S).sum(2) / queries
        u_v = a2.sum(2).view(B, Hkv, -1, S).sum(2) * value_residuals.float().square().sum(-1) / queries
        return u_k, u_v


def nearest(x: Tensor, anchors: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of x [B, H, S, D]: the index of its most similar anchor of ``anchors`` [B, H, A, D] by absolute
    cosine (only where ``present`` [B, H, A]), and the scale gamma = <x, a> / ||a||^2 of that anchor ([B, H, S])."""
    xn = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    an = anchors / anchors.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    cos = torch.matmul(xn, an.transpose(-1, -2)).abs().masked_fill(~present[:, :, None], -1.0)
    index = cos.argmax(-1)
    chosen = anchors.gather(2, index[..., None].expand_as(x))
    gamma = (x * chosen).sum(-1) / chosen.square().sum(-1).clamp_min(1e-30)
    return index, gamma


def _rank(score: Tensor) -> Tensor:
    """[..., S] each entry's rank along the last dim by descending score (0: the largest)."""
    return score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
