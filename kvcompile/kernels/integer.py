"""Integer codes: asymmetric uniform codes per group of channels of a row (``IntCodec``: int8..int2) and per channel
over the rows of a page (``ChannelCodec``: KIVI's keys), packed along the channels (``packing``). Registered as
formats in ``formats``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .codec import Codec, RowCodec, Stored
from .packing import pack, unpack

SCALE_FLOOR = 2.0**-20  # smallest fp16 scale kept: a constant group decodes to its minimum


@dataclass(frozen=True)
class IntCodec(RowCodec):
    """Asymmetric ``bits``-bit codes per group of ``group`` channels (the whole row when it is shorter), fp16
    scale and minimum per group."""

    bits: int
    group: int

    @classmethod
    def reading(cls, s: Stored) -> IntCodec | None:
        """uint8 codes with an fp16 scale and minimum per group of channels (per channel over a page:
        ``ChannelCodec``)."""
        groups = s.meta_width // 2
        if s.dtype != torch.uint8 or s.meta_dtype != torch.float16 or s.meta_width % 2 or not 0 < groups < s.head_dim:
            return None
        return cls(8 * s.width // s.head_dim, s.head_dim // groups)

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return self.bits, head_dim // (meta.shape[-1] // 2)

    def _groups(self, head_dim: int) -> int:
        group = min(self.group, head_dim)
        if head_dim % group or head_dim % 8:
            raise ValueError(f"int{self.bits} pages need a head dim divisible by 8 and by the group size "
                             f"{group}, got {head_dim}")
        return head_dim // group

    def _scale_and_min(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """fp32 groups [..., D/G, G], and their fp16 scale and minimum [..., D/G]."""
        n = self._groups(x.shape[-1])
        g = x.float().unflatten(-1, (n, x.shape[-1] // n))
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / (2**self.bits - 1)).clamp_min(SCALE_FLOOR)
        return g, scale.half(), low.half()

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        g, scale, low = self._scale_and_min(x)
        q = ((g - low.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, 2**self.bits - 1)
        return pack(q.to(torch.uint8).flatten(-2), self.bits), torch.stack([scale, low], -1).flatten(-2)

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        q = unpack(codes, self.bits).unflatten(-1, (meta.shape[-1] // 2, -1)).float()
        scale, low = meta.float().unflatten(-1, (-1, 2)).unbind(-1)
        return (q * scale[..., None] + low[..., None]).flatten(-2).to(dtype)

    def dot(self, q: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """Per group i: scale_i times q_i . codes_i, plus minimum_i times the sum of q_i. One product for all groups:
        the query is laid out block-diagonally, a row per (group, query), so the codes are read whole."""
        c, scale, low, blocks = self._columns(codes, meta, q.dtype)
        n, G = blocks.shape[0], q.shape[-2]
        by_group = torch.matmul((q.unsqueeze(-3) * blocks[:, None]).flatten(-3, -2), c.transpose(-1, -2))
        return (by_group.unflatten(-2, (n, G)) * scale.unsqueeze(-2)).sum(-3) + q @ blocks.T @ low  # group sums

    def mix(self, p: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """Per group i: (p times scale_i) . codes_i, plus p . minimum_i, on the group's channels; one product
        for all groups (a row of weights per (group, query)), of which each channel keeps its group's row."""
        c, scale, low, blocks = self._columns(codes, meta, p.dtype)
        n, G = blocks.shape[0], p.shape[-2]
        by_group = torch.matmul((p.unsqueeze(-3) * scale.unsqueeze(-2)).flatten(-3, -2), c)
        return ((by_group.unflatten(-2, (n, G)) * blocks[:, None]).sum(-3)
                + torch.matmul(p, low.transpose(-1, -2)) @ blocks)

    def _columns(self, codes: Tensor, meta: Tensor, dtype: torch.dtype):
        """Codes as ``dtype`` [..., S, D]; each group's scale and minimum [..., n, S]; and which channels each group
        holds, a 0/1 matrix [n, D]."""
        c, n = unpack(codes, self.bits).to(dtype), meta.shape[-1] // 2
        scale, low = (x.transpose(-1, -2).contiguous() for x in meta.to(dtype).unflatten(-1, (n, 2)).unbind(-1))
        return c, scale, low, _group_channels(c.shape[-1], n, dtype, c.device)

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8 + 4 * self._groups(head_dim)

    def error_bound(self, x: Tensor) -> Tensor:
        """Half a (rounded) step, plus what rounding the scale and minimum to fp16 moves the grid by."""
        g, scale16, low16 = self._scale_and_min(x)
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / (2**self.bits - 1)).clamp_min(SCALE_FLOOR)
        shift = (low - low16.float()).abs() + (2**self.bits - 1) * (scale - scale16.float()).abs()
        bound = 0.5 * scale16.float() + shift + 2.0**-20 * g.abs().amax(-1)
        return bound[..., None].expand_as(g).flatten(-2)


