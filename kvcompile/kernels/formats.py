"""Page formats: how a stored token row of K or V is encoded, and what it costs.

A format is a pair of row codecs (keys, values). A codec turns fp32 rows [..., D] into ``codes`` [..., W] and
``meta`` [..., M] (scales, zero points) and back. Most are row-local (a row decodes from its own bytes), so
compaction moves rows as plain bytes and re-encoding a decoded row gives it back; a page-local codec
(``ChannelCodec``) keeps one metadata row per page and encodes whole pages. The stored tensors say which
codec made them (``codec_of``: dtype and widths), so the programs need no format argument and serve every format.

Codecs (D = head dim, G = group size along D):

    fp16, bf16   the row cast, no metadata
    fp8          float8 e4m3 codes, one fp32 scale per row (amax / 448): per token and head
    int8..int2   asymmetric uniform codes per group of G channels (fp16 scale and minimum per group), packed
                 along D: int4 split halves (byte j = channels j and j + D/2), int2 four planes, int3 a 2-bit
                 plane then a 1-bit plane (3D/8 bytes)
    kivi4/kivi2  KIVI: keys per channel over the P rows of a page (page-local metadata), values as int4/int2
    think        ThinK: keys keep D - floor(D rho) channels, listed per page (``pruned``); values fp32
    tq3          Minima-KV: rows rotated (Hadamard), 3-bit codes, one grid per page (``tq3``)

Quantization runs in PyTorch (the Triton interpreter's fp32 -> fp8 cast is wrong for a few percent of values) and
float8 codes are only cast, never computed on (CPU float8 has no arithmetic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .packing import fp8_values, pack, unpack
from .pruned import PrunedCodec
from .tq3 import TQ3Keys, TQ3Values

SCALE_FLOOR = 2.0**-20  # smallest fp16 scale kept: a constant group decodes to its minimum
FP8_MAX = 448.0  # largest finite float8 e4m3fn


class Codec:
    """What attention asks of every codec: the scores of queries against stored rows and the probability-weighted
    sum of stored rows, read from the codes. By default a codec decodes the rows (one tile at a time) and multiplies;
    a codec whose decoding is affine per row group (``IntCodec``, ``Fp8Codec``) folds its scales into the product
    instead, so the decoded rows are never written."""

    def dot(self, q: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """q [..., G, D] times the decoded rows [..., S, D], transposed: [..., G, S] in q's dtype."""
        return torch.matmul(q, self.decode(codes, meta, q.dtype).transpose(-1, -2))

    def mix(self, p: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """Weights p [..., G, S] times the decoded rows [..., S, D]: [..., G, D] in p's dtype."""
        return torch.matmul(p, self.decode(codes, meta, p.dtype))


class RowCodec(Codec):
    """A row-local codec: every row carries its own metadata, so rows move between pages as bytes."""

    page_local = False

    def page_meta_bytes(self, head_dim: int) -> int:
        return 0


@dataclass(frozen=True)
class FloatCodec(RowCodec):
    """Rows cast to a narrower float dtype (no metadata)."""

    dtype: torch.dtype

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.to(self.dtype), x.new_zeros(*x.shape[:-1], 0, dtype=torch.float32)

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        return codes.to(dtype)

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * torch.finfo(self.dtype).bits // 8

    def error_bound(self, x: Tensor) -> Tensor:
        """Round to nearest: half an ulp of the narrower dtype (relative), or half its smallest subnormal."""
        info = torch.finfo(self.dtype)
        return x.abs() * info.eps / 2 + info.smallest_normal * info.eps / 2


@dataclass(frozen=True)
class Fp8Codec(RowCodec):
    """float8 e4m3fn codes with one fp32 scale per row (the row's absolute max maps to 448)."""

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-30)
        return (x.float() / scale).to(torch.float8_e4m3fn), scale

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        return (fp8_values(codes, torch.float32) * meta).to(dtype)

    def dot(self, q: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        return torch.matmul(q, fp8_values(codes, q.dtype).transpose(-1, -2)) * meta.to(q.dtype).transpose(-1, -2)

    def mix(self, p: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        return torch.matmul(p * meta.to(p.dtype).transpose(-1, -2), fp8_values(codes, p.dtype))

    def row_bytes(self, head_dim: int) -> int:
        return head_dim + 4

    def error_bound(self, x: Tensor) -> Tensor:
        """3 mantissa bits: 2^-4 of |x| in the normal range; below 2^-6 (times the scale), half the subnormal step
        2^-9."""
        scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-30)
        return x.abs() * 2.0**-4 + scale * 2.0**-10


@dataclass(frozen=True)
class IntCodec(RowCodec):
    """Asymmetric ``bits``-bit codes per group of ``group`` channels (the whole row when it is shorter), fp16
    scale and minimum per group."""

    bits: int
    group: int

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
        return (by_group.unflatten(-2, (n, G)) * blocks[:, None]).sum(-3) + torch.matmul(p, low.transpose(-1, -2)) @ blocks

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


def encode_pool(codec, pages: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Codes and metadata of whole pages [N, P, D] (``valid`` [N, P]: the rows that hold tokens; default all),
    for a row-local or a page-local codec."""
    if codec.page_local:
        return codec.encode_pages(pages, torch.ones(pages.shape[:2], dtype=torch.bool, device=pages.device)
                                  if valid is None else valid)
    return codec.encode(pages)


@dataclass(frozen=True)
class PageFormat:
    """A named pair of codecs (keys, values). ``version`` moves with the codecs' behaviour."""

    name: str
    key: object
    value: object
    version: int = 1

    def page_bytes(self, head_dim: int, page_size: int) -> int:
        """Bytes of K plus V of one page of ``page_size`` stored tokens: codes, scales and zero points."""
        rows = page_size * (self.key.row_bytes(head_dim) + self.value.row_bytes(head_dim))
        return rows + self.key.page_meta_bytes(head_dim) + self.value.page_meta_bytes(head_dim)

    def token_bytes(self, head_dim: int, page_size: int = 1) -> float:
        """Bytes of K plus V of one stored token, a page's metadata shared by its ``page_size`` tokens."""
        return self.page_bytes(head_dim, page_size) / page_size


_INT = {bits: IntCodec(bits, 32) for bits in (4, 3, 2)} | {8: IntCodec(8, 64)}
FORMATS: dict[str, PageFormat] = {f.name: f for f in (
    PageFormat("fp16", FloatCodec(torch.float16), FloatCodec(torch.float16)),
    PageFormat("bf16", FloatCodec(torch.bfloat16), FloatCodec(torch.bfloat16)),
    PageFormat("fp8", Fp8Codec(), Fp8Codec()),
    *(PageFormat(f"int{b}", _INT[b], _INT[b]) for b in (8, 4, 3, 2)),
    PageFormat("k8v4", _INT[8], _INT[4]),  # keys need more bits than values (research/formats.md, vLLM k8v4)
    PageFormat("kivi4", ChannelCodec(4), _INT[4]),  # KIVI: keys per channel over a page, values per token
    PageFormat("kivi2", ChannelCodec(2), _INT[2]),
    PageFormat("think", PrunedCodec(0.5), FloatCodec(torch.float32)),  # ThinK at rho = 0.5, values unchanged
    PageFormat("tq3", TQ3Keys(), TQ3Values()),  # Minima-KV's packed 3-bit pages
)}


def get_format(name: str) -> PageFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown page format {name!r}; formats: {', '.join(FORMATS)}")
    return FORMATS[name]


def codec_of(codes: Tensor, meta: Tensor, head_dim: int):
    """The codec that wrote ``codes`` [..., W] and ``meta`` [..., M], read from their dtypes and widths."""
    return _codec(codes.dtype, codes.shape[-1], meta.shape[-1], head_dim, meta.dtype)


@functools.cache
def _codec(dtype: torch.dtype, width: int, meta_width: int, head_dim: int, meta_dtype: torch.dtype):
    if meta_dtype == torch.float32 and dtype == torch.uint8:  # TQ3's page scales
        return TQ3Keys() if meta_width == 1 else TQ3Values()
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return PrunedCodec(head_dim=head_dim, dtype=dtype) if width < head_dim else FloatCodec(dtype)
    if dtype == torch.float8_e4m3fn:
        return Fp8Codec()
    bits, groups = 8 * width // head_dim, meta_width // 2
    return ChannelCodec(bits) if groups == head_dim else IntCodec(bits, head_dim // groups)
