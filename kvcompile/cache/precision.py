"""Which entries a format recipe keeps in the model's dtype: each row's newest tokens (``precise_recent``) and, with
``precise_anchors``, every few pages of positions (anchor pages), read from the positions the cache
holds; the rest live in the page format (``formatted``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import reference


def precise_positions(pos: Tensor, seen: Tensor, window: int, anchors: int, page_size: int) -> Tensor:
    """True at the positions ``pos`` (-1: no entry) a format recipe keeps in the model's dtype once their row has read
    ``seen`` tokens (broadcast against ``pos``): the ``window`` newest and, with ``anchors``, those of every
    ``anchors``-th page of ``page_size`` positions from 0 (anchor pages)."""
    keep = (pos >= 0) & (pos >= seen - window) if window else torch.zeros_like(pos, dtype=torch.bool)
    return keep | (pos >= 0) & ((pos // page_size) % anchors == 0) if anchors else keep


class PrecisePositions:
    """Position queries of ``PagedKVCache`` over both pools (mixed into it through ``FormatPool``)."""

    def positions(self) -> Tensor:
        """[L, B, Hkv, S] the original position of every entry each head holds, in its logical order, -1 past its
        ``held`` entries (S the longest head, at least 1): read from the position pages alone (no key or value is
        gathered or decoded, which matters to a demotion while decoding)."""
        P, n_f, n = self.page_size, self.fmt_lengths.long()[..., None], self.held().long()[..., None]
        j = torch.arange(max(int(n.max()), 1), device=self.device)
        pos = self.page_pos.reshape(-1)[reference.rows_of(self.page_table, (j - n_f).clamp_min(0), P)].long()
        if self.format_used:
            stored = self.fmt_pos.reshape(-1)[reference.rows_of(self.fmt_table, j.expand_as(pos), P)].long()
            pos = torch.where(j < n_f, stored, pos)
        return pos.masked_fill(j >= n, -1)

    def newest(self, window: int) -> Tensor:
        """[L, B, Hkv, S] True at the entries among each row's ``window`` newest positions (none for 0), S the
        longest head."""
        if not window:
            return torch.zeros(*self.lengths.shape, 1, dtype=torch.bool, device=self.device)
        pos = self.positions()
        return (pos >= 0) & (pos >= (self.seen - window)[None, :, None, None])

    def precise(self, window: int, anchors: int = 0, seen: Tensor | None = None) -> Tensor:
        """[L, B, Hkv, S] True at the entries a format recipe keeps in the model's dtype (``precise_positions``), as
        of each row having read ``seen`` [B] tokens (default: what it has read)."""
        if not (window or anchors):
            return self.newest(0)
        seen = self.seen if seen is None else seen
        return precise_positions(self.positions(), seen[None, :, None, None], window, anchors, self.page_size)

    def counts_after(self, window: int, anchors: int, seen: Tensor, fresh: bool = False) -> tuple[Tensor, Tensor]:
        """([L, B, Hkv] entries held, those of them ``precise`` marks) once each row has read ``seen`` [B] tokens,
        before anything is compressed: the entries held now (none when ``fresh``: the cache is about to start again)
        and one per position a prefill up to ``seen`` would append. What a prefill is checked against before it
        writes anything."""
        start = torch.zeros_like(seen) if fresh else self.seen
        pos = start[:, None] + torch.arange(int((seen - start).max()), device=self.device)
        new = pos.masked_fill(pos >= seen[:, None], -1)
        widen = lambda n: n[None, :, None].expand(self.num_layers, -1, self.num_kv_heads)  # noqa: E731
        held, precise = widen((new >= 0).sum(-1)), widen(precise_positions(new, seen[:, None], window, anchors,
                                                                            self.page_size).sum(-1))
        if fresh:
            return held, precise
        return held + self.held(), precise + self.precise(window, anchors, seen).sum(-1)
