"""Rotated rows at 2, 3 or 4 bits a channel (formats ``rot2``, ``rot3``, ``rot4``, and keys and values at different
bits: ``rotk3v2``, ``rotk4v2``): the rotation-then-Gaussian-levels idea of
TurboQuant and QuaRot, written here from their descriptions (not their code).

A row x [D] is multiplied by fixed random signs and rotated by the orthonormal Walsh-Hadamard transform H. That
spreads an outlier channel over every channel and makes the rotated coordinates close to Gaussian, so each is coded
on the Lloyd-Max levels of a standard Gaussian (the levels that minimise its squared error), scaled by the row's
root mean square (fp16). A row stores D * bits / 8 bytes of codes and its scale: row-local, so rows move between
pages as bytes. Attention never rotates a stored row back: a query is rotated once and meets the codes' levels
(``dot``), and values are mixed in the rotated basis and the sum rotated back (``mix``).

This library's choices (inferred, not from a paper): one seeded sign vector per head dim, the row's RMS as the
scale (no search for a better one), no channel kept apart. No Triton layout yet: a GPU decodes these pages in
PyTorch; the native CPU decode does not read them either.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .codec import RowCodec, Stored
from .hadamard import fwht
from .packing import pack, unpack

# the positive half of the Lloyd-Max levels of a standard Gaussian (Max, 1960), and their mean squared error
LEVELS = {2: (0.4528, 1.5104), 3: (0.2451, 0.7560, 1.3440, 2.1520),
          4: (0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326)}
GAUSSIAN_MSE = {2: 0.1175, 3: 0.03455, 4: 0.009501}
SIGN_SEED = 0
SCALE_FLOOR = 2.0**-24  # smallest fp16 scale kept: an all-zero row decodes to zeros


@functools.cache
def _levels(bits: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The 2^bits levels, ascending, and the 2^bits - 1 midpoints between them."""
    half = torch.tensor(LEVELS[bits], device=device)
    levels = torch.cat([-half.flip(0), half])
    return levels, (levels[1:] + levels[:-1]) / 2


@functools.cache
def _signs(head_dim: int, device: torch.device) -> Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED)
    return (torch.randint(0, 2, (head_dim,), generator=g) * 2 - 1).float().to(device)


def rotate(x: Tensor) -> Tensor:
    """Rows [..., D] in the rotated basis (fp32): H (signs * x). Its inverse is ``signs * H y``."""
    return fwht(x.float() * _signs(x.shape[-1], x.device))


def unrotate(y: Tensor) -> Tensor:
    return fwht(y) * _signs(y.shape[-1], y.device)


@dataclass(frozen=True)
class RotatedCodec(RowCodec):
    """``bits`` (2, 3 or 4) a channel in the rotated basis, codes packed along D, an fp16 scale per row."""

    bits: int
    exact_reencode = False  # the scale is the row's RMS, which a decoded row does not keep exactly

    @classmethod
    def reading(cls, s: Stored) -> RotatedCodec | None:
        """uint8 codes and one fp16 scale a row."""
        if s.dtype != torch.uint8 or s.meta_dtype != torch.float16 or s.meta_width != 1:
            return None
        return cls(8 * s.width // s.head_dim)

    def _check(self, head_dim: int) -> None:
        if self.bits not in LEVELS or head_dim & (head_dim - 1) or head_dim < 8:
            raise ValueError(f"rot{self.bits} pages need 2, 3 or 4 bits and a power-of-two head dim of at least 8, "
                             f"got {self.bits} bits and head dim {head_dim}")

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        self._check(x.shape[-1])
        y = rotate(x)
        scale = (y.square().mean(-1, keepdim=True).sqrt()).clamp_min(SCALE_FLOOR).half()
        _, edges = _levels(self.bits, x.device)
        codes = torch.bucketize(y / scale.float(), edges).to(torch.uint8)
        return pack(codes, self.bits), scale

    def _rotated(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        """The rows in the rotated basis [..., D]: each code's level times the row's scale."""
        levels, _ = _levels(self.bits, codes.device)
        return (levels.to(dtype)[unpack(codes, self.bits).long()] * meta.to(dtype))

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        return unrotate(self._rotated(codes, meta, torch.float32)).to(dtype)

    def dot(self, q: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """q . x = (H signs q) . (H signs x): the query rotated once, the rows read as levels."""
        return torch.matmul(rotate(q).to(q.dtype), self._rotated(codes, meta, q.dtype).transpose(-1, -2))

    def mix(self, p: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """sum_i p_i x_i = signs H (sum_i p_i y_i): mixed in the rotated basis, rotated back once."""
        return unrotate(torch.matmul(p.float(), self._rotated(codes, meta, torch.float32))).to(p.dtype)

    def row_bytes(self, head_dim: int) -> int:
        self._check(head_dim)
        return head_dim * self.bits // 8 + 2

    def error_bound(self, x: Tensor) -> Tensor:
        """|x_i - x̂_i| <= ||y - ŷ|| (a row of an orthonormal matrix has unit norm), and each rotated coordinate, in
        units of the stored scale, is off by at most half the widest gap between levels, or by how far it lies past
        the outermost level."""
        self._check(x.shape[-1])
        y = rotate(x)
        scale = y.square().mean(-1, keepdim=True).sqrt().clamp_min(SCALE_FLOOR).half().float()
        levels, _ = _levels(self.bits, x.device)
        half_gap = float((levels[1:] - levels[:-1]).max()) / 2
        per = torch.maximum(torch.full_like(y, half_gap), (y / scale).abs() - float(levels[-1]))
        bound = scale * per.square().sum(-1, keepdim=True).sqrt()
        return (bound * (1 + 1e-4) + 1e-6 * scale * math.sqrt(x.shape[-1])).expand_as(x)
