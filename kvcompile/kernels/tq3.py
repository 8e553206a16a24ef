"""TQ3, Minima-KV's packed 3-bit page format (docs/methods_formats.md#minima-kv, from its third-party reproduction
script): rows rotated by a normalised fast Walsh-Hadamard transform (which spreads an outlier channel over every
channel), then 3-bit codes with one grid per page. Keys keep their norm apart (fp16 per token, stored after the codes)
and quantize their direction on a symmetric grid (-3..3, scale absmax / 3), renormalised after decoding; values use an
affine grid (0..7, scale and minimum per page). Page-local (``formats.ChannelCodec`` alike): metadata [N, 1, M] fp32.
Attention decodes a tile of pages and multiplies (``dot``, ``mix``): the rotation has no cheaper folding here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .codec import Stored
from .hadamard import fwht
from .packing import pack, unpack

FLOOR = 2.0**-30  # smallest scale kept: an empty or constant page decodes to its minimum


class _Decoded:
    """Attention over a codec whose rows are decoded a tile at a time (``formats.Codec``'s defaults)."""

    page_local = True

    def dot(self, q: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        return torch.matmul(q, self.decode(codes, meta, q.dtype).transpose(-1, -2))

    def mix(self, p: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        return torch.matmul(p, self.decode(codes, meta, p.dtype))


@dataclass(frozen=True)
class TQ3Keys(_Decoded):
    """Keys: codes [N, P, 3D/8 + 2] (the 3-bit direction, then the fp16 norm's two bytes), meta [N, 1, 1] the
    page's scale."""

    @classmethod
    def reading(cls, s: Stored) -> TQ3Keys | None:
        return cls() if s.dtype == torch.uint8 and s.meta_dtype == torch.float32 and s.meta_width == 1 else None

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return -2, 0

    def encode_pages(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        x = x.float().masked_fill(~valid[..., None], 0)
        norm = x.norm(dim=-1, keepdim=True)
        rotated = fwht(x / norm.clamp_min(1e-30))
        scale = (rotated.abs().amax((1, 2), keepdim=True) / 3).clamp_min(FLOOR)  # [N, 1, 1]
        q = ((rotated / scale).round_().clamp_(-3, 3) + 3).to(torch.uint8)
        return torch.cat([pack(q, 3), norm.half().view(torch.uint8)], -1), scale

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        """Codes [..., S, W] with their pages' scales [..., S / P, 1] -> rows [..., S, D]."""
        norm = codes[..., -2:].contiguous().view(torch.float16).float()  # [..., S, 1]
        levels = unpack(codes[..., :-2], 3).float() - 3
        rows = levels.unflatten(-2, (meta.shape[-2], -1)) * meta.float().unsqueeze(-2)
        direction = fwht(rows.flatten(-3, -2))
        return (direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-30) * norm).to(dtype)

    def row_bytes(self, head_dim: int) -> int:
        return 3 * head_dim // 8 + 2

    def page_meta_bytes(self, head_dim: int) -> int:
        return 4

    def error_bound(self, x: Tensor, valid: Tensor) -> Tensor:
        """[N, P] bound on each row's L2 error: the rotated direction is off by at most sqrt(D) * scale / 2 in L2,
        renormalising at most doubles that, times the norm; plus the norm's fp16 rounding."""
        x = x.float().masked_fill(~valid[..., None], 0)
        norm = x.norm(dim=-1)
        rotated = fwht(x / norm[..., None].clamp_min(1e-30))
        scale = (rotated.abs().amax((1, 2)) / 3).clamp_min(FLOOR)[:, None]
        return norm * (x.shape[-1] ** 0.5 * scale + 2.0**-10) + 1e-6


@dataclass(frozen=True)
class TQ3Values(_Decoded):
    """Values: codes [N, P, 3D/8] of the rotated rows on the page's affine grid, meta [N, 1, 2] (scale, minimum)."""

    @classmethod
    def reading(cls, s: Stored) -> TQ3Values | None:
        return cls() if s.dtype == torch.uint8 and s.meta_dtype == torch.float32 and s.meta_width == 2 else None

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return -3, 0

    def _grid(self, rotated: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        v, some = valid[..., None], valid.any(1)[:, None, None]
        low = torch.where(v, rotated, float("inf")).amin((1, 2), keepdim=True)
        high = torch.where(v, rotated, float("-inf")).amax((1, 2), keepdim=True)
        low, high = torch.where(some, low, 0.0), torch.where(some, high, 0.0)
        return ((high - low) / 7).clamp_min(FLOOR), low  # [N, 1, 1] each

    def encode_pages(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        rotated = fwht(x.float())
        scale, low = self._grid(rotated, valid)
        q = ((rotated - low) / scale).round_().clamp_(0, 7).masked_fill(~valid[..., None], 0).to(torch.uint8)
        return pack(q, 3), torch.cat([scale, low], -1)

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        """Codes [..., S, W] with their pages' (scale, minimum) [..., S / P, 2] -> rows [..., S, D]."""
        scale, low = meta.float().unsqueeze(-2).unbind(-1)  # [..., pages, 1] each
        rows = unpack(codes, 3).float().unflatten(-2, (meta.shape[-2], -1)) * scale[..., None] + low[..., None]
        return fwht(rows.flatten(-3, -2)).to(dtype)

    def row_bytes(self, head_dim: int) -> int:
        return 3 * head_dim // 8

    def page_meta_bytes(self, head_dim: int) -> int:
        return 8

    def error_bound(self, x: Tensor, valid: Tensor) -> Tensor:
        """[N, P] bound on each row's L2 error: half a step in each rotated channel, which the rotation keeps."""
        scale, _ = self._grid(fwht(x.float()), valid)
        return x.shape[-1] ** 0.5 * scale[..., 0] / 2 * (1 + 1e-5) + 1e-6