@functools.cache
def _group_channels(head_dim: int, groups: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[groups, D] 0/1: which channels each of ``groups`` equal groups holds (built once, not at every tile)."""
    return torch.eye(groups, dtype=dtype, device=device).repeat_interleave(head_dim // groups, 1)


@dataclass(frozen=True)
class ChannelCodec(Codec):
    """KIVI's keys: asymmetric ``bits``-bit codes per channel over the rows of one page (fp16 scale and minimum per
    channel and page: ``meta`` [N, 1, 2D]), so an outlier channel gets a grid of its own. Page-local: a page is
    encoded whole (``encode_pages``), and entries that move to another page are decoded and encoded again."""

    bits: int
    page_local = True

    @classmethod
    def reading(cls, s: Stored) -> ChannelCodec | None:
        if s.dtype != torch.uint8 or s.meta_dtype != torch.float16 or s.meta_width != 2 * s.head_dim:
            return None
        return cls(8 * s.width // s.head_dim)

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return self.bits, -1

    def encode_pages(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Pages x [N, P, D] (rows where ``valid`` [N, P] is False are ignored and stored as zeros)."""
        scale, low = self._scale_and_min(x, valid)
        q = ((x.float() - low.float()[:, None]) / scale.float()[:, None]).round_().clamp_(0, 2**self.bits - 1)
        q = q.masked_fill(~valid[..., None], 0).to(torch.uint8)
        return pack(q, self.bits), torch.stack([scale, low], -1).flatten(-2)[:, None]

    def _grid(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 step and minimum [N, D] of each page's valid rows (an empty page: the step floor, minimum 0)."""
        v, some = valid[..., None], valid.any(1, keepdim=True)
        low = torch.where(some, torch.where(v, x.float(), float("inf")).amin(1), 0.0)
        high = torch.where(some, torch.where(v, x.float(), float("-inf")).amax(1), 0.0)
        return ((high - low) / (2**self.bits - 1)).clamp_min(SCALE_FLOOR), low

    def _scale_and_min(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """The grid as stored: fp16 scale and minimum [N, D]."""
        scale, low = self._grid(x, valid)
        return scale.half(), low.half()

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        """Codes [..., S, W] with their pages' metadata [..., S / P, 2D] (broadcast over each page) or [..., S, 2D]."""
        scale, low = (x.unsqueeze(-2) for x in meta.float().unflatten(-1, (-1, 2)).unbind(-1))  # [..., pages, 1, D]
        rows = unpack(codes, self.bits).float().unflatten(-2, (meta.shape[-2], -1))  # [..., pages, rows, D]
        return (rows * scale + low).flatten(-3, -2).to(dtype)

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def page_meta_bytes(self, head_dim: int) -> int:
        return 4 * head_dim

    def error_bound(self, x: Tensor, valid: Tensor) -> Tensor:
        """Half a (rounded) step of the row's channel in its page, plus the fp16 rounding of the grid."""
        scale, low = self._grid(x, valid)
        scale16, low16 = scale.half(), low.half()
        shift = (low - low16.float()).abs() + (2**self.bits - 1) * (scale - scale16.float()).abs()
        return (0.5 * scale16.float() + shift + 2.0**-20 * x.abs().amax(1))[:, None].expand_as(x)
