"""RoPE arithmetic (transformers' rotate-half layout) that methods and the runtime share: moving post-RoPE vectors
between positions, back to before RoPE, and the rotation averaged over future positions that kvpress's query
models apply. An observation carries its layer's inverse frequencies as ``weights["inv_freq"]`` when the model has
rotary buffers kvcompile can read; without them, vectors are taken as they are."""

from __future__ import annotations

import torch
from torch import Tensor


def rotate(x: Tensor, delta: Tensor, inv_freq: Tensor, precision: torch.dtype = torch.float64) -> Tensor:
    """``x`` [..., D] rotated by ``delta`` [...] positions (a post-RoPE vector moves to another position; a negative
    delta of its own position returns it to before RoPE, up to the model's ``attention_scaling``). The first
    2 * len(inv_freq) channels are rotated, the rest, if any, left alone. Computed in ``precision`` (float32: as
    transformers computes RoPE itself, where a decode step reads every row)."""
    rot = 2 * inv_freq.shape[0]
    angle = delta[..., None].to(precision) * inv_freq.to(precision)  # [..., rot / 2]
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    v = x[..., :rot].to(precision)
    half = torch.cat([-v[..., rot // 2:], v[..., : rot // 2]], -1)
    return torch.cat([(v * cos + half * sin).to(x.dtype), x[..., rot:]], -1)


def mean_rotation(inv_freq: Tensor, start: Tensor, n: int, dim: int) -> Tensor:
    """[B, dim, dim] the RoPE rotation averaged over positions start[b] .. start[b] + n - 1: R x is the mean of
    ``x`` rotated to each of those positions (kvpress's model of where the next ``n`` queries will sit). Each
    frequency turns one channel pair (i, i + rot / 2) by [[cos, -sin], [sin, cos]], so the mean is that block
    with cos and sin averaged over the positions; channels past the rotated ones stay."""
    h = inv_freq.shape[0]
    steps = start.double()[:, None] + torch.arange(n, dtype=torch.float64, device=inv_freq.device)  # [B, n]
    angle = steps[:, :, None] * inv_freq.double()  # [B, n, h]
    cos, sin = angle.cos().mean(1), angle.sin().mean(1)  # [B, h]
    R = torch.eye(dim, dtype=torch.float64, device=inv_freq.device).repeat(start.shape[0], 1, 1)
    i = torch.arange(h, device=inv_freq.device)
    R[:, i, i], R[:, i + h, i + h], R[:, i, i + h], R[:, i + h, i] = cos, cos, -sin, sin
    return R


def pre_rope(obs, x: Tensor, positions: Tensor) -> Tensor:
    """Post-RoPE ``x`` [B, H, N, D] of observation ``obs`` at ``positions`` [B, H or 1, N] rotated back to before RoPE
    (what kvpress recomputes from the hidden states); unchanged without ``inv_freq``. Slots at position -1 stay."""
    inv_freq = obs.weights.get("inv_freq")
    return x if inv_freq is None else rotate(x, -positions.clamp_min(0), inv_freq)


def future_rotation(obs, n: int) -> Tensor:
    """[B, D, D] the RoPE rotation averaged over the ``n`` positions after each row's last observed query, so R @ mu
    is where a pre-RoPE query mean sits on average over them (the identity without ``inv_freq``)."""
    inv_freq = obs.weights.get("inv_freq")
    B, D = obs.query_positions.shape[0], obs.keys.shape[-1]
    if inv_freq is None:
        return torch.eye(D, dtype=torch.float64, device=obs.keys.device).expand(B, D, D)
    return mean_rotation(inv_freq, obs.query_positions.max(1).values + 1, n, D)
