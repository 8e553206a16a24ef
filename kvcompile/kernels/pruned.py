"""ThinK's key format (``formats.PrunedCodec``, registered there as "think"): rows that keep some of their channels,
and the list of which, per page. Its own module because, unlike every other codec, what it stores depends on a
choice the compression makes (``methods.think``) and hands to ``encode_pages``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..methods.think import ThinK
from .codec import Stored


@dataclass(frozen=True)
class PrunedCodec:
    """ThinK's keys: each row keeps only some of its channels, in ``dtype``; the page's metadata is the ascending
    list of those channels (int16 [N, 1, W]), the same for every page of a head. ``ratio`` (the share of channels
    dropped, ThinK's ``key_channel_compression_ratio``) sets how many are kept; which ones, the compression chooses
    per head from the queries (``methods.think``) and hands to ``encode_pages``. ``head_dim``: the full width a
    decode restores (``codec_of`` sets it from the stored tensors). Decoding puts zeros in the dropped channels, so
    attention over these pages is attention with those key channels zeroed; ``dot`` gathers the query's kept
    channels instead of writing the zeros."""

    ratio: float = 0.0
    head_dim: int = 0
    dtype: torch.dtype = torch.float32
    page_local = True
    window = ThinK.window  # observed queries the choice of channels reads

    @classmethod
    def reading(cls, s: Stored) -> PrunedCodec | None:
        """Rows in a float dtype with fewer channels than the head dim."""
        floats = (torch.float16, torch.bfloat16, torch.float32)
        return cls(head_dim=s.head_dim, dtype=s.dtype) if s.dtype in floats and s.width < s.head_dim else None

    def channels(self, obs) -> Tensor:
        """[B, Hkv, W] the channels each head keeps, ThinK's choice from one layer's observation."""
        return ThinK(self.ratio, self.window).channels(obs)

    def triton_layout(self, codes: Tensor, meta: Tensor, head_dim: int) -> tuple[int, int]:
        """How the Triton decode reads these rows: its ``_load_rows`` (BITS, GROUP) constants."""
        return -1, codes.shape[-1]

    def kept(self, head_dim: int) -> int:
        """Channels a row keeps: d - floor(d rho), as kvpress drops floor(d rho)."""
        return head_dim - math.floor(head_dim * self.ratio)

    def encode_pages(self, x: Tensor, valid: Tensor, channels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Pages x [N, P, D], keeping ``channels`` [N, W] of each page (ascending; default the first W, for pages
        that hold nothing); rows where ``valid`` [N, P] is False are stored as zeros."""
        N, P, D = x.shape
        if channels is None:
            channels = torch.arange(self.kept(D), device=x.device).expand(N, -1)
        codes = x.gather(-1, channels[:, None, :].long().expand(N, P, -1)).masked_fill(~valid[..., None], 0)
        return codes.to(self.dtype), channels.to(torch.int16)[:, None]

    def decode(self, codes: Tensor, meta: Tensor, dtype: torch.dtype) -> Tensor:
        """Codes [..., S, W] with their pages' channel lists [..., S / P, W] -> rows [..., S, D], zero in the
        channels a page dropped."""
        rows = codes.to(dtype).unflatten(-2, (meta.shape[-2], -1))  # [..., pages, P, W]
        out = rows.new_zeros(*rows.shape[:-1], self.head_dim)
        return out.scatter_(-1, meta.long().unsqueeze(-2).expand_as(rows), rows).flatten(-3, -2)

    def dot(self, q: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        """Per page, the query's kept channels times the page's codes: sum over kept i of q_i k_i."""
        rows = codes.to(q.dtype).unflatten(-2, (meta.shape[-2], -1))  # [..., pages, P, W]
        index = meta.long().unsqueeze(-2)  # [..., pages, 1, W]
        shape = (*torch.broadcast_shapes(q.shape[:-2], index.shape[:-3]), index.shape[-3], q.shape[-2])
        qk = q.unsqueeze(-3).expand(*shape, q.shape[-1]).gather(-1, index.expand(*shape, index.shape[-1]))
        return torch.matmul(qk, rows.transpose(-1, -2)).transpose(-3, -2).flatten(-2)  # [..., G, pages * P]

    def mix(self, p: Tensor, codes: Tensor, meta: Tensor) -> Tensor:
        return torch.matmul(p, self.decode(codes, meta, p.dtype))

    def row_bytes(self, head_dim: int) -> int:
        return self.kept(head_dim) * torch.finfo(self.dtype).bits // 8

    def page_meta_bytes(self, head_dim: int) -> int:
        return 2 * self.kept(head_dim)
