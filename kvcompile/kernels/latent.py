"""Latent rows (SPECTRA's, ``methods.spectra``; SAKI's keys, ``methods.saki``; docs/methods_formats.md): a vector stored
as codes of its coordinates in a per-head basis, each group of ``group`` latent channels at the width the basis
allotted it, with an fp16 scale and minimum per group and token (a group at 0 bits keeps the token's mean over it
there). Row-local, so rows move between a head's pages as bytes; but the codes mean nothing without their head's
basis, which the cache holds.

A layer's basis, as the cache holds it and attention reads it (``FormatPages.basis``): [2, Hkv, 2D + 3, D], keys
then values. Rows 0..D-1 map a latent row to the vector (``up``), rows D..2D-1 a vector to its latent (``down``),
row 2D is the mean subtracted first (SAKI's key mean; 0 for SPECTRA), row 2D + 1 the RoPE inverse frequencies,
zero-padded (all zero for values, and for keys of a model without RoPE: keys are stored before RoPE, where the
basis was measured, and rotated to their positions when read), row 2D + 2 each channel's width. Attention reads
keys decoded a tile at a time (latent, ``up``, rotation), and mixes values in the latent basis, mapping only the
weighted sum through ``up``: the basis is applied after attention, as SPECTRA does.

Codes: one bit plane per (group, bit) of the head's widths, group 0's from bit 0 up, then group 1's, ...; a plane
holds one bit of the group's ``group`` channels, 8 a byte (channel c in bit c % 8). Every head spends the same
bits, so rows have one width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..methods import saki, spectra
from ..methods.rope import rotate


@dataclass(frozen=True)
class LatentCodec:
    """Rows in a per-head basis at a mean of ``bits`` per channel in groups of ``group`` (``rotary``: keys, stored
    before RoPE). ``basis`` names its construction (``model_basis``): "spectra" (SPECTRA's), "saki" (SAKI's
    score-preserving factorisation of keys) or "identity" (the rows themselves, int4-like). What a row costs is
    fixed by ``bits`` and ``group`` alone: the basis decides which group gets which width."""

    bits: int
    group: int = 32
    rotary: bool = False
    basis: str = "spectra"
    page_local = False

    def group_of(self, head_dim: int) -> int:
        """Channels a group holds at this head dim: ``group``, or the whole row when it is shorter."""
        group = min(self.group, head_dim)
        if head_dim % group or group % 8:
            raise ValueError(f"latent pages group channels by {group}, a multiple of 8 that must divide the head "
                             f"dim; got head dim {head_dim}")
        return group

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8 + 4 * (head_dim // self.group_of(head_dim))

    def page_meta_bytes(self, head_dim: int) -> int:
        return 0

    def zeros(self, *rows: int, device=None) -> tuple[Tensor, Tensor]:
        """Codes and meta of ``rows`` [..., D] rows that hold nothing yet (an empty pool's pages)."""
        *shape, D = rows
        groups = D // self.group_of(D)
        return (torch.zeros(*shape, D * self.bits // 8, dtype=torch.uint8, device=device),
                torch.zeros(*shape, 2 * groups, dtype=torch.float16, device=device))


def layout(up: Tensor, widths: Tensor, inv_freq: Tensor | None = None, down: Tensor | None = None,
           mean: Tensor | None = None) -> Tensor:
    """One part's basis as the cache holds it: [H, 2D + 3, D] from ``up`` [H, D, D] (latent -> vector), group
    ``widths`` [H, n], the RoPE inverse frequencies [D / 2] (keys) or None, ``down`` [H, D, D] (vector -> latent;
    default ``up``'s inverse) and the ``mean`` [H, D] subtracted first (default 0)."""
    H, D, _ = up.shape
    down = torch.linalg.inv(up.double()).float() if down is None else down.float()
    mean = up.new_zeros(H, D) if mean is None else mean
    freq = up.new_zeros(H, D)
    if inv_freq is not None:
        freq[..., : inv_freq.shape[-1]] = inv_freq.to(up.dtype)
    channel_widths = widths.repeat_interleave(D // widths.shape[-1], -1).to(up.dtype)
    return torch.cat([up.float(), down, torch.stack([mean.float(), freq.float(), channel_widths.float()], 1)], 1)


def model_basis(codecs, moments, rotary, head_dim: int) -> Tensor:
    """[L, 2, Hkv, 2D + 3, D] the basis of every layer (``layout``) for rows in ``codecs`` (key, value), from each
    layer's calibration (``methods.moments.Moments``, ``calibration.latent``) and RoPE inverse frequencies
    (``rotary``: one per layer, or () for none)."""
    out = []
    for layer, m in enumerate(moments):
        freq = torch.tensor(rotary[layer], dtype=torch.float32) if rotary and len(rotary[layer]) else None
        out.append(torch.stack([_part(codec, m, part, freq if part == 0 else None, head_dim)
                                for part, codec in enumerate(codecs)]))
    return torch.stack(out)


def _part(codec: LatentCodec, m, part: int, freq, D: int) -> Tensor:
    """One layer's basis of keys (``part`` 0) or values for ``codec``."""
    group = codec.group_of(D)
    H, steps = m.keys.shape[0], codec.bits * D // group
    if codec.basis == "identity":
        eye = torch.eye(D).expand(H, D, D)
        return layout(eye, torch.full((H, D // group), codec.bits), freq)
    if codec.basis == "saki":  # keys only: codes c = B_kᵀ(k - μ), read back as μ + B_q c (SAKI's map at full rank)
        maps = [saki.saki(q, k - torch.outer(mu, mu), mu, D)[0] for q, k, mu in zip(m.queries, m.keys, m.key_mean)]
        energy = torch.stack([saki.score_energies(q, k - torch.outer(mu, mu))
                              for q, k, mu in zip(m.queries, m.keys, m.key_mean)])
        widths = torch.stack([spectra.allocate(e.square(), steps, group) for e in energy])  # score error: λ² 4^-b
        return layout(torch.stack([x.query_map.T for x in maps]).float(), widths, freq,
                      torch.stack([x.key_map for x in maps]), m.key_mean.float())
    parts = spectra.basis(m.keys if part == 0 else m.values, codec.bits, group)
    return layout(parts.up, parts.widths, freq)


def widths_of(basis: Tensor, group: int) -> Tensor:
    """[H, n] the group widths a part's basis [H, 2D + 3, D] holds."""
    return basis[:, -1, ::group].round().long()


def encode(x: Tensor, basis: Tensor, group: int, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Vectors x [..., H, S, D] (keys post-RoPE at ``positions`` [..., H, S] when the basis has frequencies) ->
    codes uint8 [..., H, S, W] and meta fp16 [..., H, S, 2 n] (scale and minimum of each of n groups)."""
    widths = widths_of(basis, group)
    latent, w, low, high, mean, levels = _groups(x, basis, group, positions)
    scale = torch.where(w > 0, (high - low) / levels.clamp_min(1), 0.0).half()
    low = torch.where(w > 0, low, mean).half()
    q = ((latent - low.float()) / scale.float().clamp_min(2.0**-24)).round_().clamp_(min=0).minimum(levels)
    return pack(q.to(torch.uint8), widths), torch.cat([scale, low], -1).flatten(-2)


def encode_heads(x: Tensor, basis: Tensor, group: int, layer: Tensor, head: Tensor,
                 positions: Tensor) -> list[Tensor]:
    """``encode`` of rows x [n, D] of many heads, each in its own basis (``basis`` [L, Hkv, 2D + 3, D]; ``layer``,
    ``head``, ``positions`` [n]: each row's), one head at a time: codes [n, W] and meta [n, 2 n_groups]."""
    Hkv, D = basis.shape[1], basis.shape[-1]
    codes = torch.zeros(x.shape[0], int(basis[0, 0, -1].sum()) // 8, dtype=torch.uint8, device=x.device)
    meta = torch.zeros(x.shape[0], 2 * (D // group), dtype=torch.float16, device=x.device)
    for pair in (layer * Hkv + head).unique().tolist():
        at = layer * Hkv + head == pair
        c, m = encode(x[at][None].float(), basis[pair // Hkv, pair % Hkv : pair % Hkv + 1], group, positions[at][None])
        codes[at], meta[at] = c[0], m[0]
    return [codes, meta]


def to_latent(x: Tensor, basis: Tensor, positions: Tensor | None = None) -> Tensor:
    """[..., H, S, D] the latent coordinates of vectors x (keys taken back to before RoPE first): what codes store."""
    D = x.shape[-1]
    return (_rotated(x.float(), basis, positions, -1) - basis[:, 2 * D, None]) @ basis[:, D : 2 * D]


def latent_rows(codes: Tensor, meta: Tensor, basis: Tensor) -> Tensor:
    """[..., H, S, D] the latent rows that codes [..., H, S, W] and meta [..., H, S, 2 n] decode to."""
    D, n = basis.shape[-1], meta.shape[-1] // 2
    q = unpack(codes, widths_of(basis, D // n), D // n).float()  # [..., H, S, n, g]
    scale, low = meta.float().unflatten(-1, (n, 2)).unbind(-1)
    return (q * scale[..., None] + low[..., None]).flatten(-2)


def decode(codes: Tensor, meta: Tensor, basis: Tensor, positions: Tensor | None = None) -> Tensor:
    """``encode``'s inverse up to its rounding: vectors [..., H, S, D] float32, keys rotated to ``positions``."""
    D = basis.shape[-1]
    return _rotated(latent_rows(codes, meta, basis) @ basis[:, :D] + basis[:, 2 * D, None], basis, positions, 1)


def error_bound(x: Tensor, basis: Tensor, group: int, positions: Tensor | None = None) -> Tensor:
    """[..., H, S, D] the largest error ``decode(encode(x))`` may have in each *latent* channel: half a step (of
    the rounded scale) plus the fp16 rounding of the grid; in a 0-bit group, the distance to the mean (rounded)."""
    latent, w, low, high, mean, levels = _groups(x, basis, group, positions)
    levels = levels.clamp_min(1)
    scale = (high - low) / levels
    grid = (low - low.half().float()).abs() + levels * (scale - scale.half().float()).abs()
    dropped = (latent - mean).abs() + (mean - mean.half().float()).abs()
    slack = 2.0**-16 * latent.abs().amax(-1, keepdim=True)  # the rotation and the basis's fp32 products
    return (torch.where(w > 0, 0.5 * scale.half().float() + grid, dropped) + slack).flatten(-2)


def _groups(x: Tensor, basis: Tensor, group: int, positions: Tensor | None):
    """What ``encode`` grids and ``error_bound`` bounds: the latent rows in groups [..., H, S, n, g], each group's
    width [H, 1, n, 1], its minimum, maximum and mean per token, and its top level 2^w - 1."""
    latent = to_latent(x, basis, positions).unflatten(-1, (-1, group))
    w = widths_of(basis, group)[:, None, :, None]
    low, high, mean = latent.amin(-1, keepdim=True), latent.amax(-1, keepdim=True), latent.mean(-1, keepdim=True)
    return latent, w, low, high, mean, (2.0**w - 1).float()


def _rotated(x: Tensor, basis: Tensor, positions: Tensor | None, sign: int) -> Tensor:
    """x rotated by ``sign`` x ``positions`` with the basis's frequencies (as is without any)."""
    D = basis.shape[-1]
    freq = basis[0, 2 * D + 1, : D // 2]
    rotated = int((freq != 0).sum())  # the model's rotary frequencies (fewer than D / 2 under partial RoPE)
    if positions is None or not rotated:
        return x
    return rotate(x, sign * positions.clamp_min(0), freq[:rotated])


def _planes(widths: Tensor) -> tuple[Tensor, Tensor]:
    """Per head, each bit plane's (group, bit) [H, P]."""
    n = widths.shape[-1]
    groups = torch.repeat_interleave(torch.arange(n, device=widths.device).expand_as(widths).flatten(),
                                     widths.flatten()).view(widths.shape[0], -1)
    first = torch.cumsum(widths, -1) - widths  # each group's first plane
    return groups, torch.arange(groups.shape[-1], device=widths.device) - first.gather(-1, groups)


def pack(q: Tensor, widths: Tensor) -> Tensor:
    """Codes q [..., H, S, n, g] (group i's below 2^widths[h, i]) -> bytes [..., H, S, P g / 8]."""
    groups, bit = _planes(widths)  # [H, P]
    g = q.shape[-1]
    index = groups[:, None, :, None].expand(*q.shape[:-2], groups.shape[-1], g)
    planes = (q.gather(-2, index).to(torch.int32) >> bit[:, None, :, None]) & 1  # [..., H, S, P, g]
    weights = 2 ** torch.arange(8, device=q.device, dtype=torch.int32)
    return (planes.unflatten(-1, (g // 8, 8)) * weights).sum(-1).to(torch.uint8).flatten(-2)


def unpack(codes: Tensor, widths: Tensor, group: int) -> Tensor:
    """``pack``'s inverse: [..., H, S, n, g] uint8 codes."""
    groups, bit = _planes(widths)
    H, P = groups.shape
    shifts = torch.arange(8, device=codes.device, dtype=torch.uint8)
    planes = ((codes.unflatten(-1, (P, group // 8))[..., None] >> shifts) & 1).flatten(-2).float()  # [..., P, g]
    place = torch.zeros(H, P, widths.shape[-1], device=codes.device)
    place.scatter_(-1, groups[..., None], (2.0 ** bit.float())[..., None])  # plane p adds 2^bit to its group
    return torch.einsum("...hspc,hpn->...hsnc", planes, place).round_().to(torch.uint8)
