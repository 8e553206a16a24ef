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
    rot2..rot4   rows rotated (random signs, Hadamard), Gaussian Lloyd-Max levels, an fp16 scale per row
                 (``rotated``); rotk3v2, rotk4v2: keys at 3 or 4 bits, values at 2
    spectra4..2  SPECTRA: rows in a per-head latent basis calibrated per model, bits per channel group by energy
                 (``latent``; int4..int2's bytes: codes of 4..2 bits a channel on average, fp16 scale and minimum
                 per group of 32); the basis is the cache's (``fmt_basis``), so ``codec_of`` never names it
    saki4        SAKI: keys in SAKI's score-preserving basis (bits by score error), values as int4 (``latent``)
    anchor2      AnchorKV: a row is its nearest anchor scaled plus, where compression refined it, a 2-bit residual;
                 anchors and residuals live in the sequence's tables (``anchored``), which only compression writes

Quantization runs in PyTorch (the Triton interpreter's fp32 -> fp8 cast is wrong for a few percent of values) and
float8 codes are only cast, never computed on (CPU float8 has no arithmetic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from . import latent
from .anchored import AnchorCodec
from .codec import RowCodec, Stored
from .integer import ChannelCodec, IntCodec
from .latent import LatentCodec
from .packing import fp8_values
from .pruned import PrunedCodec
from .rotated import RotatedCodec
from .tq3 import TQ3Keys, TQ3Values

FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclass(frozen=True)
class FloatCodec(RowCodec):
    """Rows cast to a narrower float dtype (no metadata)."""

    dtype: torch.dtype

    @classmethod
    def reading(cls, s: Stored) -> FloatCodec | None:
        """Whole rows in a float dtype (fewer channels: ``PrunedCodec``)."""
        floats = (torch.float16, torch.bfloat16, torch.float32)
        return cls(s.dtype) if s.dtype in floats and s.width == s.head_dim else None

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.to(self.dtype), x.new_zeros(*x.shape[:-1], 0, dtype=torch.float32)

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return 0, 0

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

    @classmethod
    def reading(cls, s: Stored) -> Fp8Codec | None:
        return cls() if s.dtype == torch.float8_e4m3fn else None

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return 0, 1

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

    @property
    def window(self) -> int:
        """Observed queries per layer that encoding these pages reads (choosing key channels, anchors): 0 for a
        codec that reads rows alone."""
        return max(getattr(self.key, "window", 0), getattr(self.value, "window", 0))

    @property
    def prunes_keys(self) -> bool:
        """Keys keep channels chosen per head at compression (``key_channels``)."""
        return isinstance(self.key, PrunedCodec)

    def key_channels(self, obs) -> Tensor:
        """[B, Hkv, W] the channels each head's keys keep, chosen from one layer's observation."""
        return self.key.channels(obs)

    @property
    def latent(self) -> bool:
        """Rows stored in a per-model basis the cache holds (SPECTRA): the format needs a calibration."""
        return isinstance(self.key, LatentCodec)

    @property
    def anchored(self) -> bool:
        """Rows decoded against their sequence's anchors (AnchorKV): compression encodes them (``anchoring``)."""
        return isinstance(self.key, AnchorCodec)

    @property
    def decoded(self) -> bool:
        """Rows that decode against a table the cache holds (``latent``, ``anchored``): the PyTorch path reads them
        on every device, no kernel does (as ``FormatPages.decoded``)."""
        return self.latent or self.anchored

    @property
    def triton_reads(self) -> bool:
        """Whether the Triton decode reads these pages: each codec says how (``triton_layout``)."""
        return all(hasattr(c, "triton_layout") for c in (self.key, self.value))

    def token_bytes(self, head_dim: int, page_size: int = 1) -> float:
        """Bytes of K plus V of one stored token, a page's metadata shared by its ``page_size`` tokens."""
        return self.page_bytes(head_dim, page_size) / page_size


_INT = {bits: IntCodec(bits, 32) for bits in (4, 3, 2)} | {8: IntCodec(8, 64)}
FORMATS: dict[str, PageFormat] = {f.name: f for f in (
    PageFormat("fp16", FloatCodec(torch.float16), FloatCodec(torch.float16)),
    PageFormat("bf16", FloatCodec(torch.bfloat16), FloatCodec(torch.bfloat16)),
    PageFormat("fp8", Fp8Codec(), Fp8Codec()),
    *(PageFormat(f"int{b}", _INT[b], _INT[b]) for b in (8, 4, 3, 2)),
    PageFormat("k8v4", _INT[8], _INT[4]),  # keys need more bits than values (vLLM's k8v4)
    PageFormat("kivi4", ChannelCodec(4), _INT[4]),  # KIVI: keys per channel over a page, values per token
    PageFormat("kivi2", ChannelCodec(2), _INT[2]),
    PageFormat("think", PrunedCodec(0.5), FloatCodec(torch.float32)),  # ThinK at rho = 0.5, values unchanged
    PageFormat("tq3", TQ3Keys(), TQ3Values()),  # Minima-KV's packed 3-bit pages
    *(PageFormat(f"rot{b}", RotatedCodec(b), RotatedCodec(b)) for b in (2, 3, 4)),  # Hadamard, Gaussian levels
    *(PageFormat(f"rotk{b}v2", RotatedCodec(b), RotatedCodec(2)) for b in (3, 4)),  # keys rank, values are mixed
    *(PageFormat(f"spectra{b}", LatentCodec(b, 32, rotary=True), LatentCodec(b, 32)) for b in (4, 3, 2)),
    PageFormat("saki4", LatentCodec(4, 32, rotary=True, basis="saki"), LatentCodec(4, 32, basis="identity")),
    PageFormat("anchor2", AnchorCodec(), AnchorCodec()),
)}


def get_format(name: str) -> PageFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown page format {name!r}; formats: {', '.join(FORMATS)}")
    return FORMATS[name]


def latent_basis(page_format: str | None, moments, rotary, head_dim: int) -> Tensor | None:
    """The model's basis for a SPECTRA format (``latent.model_basis``) from its calibration ``moments``; None for
    any other format."""
    fmt = None if page_format is None else get_format(page_format)
    if fmt is None or not fmt.latent:
        return None
    if moments is None:
        raise ValueError(f"{page_format} pages are stored in a basis calibrated for the model; build the model with "
                         "kvcompile.apply, which calibrates it")
    return latent.model_basis((fmt.key, fmt.value), moments, rotary, head_dim)


def codec_of(codes: Tensor, meta: Tensor, head_dim: int):
    """The codec that wrote ``codes`` [..., W] and ``meta`` [..., M], read from their dtypes and widths."""
    return _codec(codes.dtype, codes.shape[-1], meta.shape[-1], head_dim, meta.dtype)


@functools.cache
def _codec(dtype: torch.dtype, width: int, meta_width: int, head_dim: int, meta_dtype: torch.dtype):
    stored = Stored(dtype, width, meta_width, meta_dtype, head_dim)
    found = [codec for cls in _codec_classes() if (codec := getattr(cls, "reading", _none)(stored)) is not None]
    if len(found) != 1:
        raise ValueError(f"{len(found)} codecs read rows stored as {stored} (one must): {found}")
    return found[0]


def _none(stored: Stored) -> None:
    return None


@functools.cache
def _codec_classes() -> tuple[type, ...]:
    """Every codec class a registered format uses."""
    return tuple(dict.fromkeys(type(c) for f in FORMATS.values() for c in (f.key, f.value)))
