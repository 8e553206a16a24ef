"""One layer's format pool as attention reads it: entries stored in a page format (``formats``; latent rows with
their basis, ``latent``; anchored rows with their sequence's tables, ``anchored``), decoded a tile of pages at a time
where they are read."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..signature import FORMAT_POOL
from . import anchored, cpu_native, latent
from .formats import codec_of
from .paging import gather_pages

_LAYOUT = tuple((i.field, i.per_layer) for i in FORMAT_POOL)  # each tensor's field, and whether it is per layer


class FormatPages(NamedTuple):
    """One layer's format pool (``kvcompile.cache``): codes and metadata of keys and values [N, P, W] and
    [N, P, M] ([N, 1, M] for a page-local codec), in the format ``formats.codec_of`` reads from them; positions
    [N, P], page table [B, Hkv, W'], lengths [B, Hkv]; ``basis``: the layer's latent basis [2, Hkv, 2D + 3, D] when
    the pool holds latent rows (``latent``), else None or empty; ``anchors`` [2, B, Hkv, 1 + A, D] and
    ``residuals`` [2, B, R, W] the layer's tables when it holds anchored rows (``anchored``), else None
    or empty. A head's entries live in its format pages and its model-dtype pages: attention reads both."""

    k: Tensor
    k_meta: Tensor
    v: Tensor
    v_meta: Tensor
    pos: Tensor
    table: Tensor
    lengths: Tensor
    basis: Tensor | None = None
    anchors: Tensor | None = None
    residuals: Tensor | None = None

    @classmethod
    def of_layer(cls, bundle: list[Tensor], layer: int) -> FormatPages:
        """Layer ``layer``'s view of the whole pool's bundle (``signature.FORMAT_POOL``: the attention ops' one
        format argument, read by name)."""
        parts = zip(_LAYOUT, bundle, strict=True)
        return cls(**{field: t[layer] if per_layer else t for (field, per_layer), t in parts})

    @property
    def empty(self) -> bool:
        """True when there is no format pool (a cache without a page format: a static shape, 0 pages)."""
        return self.k.shape[0] == 0

    def holds_entries(self) -> bool:
        """Whether any head holds an entry in the pool: a check of values, for eager code and opaque ops only (a
        prefill before the first compression attends to its model-dtype pages alone)."""
        return not self.empty and bool(self.lengths.any())

    @property
    def latent(self) -> bool:
        return self.basis is not None and self.basis.shape[0] > 0

    @property
    def anchored(self) -> bool:
        return self.anchors is not None and self.anchors.shape[0] > 0

    @property
    def decoded(self) -> bool:
        """Rows that decode against a table (``latent``, ``anchored``): read by the PyTorch path on every device."""
        return self.latent or self.anchored

    def triton_reads(self, head_dim: int) -> bool:
        """Whether the Triton decode reads this pool: each of its codecs says how (``triton_layout``); rows that
        decode against a table, or a codec without a layout, are read by the PyTorch path on every device."""
        if self.decoded:
            return False
        return all(hasattr(codec_of(codes, meta, head_dim), "triton_layout")
                   for codes, meta in ((self.k, self.k_meta), (self.v, self.v_meta)))

    def dense(self, head_dim: int, dtype: torch.dtype, pages: slice = slice(None)):
        """Decoded keys, values [B, Hkv, S, D], positions and valid [B, Hkv, S] of the page-table columns
        ``pages`` (S = their pages * P): a tile of the pool, decoded where it is read."""
        table = self.table[..., pages]
        pos = gather_pages(self.pos, table).long()
        k, v = (self.rows(i, table, pos, head_dim, dtype) for i in (0, 1))
        j = (pages.start or 0) * self.pos.shape[1] + torch.arange(k.shape[2], device=k.device)
        return k, v, pos, j < self.lengths.unsqueeze(-1)

    def rows(self, part: int, table: Tensor, pos: Tensor, head_dim: int, dtype=torch.float32) -> Tensor:
        """The decoded keys (``part`` 0) or values (1) [B, Hkv, S, D] of the pages ``table`` [B, Hkv, W'] lists, at
        their positions ``pos`` [B, Hkv, S] (latent keys are rotated to them)."""
        codes, meta = (self.k, self.k_meta) if part == 0 else (self.v, self.v_meta)
        codec = None if self.decoded else codec_of(codes, meta, head_dim)
        codes, meta = gather_pages(codes, table), gather_pages(meta, table)
        if self.anchored:
            return anchored.decode(codes, self.anchors[part], self.residuals[part], pos, part == 0).to(dtype)
        if codec is None:
            return latent.decode(codes, meta, self.basis[part], pos).to(dtype)
        return codec.decode(codes, meta, dtype)

    def scores(self, q: Tensor, table: Tensor, head_dim: int) -> Tensor:
        """q [B, Hkv, G, D] times the keys of the pages ``table`` lists: [B, Hkv, G, S], read from the codes."""
        if self.decoded:
            keys = self.rows(0, table, gather_pages(self.pos, table).long(), head_dim)
            return torch.matmul(q, keys.to(q.dtype).transpose(-1, -2))
        return codec_of(self.k, self.k_meta, head_dim).dot(q, gather_pages(self.k, table),
                                                            gather_pages(self.k_meta, table))

    def mix(self, p: Tensor, table: Tensor, head_dim: int) -> Tensor:
        """Weights p [B, Hkv, G, S] times the values of the pages ``table`` lists: [B, Hkv, G, D]; latent rows are
        summed in their basis and the sum mapped back (the basis applied after attention)."""
        codes, meta = gather_pages(self.v, table), gather_pages(self.v_meta, table)
        if self.anchored:
            return anchored.mix(p.float(), codes, self.anchors[1], self.residuals[1]).to(p.dtype)
        if self.latent:
            basis = self.basis[1].to(p.dtype)  # the weighted sum, then up and the mean (p's mass in this tile)
            mixed = torch.matmul(torch.matmul(p, latent.latent_rows(codes, meta, self.basis[1]).to(p.dtype)),
                                 basis[:, :head_dim])
            return mixed + p.sum(-1, keepdim=True) * basis[:, 2 * head_dim, None]
        return codec_of(self.v, self.v_meta, head_dim).mix(p, codes, meta)

    def native_attention(self, q: Tensor, head_dim: int, more: tuple = ()) -> tuple[Tensor, Tensor] | None:
        """Attention of q [B, Hkv, G, D] (scaled) over the whole pool in one pass, each row read in place
        (``cpu_native``): the output [B, Hkv, G, D] and its log-sum-exp [B, Hkv, G]; None where that does not
        serve this pool (then ``scores`` and ``mix`` do). ``more``: the head's other pools, in one softmax with it
        (``cpu_native.attend``)."""
        if self.decoded:
            return None
        keys = (codec_of(self.k, self.k_meta, head_dim), self.k, self.k_meta)
        values = (codec_of(self.v, self.v_meta, head_dim), self.v, self.v_meta)
        return cpu_native.attend(q, keys, values, self.table, self.lengths, more=more)
