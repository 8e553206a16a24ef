"""Where a head's tokens live in a page pool (``reference``'s layout): token j of head (b, h) at row j % P of page
``page_table[b, h, j // P]``; the helpers that find those rows and read whole heads."""

from __future__ import annotations

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
