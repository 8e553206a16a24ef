"""The codec contract: what attention and the cache ask of a row codec (``formats``), and the default that decodes
a tile and multiplies."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Stored(NamedTuple):
    """What stored tensors say of the codec that wrote them: codes' dtype and width, metadata's width and dtype, and
    the rows' head dim. Every codec class answers ``reading(stored)`` with itself, configured, or None: no two
    codecs store alike, so the programs need no format argument (``formats.codec_of``)."""

    dtype: torch.dtype
    width: int
    meta_width: int
    meta_dtype: torch.dtype
    head_dim: int


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
    exact_reencode = True  # a decoded row encodes back to the same bytes (a scale read from the row's range)

    def page_meta_bytes(self, head_dim: int) -> int:
        return 0
