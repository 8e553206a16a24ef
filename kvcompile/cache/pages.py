"""The page pool of the paged cache: owning pages ahead of use, giving them back, packing and shrinking the pool.

Pages are owned ahead of use (``reserve``), so a decode step only computes pool rows from lengths. A reservation
packs the pool (each head's pages consecutive, heads in (layer, row, head) order), so where every head owns as
many pages as the page table is wide, a decode step reads a layer as one slice of the pool (``packed``). Every
page nobody owns is zero (``_renumber`` zeroes them), part of the isolation the cache guarantees.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

MIN_WIDTH = 2  # page-table width floor: a dimension of size 1 would make a compiled program specialise on it


class PagePool:
    """Page bookkeeping of ``PagedKVCache`` (mixed into it): ``k_pages``, ``v_pages``, ``page_pos``, ``page_lw``,
    ``page_table``, ``n_pages`` and ``room`` are the cache's own."""

    def reserve(self, n_tokens: int | Tensor, growth: float = 1.5) -> None:
        """Own enough pages that every head of row b can take ``n_tokens[b]`` more tokens, then pack the pool (one
        copy of the owned pages); a full pool grows to ``growth`` times its size (or what is needed)."""
        n = torch.as_tensor(n_tokens, device=self.device).long().expand(self.batch_size)
        want = (self.lengths.long() + n[None, :, None] + self.page_size - 1) // self.page_size
        need = (want - self.n_pages).clamp_min(0)
        if bool(need.any()):
            self._widen(int(want.max()))
            self.n_pages += need  # the new pages point at page 0 until _renumber gives them pages of their own
            used, capacity = 1 + int(self.n_pages.sum()), self.k_pages.shape[0]
            self._renumber(capacity if used <= capacity else max(used, int(capacity * growth)))
        self.room = max(self.room, int(n.min()))
        self._note()

    def provision(self, capacity: int, width: int) -> None:
        """Make the pool exactly ``capacity`` pages (scratch included; at least what heads own) and the page table
        ``width`` wide: what a decode-time cap sizes once, so decode shapes stay put."""
        self._renumber(max(capacity, 1 + int(self.n_pages.sum())))
        self._widen(width)
        self._note()

    def release_unused(self) -> None:
        """Give up every page past each head's length; the next ``reserve`` or ``trim`` reclaims them."""
        self.n_pages = self.pages_held()
        self.page_table = self.page_table.masked_fill(~self._owned(), 0)
        self.page_table = self.page_table[..., : max(int(self.n_pages.max()), MIN_WIDTH)].contiguous()
        self.room = 0

    def trim(self, spare_pages: int = 0) -> None:
        """Shrink the pool to the pages heads own plus ``spare_pages``, renumbering pages. Frees real memory."""
        capacity = 1 + int(self.n_pages.sum()) + spare_pages
        if capacity < self.k_pages.shape[0]:
            self._renumber(capacity)

    def pack(self) -> None:
        """Renumber pages so that each head's pages are consecutive, heads in (layer, row, head) order (what a
        reservation does); free when already packed."""
        ids = self.page_table[self._owned()]
        if not torch.equal(ids, torch.arange(1, ids.numel() + 1, dtype=ids.dtype, device=self.device)):
            self._renumber(self.k_pages.shape[0])

    def packed(self) -> bool:
        """True when the page table is the run 1, 2, 3, ... : every head owning as many pages as the table is wide,
        heads in (layer, row, head) order (a reservation packs the pool). Layer l's heads then hold pool pages
        ``1 + l*n ... (l+1)*n`` (n = B*Hkv*width), which a packed decode program reads in place. Checked once per
        page-table change, not per step."""
        table = self.page_table
        ref, version, answer = self._packed_for
        if ref() is not table or version != table._version:
            n = table.numel()
            run = torch.arange(1, n + 1, dtype=table.dtype, device=table.device)
            answer = n < self.k_pages.shape[0] and torch.equal(table.reshape(-1), run)
            self._packed_for = (weakref.ref(table), table._version, answer)
        return answer

    def row_pools(self) -> tuple[str, ...]:
        """The pools that hold one row per token and move together: keys, values, positions, and log-weights in a
        ``weighted`` cache."""
        return ("k_pages", "v_pages", "page_pos") + (("page_lw",) if self.weighted else ())

    def _widen(self, width: int) -> None:
        """Widen the page table to ``width`` pages (new slots point at the scratch page 0)."""
        if width > self.page_table.shape[-1]:
            self.page_table = nn.functional.pad(self.page_table, (0, width - self.page_table.shape[-1]))

    def _owned(self) -> Tensor:
        """[L, B, Hkv, W] True at the page-table slots of pages a head owns."""
        return torch.arange(self.page_table.shape[-1], device=self.device) < self.n_pages[..., None]

    def _renumber(self, capacity: int) -> None:
        """Make the pool ``capacity`` pages with the owned pages at 1, 2, ... in (layer, row, head, page) order, in
        new storage (the old pool is released); every page nobody owns is zero."""
        owned = self._owned()
        keep = torch.cat([self.page_table.new_zeros(1), self.page_table[owned]]).long()  # scratch page, then owned
        n = keep.numel() - 1
        for name in self.row_pools():
            pool = getattr(self, name)
            new = pool.new_empty(capacity, *pool.shape[1:])
            torch.index_select(pool, 0, keep, out=new[: n + 1])  # one read and one write of what heads own
            new[n + 1 :] = 0
            setattr(self, name, new)
        new_ids = torch.arange(1, n + 1, dtype=torch.int32, device=self.device)
        self.page_table = torch.zeros_like(self.page_table).masked_scatter_(owned, new_ids)
