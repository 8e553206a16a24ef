"""The ragged per-head paged KV cache.

Layout (shape letters: L layers, B batch rows, Hkv KV heads, P page size, D head dim)::

    k_pages, v_pages : [N_pages, P, D]        one pool for all layers; a page holds P tokens of ONE (layer, b, h)
    page_pos         : [N_pages, P] int32     original sequence position of each stored token
    page_table       : [L, B, Hkv, MAXP] int32  logical page i of head (l, b, h) -> physical page
    lengths          : [L, B, Hkv] int32      tokens head (l, b, h) holds
    obs_q            : [L, B, Hq, W, D]       the last W queries of each layer, a ring: query at position p sits in
                                              slot p mod W (what window scorers and decode policies read)

Token j of head (l, b, h) sits at row j % P of page ``page_table[l, b, h, j // P]``; see
``kvcompile.kernels.reference`` for the loop that rebuilds dense keys from this. Page 0 is scratch: padding
tokens are written there and never read, so writes keep static shapes and no head ever stores a pad.

Pages are allocated ahead of use (``reserve``), so a decode step only computes row indices from lengths: O(heads),
no allocation, no copy, static shapes. A reservation packs the pool (each head's pages consecutive, heads in order),
so where every head is equally long a decode step reads a layer as one slice of the pool (``packed``).
Compression compacts kept tokens to the front of each head's own pages and gives up the pages past the new length
(``release_unused``); ``trim`` then shrinks the pool tensors themselves so the process really holds only what is
in use. The page format (dtype here) is a property of the pool alone.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from .kernels import reference


class PagedKVCache(nn.Module):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        page_size: int = 16,
        obs_window: int = 0,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_layers, self.num_kv_heads, self.num_q_heads = num_layers, num_kv_heads, num_q_heads
        self.head_dim, self.page_size, self.obs_window, self.dtype = head_dim, page_size, obs_window, dtype
        self.batch_size = 0
        self._packed, self._packed_for = False, (lambda: None, -1)  # ``packed()``'s answer, and for which table
        dev = torch.device(device)
        L, Hkv, P, D = num_layers, num_kv_heads, page_size, head_dim
        self.register_buffer("k_pages", torch.zeros(1, P, D, dtype=dtype, device=dev))
        self.register_buffer("v_pages", torch.zeros(1, P, D, dtype=dtype, device=dev))
        self.register_buffer("page_pos", torch.zeros(1, P, dtype=torch.int32, device=dev))
        self.register_buffer("page_table", torch.zeros(L, 0, Hkv, 1, dtype=torch.int32, device=dev))
        self.register_buffer("lengths", torch.zeros(L, 0, Hkv, dtype=torch.int32, device=dev))
        self.register_buffer("n_pages", torch.zeros(L, 0, Hkv, dtype=torch.int64, device=dev))  # pages owned
        self.register_buffer("obs_q", torch.zeros(L, 0, num_q_heads, obs_window, D, dtype=dtype, device=dev))
        self.register_buffer("obs_pos", torch.full((0, obs_window), -1, dtype=torch.int64, device=dev))

    # ------------------------------------------------------------------ set-up
    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    def setup(self, batch_size: int) -> None:
        """Empty the cache for ``batch_size`` rows. Keeps the pool's capacity (call ``trim`` to release it)."""
        L, Hkv, dev = self.num_layers, self.num_kv_heads, self.device
        self.batch_size = batch_size
        self.page_table = torch.zeros(L, batch_size, Hkv, 1, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(L, batch_size, Hkv, dtype=torch.int32, device=dev)
        self.n_pages = torch.zeros(L, batch_size, Hkv, dtype=torch.int64, device=dev)
        self.obs_q = torch.zeros(L, batch_size, self.num_q_heads, self.obs_window, self.head_dim, dtype=self.dtype, device=dev)
        self.obs_pos = torch.full((batch_size, self.obs_window), -1, dtype=torch.int64, device=dev)

    reset = setup

    # ------------------------------------------------------------------ accounting
    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V in one page."""
        return 2 * self.page_size * self.head_dim * self.k_pages.element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of K plus V of one token of one KV head."""
        return 2 * self.head_dim * self.k_pages.element_size()

    def pages_held(self) -> Tensor:
        """[L, B, Hkv] pages that hold at least one token."""
        return (self.lengths.long() + self.page_size - 1) // self.page_size

    def bytes_held(self) -> Tensor:
        """[B] bytes of K/V pages holding tokens, per sequence (page rounding included)."""
        return self.pages_held().sum(dim=(0, 2)) * self.page_bytes

    def metadata_bytes(self) -> int:
        """Bytes of positions of held pages plus page tables and lengths (reported apart from the budget)."""
        pos = int(self.pages_held().sum()) * self.page_size * self.page_pos.element_size()
        return pos + self.page_table.nbytes + self.lengths.nbytes

    def bytes_reserved(self) -> int:
        """Bytes the pool tensors occupy right now (what the process really allocated for K/V)."""
        return self.k_pages.nbytes + self.v_pages.nbytes + self.page_pos.nbytes

    # ------------------------------------------------------------------ pages
    def reserve(self, n_tokens: int | Tensor) -> None:
        """Own enough pages that every head of row b can take ``n_tokens[b]`` more tokens, then pack the pool
        (``pack``): one copy of the owned pages per reservation, into a pool grown by half when it is full."""
        n = torch.as_tensor(n_tokens, device=self.device).long().expand(self.batch_size)
        want = (self.lengths.long() + n[None, :, None] + self.page_size - 1) // self.page_size
        need = (want - self.n_pages).clamp_min(0)
        if not bool(need.any()):
            return
        width = int(want.max())
        if width > self.page_table.shape[-1]:
            self.page_table = nn.functional.pad(self.page_table, (0, width - self.page_table.shape[-1]))
        self.n_pages += need  # the new pages point at page 0 until _renumber gives them pages of their own
        used, capacity = 1 + int(self.n_pages.sum()), self.k_pages.shape[0]
        self._renumber(capacity if used <= capacity else max(used, capacity + capacity // 2))

    def release_unused(self) -> None:
        """Give up every page past each head's length; the next ``reserve``, ``pack`` or ``trim`` reclaims them."""
        self.n_pages = self.pages_held()
        self.page_table = self.page_table.masked_fill(~self._owned(), 0)
        self.page_table = self.page_table[..., : max(int(self.n_pages.max()), 1)].contiguous()  # reads stay short

    def trim(self, spare_pages: int = 0) -> None:
        """Shrink the pool to the pages heads own plus ``spare_pages``, renumbering pages. Frees real memory."""
        capacity = 1 + int(self.n_pages.sum()) + spare_pages
        if capacity < self.k_pages.shape[0]:
            self._renumber(capacity)

    def pack(self) -> None:
        """Renumber pages so that each head's pages are consecutive, heads in (layer, row, head) order, keeping the
        pool's size. When every head of a layer owns as many pages as the page table is wide, a decode step then
        reads the layer's keys as one view of the pool instead of gathering them (``reference.heads_view``).
        One copy of the owned pages (``reserve`` calls it, so once per reservation, not per step); free when packed."""
        ids = self.page_table[self._owned()]
        if not torch.equal(ids, torch.arange(1, ids.numel() + 1, dtype=ids.dtype, device=self.device)):
            self._renumber(self.k_pages.shape[0])

    def packed(self) -> bool:
        """True when the page table is the run 1, 2, 3, ... : heads packed (``pack``) and every head owning as many
        pages as the table is wide (heads of a layer equally long, as at full budget or under a uniform
        allocator). Layer l's heads then hold pool pages ``1 + l*n ... (l+1)*n`` (n = B*Hkv*width), which is what a
        ``packed`` decode program reads in place. Checked once per page-table change, not per step."""
        table = self.page_table
        if self._packed_for[0]() is not table or self._packed_for[1] != table._version:
            n = table.numel()
            run = torch.arange(1, n + 1, dtype=table.dtype, device=table.device)
            self._packed = n < self.k_pages.shape[0] and torch.equal(table.reshape(-1), run)
            self._packed_for = (weakref.ref(table), table._version)
        return self._packed

    def _owned(self) -> Tensor:
        """[L, B, Hkv, MAXP] True at the page-table slots of pages a head owns."""
        return torch.arange(self.page_table.shape[-1], device=self.device) < self.n_pages[..., None]

    def _renumber(self, capacity: int) -> None:
        """Make the pool ``capacity`` pages with the owned pages at 1, 2, ... in (layer, row, head, page) order."""
        owned = self._owned()
        keep = torch.cat([self.page_table.new_zeros(1), self.page_table[owned]]).long()  # scratch page, then owned
        n = keep.numel() - 1
        for name in ("k_pages", "v_pages", "page_pos"):
            pool = getattr(self, name)
            new = pool.new_empty(capacity, *pool.shape[1:])  # new storage: the old pool's memory is released
            torch.index_select(pool, 0, keep, out=new[: n + 1])  # one read and one write of what heads own
            new[n + 1 :] = 0
            setattr(self, name, new)
        new_ids = torch.arange(1, n + 1, dtype=torch.int32, device=self.device)
        self.page_table = torch.zeros_like(self.page_table).masked_scatter_(owned, new_ids)

    def resize(self, capacity: int) -> None:
        """Make the pool exactly ``capacity`` pages (scratch page included, at least the pages heads own), packed:
        what a decode-time cap sizes once so that the decode step's shapes never change afterwards."""
        self._renumber(max(capacity, 1 + int(self.n_pages.sum())))

    # ------------------------------------------------------------------ tokens
    def slots_for(self, real: Tensor) -> Tensor:
        """Pool rows [L, B, Hkv, T] where the new tokens go; ``real`` [B, T] marks non-pad tokens.

        Call after ``reserve``. Real token t of row b becomes token ``lengths + (#real tokens before t)`` of every
        head of that row; pads go to the scratch row 0.
        """
        rank = real.long().cumsum(-1) - 1  # [B, T]
        j = self.lengths.long()[..., None] + rank[None, :, None, :]  # [L, B, Hkv, T]
        rows = reference.rows_of(self.page_table, j.clamp_min(0), self.page_size)
        return torch.where(real[None, :, None, :], rows, 0)

    def dense(self, layer: int):
        """Dense views of one layer: keys, values [B, Hkv, S, D], positions [B, Hkv, S], valid [B, Hkv, S]."""
        return reference.gather_dense(self.k_pages, self.v_pages, self.page_pos, self.page_table[layer], self.lengths[layer])

    def stats(self) -> dict:
        """Bytes held and per-(layer, KV head) lengths, per sequence."""
        return {
            "bytes_held": int(self.bytes_held().sum()),
            "bytes_held_per_sequence": self.bytes_held().tolist(),
            "metadata_bytes": self.metadata_bytes(),
            "bytes_reserved": self.bytes_reserved(),
            "page_size": self.page_size,
            "pages_held": int(self.pages_held().sum()),
            "lengths": self.lengths.tolist(),  # [L][B][Hkv]
        }
