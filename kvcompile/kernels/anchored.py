"""AnchorKV's rows (``methods.anchorkv``, docs/methods_formats.md#anchorkv): a stored token is its nearest anchor
scaled, plus, where compression chose to refine it, a 2-bit residual. A row holds three int16: the anchor's index in its
head's anchor table, the scale gamma (fp16 bits) and the slot of its residual in its layer's residual arena (-1: none).
Rows mean nothing without their sequence's tables, which the cache holds beside the pool (``cache.anchored``) and
attention reads with it (``FormatPages.anchors``, ``FormatPages.residuals``), per layer:

    anchors    [2, B, Hkv, 1 + A, D] fp32, keys then values: row 0 the RoPE inverse frequencies (zero-padded to D;
               zero for values and for a model without RoPE), rows 1.. the head's anchors, exact; keys before RoPE,
               rotated to their token's position when read
    residuals  [2, B, R, D / 4 + 2] uint8: a coded residual per slot (the layer's heads share them): D 2-bit codes,
               then the fp16 scale's two bytes; R <= ``MAX_SLOTS``

Residual codec (AnchorKV's: randomized Hadamard, 2-bit Lloyd-Max codebook for a Gaussian): y = H(s * r) with fixed
random signs s, orthonormal, so its coordinates are near-Gaussian with variance ||r||^2 / D; each is coded by the
4-level Lloyd-Max quantizer of a unit Gaussian at the scale sigma = ||r|| / sqrt(D). The source says "per-token absmax
scaling"; which scale feeds a Gaussian codebook is not given there, so the RMS is inferred. Rows are row-local: they
move between pages as bytes, their tables staying put; only compression encodes them (``kvcompile.anchoring``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..methods.anchorkv import AnchorKV
from ..methods.rope import rotate
from .codec import Stored
from .hadamard import fwht
from .packing import pack, unpack

LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)  # Lloyd-Max, 4 levels, unit Gaussian
THRESHOLDS = (-0.9816, 0.0, 0.9816)
SIGN_SEED = 0
MAX_SLOTS = 2**15 - 1  # residual slots of a layer and part at most (int16 slots)


@dataclass(frozen=True)
class AnchorCodec:
    """Keys' or values' rows: 6 bytes a row, no page metadata (keys are the part whose anchors sit before RoPE)."""

    page_local = False
    window = AnchorKV.window  # observed queries the choice of anchors and utilities reads

    @classmethod
    def reading(cls, s: Stored) -> AnchorCodec | None:
        return cls() if s.dtype == torch.int16 else None

    def row_bytes(self, head_dim: int) -> int:
        return 6

    def page_meta_bytes(self, head_dim: int) -> int:
        return 0

    def zeros(self, *rows: int, device=None) -> tuple[Tensor, Tensor]:
        """Codes and meta of ``rows`` [..., D] rows that hold nothing yet (slot -1: no residual)."""
        *shape, _ = rows
        codes = torch.zeros(*shape, 3, dtype=torch.int16, device=device)
        codes[..., 2] = -1
        return codes, torch.zeros(*shape, 0, device=device)

    def encode(self, x: Tensor):
        raise NotImplementedError("AnchorKV rows are encoded against their sequence's anchors by compression "
                                  "(kvcompile.anchoring): a recipe in anchor pages cannot demote tokens while decoding")


def residual_bytes(head_dim: int) -> int:
    """Bytes of one coded residual: D 2-bit codes and an fp16 scale."""
    return head_dim // 4 + 2


@functools.cache
def _signs(head_dim: int, device: torch.device) -> Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED)
    return (torch.randint(0, 2, (head_dim,), generator=g) * 2 - 1).float().to(device)


@functools.cache
def _rotation(head_dim: int, device: torch.device) -> Tensor:
    """[D, D] the randomized Hadamard transform as a matrix M: a residual r codes as y = r M^T, decodes as y M."""
    return fwht(torch.eye(head_dim, device=device)) * _signs(head_dim, device)


@functools.cache
def _byte_levels(device: torch.device) -> Tensor:
    """[256, 4] the unit levels of the four 2-bit codes in each byte, plane by plane (``packing.pack``'s order)."""
    planes = unpack(torch.arange(256, dtype=torch.uint8, device=device)[:, None], 2)  # [256, 4]
    return torch.tensor(LEVELS, device=device)[planes.long()]


def encode_residuals(r: Tensor) -> Tensor:
    """Residuals [..., D] -> codes [..., D / 4 + 2] uint8."""
    D = r.shape[-1]
    y = r.float() @ _rotation(D, r.device).T
    sigma = (y.norm(dim=-1) / D**0.5).half()[..., None]  # (keepdim gives an empty batch a stride ``view`` refuses)
    t = y / sigma.float().clamp_min(1e-30)
    q = torch.bucketize(t, torch.tensor(THRESHOLDS, device=r.device)).to(torch.uint8)
    return torch.cat([pack(q, 2), sigma.view(torch.uint8)], -1)


def decode_residuals(codes: Tensor) -> Tensor:
    """``encode_residuals``' inverse: codes [..., D / 4 + 2] -> residuals [..., D] fp32."""
    y = _levels(codes)
    return y @ _rotation(y.shape[-1], codes.device)


def _levels(codes: Tensor) -> Tensor:
    """Codes [..., D / 4 + 2] -> their rotated residuals [..., D] (levels times sigma): a byte's four levels read
    from one table; ``@ _rotation`` finishes decoding them, which a weighted sum can do once after summing."""
    sigma = codes[..., -2:].contiguous().view(torch.float16).float()
    levels = F.embedding(codes[..., :-2].long(), _byte_levels(codes.device))  # [..., D / 4, 4]: plane p: p D/4..
    return levels.transpose(-1, -2).flatten(-2) * sigma


def residual_error_bound(r: Tensor) -> Tensor:
    """[...] bound on ``decode_residuals(encode_residuals(r))``'s L2 error: a rotated coordinate t (in units of
    sigma) is off by at most half the gap between its two nearest levels inside the codebook (0.529), or by how far
    it lies past the outer level; the rotation keeps L2; plus sigma's fp16 rounding on every level."""
    D = r.shape[-1]
    y = r.float() @ _rotation(D, r.device).T
    sigma = y.norm(dim=-1, keepdim=True) / D**0.5
    per = torch.maximum(torch.full_like(y, (LEVELS[3] - LEVELS[2]) / 2) * sigma, y.abs() - LEVELS[3] * sigma)
    return per.norm(dim=-1) + LEVELS[3] * sigma[..., 0] * D**0.5 * 2.0**-10 + 1e-6


def decode(codes: Tensor, anchors: Tensor, residuals: Tensor, pos: Tensor, rotary: bool) -> Tensor:
    """Rows [B, Hkv, S, D] fp32 of the codes [B, Hkv, S, 3] at positions ``pos`` [B, Hkv, S], against their
    sequences' ``anchors`` [B, Hkv, 1 + A, D] and ``residuals`` [B, R, W]; keys (``rotary``) rotated to ``pos``."""
    scaled, rotated = _terms(codes, anchors, residuals)
    rows = scaled if rotated is None else scaled + rotated @ _rotation(scaled.shape[-1], codes.device)
    if rotary and anchors.shape[2]:
        rows = rotate(rows, pos.clamp_min(0), anchors[0, 0, 0, : rows.shape[-1] // 2], torch.float32)
    return rows


def mix(p: Tensor, codes: Tensor, anchors: Tensor, residuals: Tensor) -> Tensor:
    """Weights p [B, Hkv, G, S] times the rows of value codes [B, Hkv, S, 3]: [B, Hkv, G, D]; the residuals summed
    while still rotated, so the rotation is undone once per query instead of once per row."""
    scaled, rotated = _terms(codes, anchors, residuals)
    out = torch.matmul(p, scaled)
    return out if rotated is None else out + torch.matmul(p, rotated) @ _rotation(out.shape[-1], codes.device)


def _terms(codes: Tensor, anchors: Tensor, residuals: Tensor) -> tuple[Tensor, Tensor | None]:
    """Each row's anchor times its gamma, and its residual still rotated (0 without a slot; None: no slots)."""
    B, Hkv, S, _ = codes.shape
    A1, D = anchors.shape[2], anchors.shape[-1]
    index, slot = codes[..., 0].long() + 1, codes[..., 2].long()
    gamma = codes[..., 1].contiguous().view(torch.float16).float()
    head = torch.arange(B * Hkv, device=codes.device).view(B, Hkv, 1) * A1
    scaled = gamma[..., None] * F.embedding(head + index, anchors.reshape(-1, D))  # each row's anchor, one lookup
    if not residuals.shape[1]:
        return scaled, None
    at = (torch.arange(B, device=codes.device).view(B, 1, 1) * residuals.shape[1] + slot.clamp_min(0)).flatten()
    coded = residuals.reshape(-1, residuals.shape[-1]).index_select(0, at).view(B, Hkv, S, -1)
    return scaled, _levels(coded) * (slot >= 0)[..., None]


def encode_rows(index: Tensor, gamma: Tensor, slot: Tensor) -> Tensor:
    """Row codes [..., 3] int16 from anchor indices, fp16 scales and residual slots [...]."""
    return torch.stack([index.to(torch.int16), gamma.half().view(torch.int16), slot.to(torch.int16)], -1)
