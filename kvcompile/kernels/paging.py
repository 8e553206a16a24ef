"""Where a head's tokens live in a page pool (``reference``'s layout): token j of head (b, h) at row j % P of page
``page_table[b, h, j // P]``; the helpers that find those rows and read whole heads."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor


def rows_of(page_table: Tensor, j: Tensor, page_size: int) -> Tensor:
    """Flat pool rows ``page * P + offset`` of logical tokens ``j`` [B, Hkv, K] of each head -> [B, Hkv, K] int64."""
    pages = page_table.long().gather(-1, (j // page_size).clamp(0, page_table.shape[-1] - 1))
    return pages * page_size + j % page_size


def gather_pages(pool: Tensor, page_table: Tensor) -> Tensor:
    """Each head's pages of ``pool`` ([N_pages, P, ...]) laid end to end: [B, Hkv, MAXP * P, ...]."""
    B, Hkv, W = page_table.shape
    rows = torch.index_select(pool.reshape(pool.shape[0], -1), 0, page_table.reshape(-1).long())  # fastest CPU copy
    return rows.view(B, Hkv, W * pool.shape[1], *pool.shape[2:])


def heads_view(pool: Tensor, page_table: Tensor, first_page: int | None = None) -> Tensor:
    """``gather_pages``, without the copy when the heads' pages are the packed run ``first_page``,
    ``first_page + 1``, ... (``PagedKVCache.packed``): they are then one slice of the pool. Read-only result."""
    if first_page is None:
        return gather_pages(pool, page_table)
    return pool[first_page : first_page + page_table.numel()].view(*page_table.shape[:2], -1, *pool.shape[2:])


def per_page_table(page_table: Tensor, key, build: Callable[[Tensor], object]):
    """``build(page_table)``, made once per change of the page table (a reservation, a release, a renumbering: its
    version moves) and per layer (``page_table`` may be one layer's view of the cache's table) and ``key``: what a
    decode derives on the host from where heads' pages lie, read once per change instead of at every step, as
    ``PagedKVCache.packed`` is."""
    base = page_table if page_table._base is None else page_table._base
    ref, version, made = _made_for.get(id(base), (None, None, None))
    if ref is None or ref() is not base or version != base._version:
        made = {}
        _made_for[id(base)] = (weakref.ref(base, lambda _, i=id(base): _made_for.pop(i, None)), base._version, made)
    layer = (page_table.storage_offset(), tuple(page_table.shape), key)
    if layer not in made:
        made[layer] = build(page_table)
    return made[layer]


_made_for: dict = {}  # id of a page table -> (a weak reference to it, its version, what was built per layer and key)
