"""Decode over ragged heads by length class: a per-head allocator leaves heads of different lengths, and one gather
per layer would pad every head to the longest. Grouping heads by page count reads about the pages held."""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import reference  # (reference imports this module too: names are read at call time)
from .paging import per_page_table

CLASS_OVERHEAD = 32  # what one more length class costs (launches, indexing), in head-pages read


def concrete(t: Tensor) -> bool:
    """Whether ``t``'s values can be read on the host: not while tracing (compile, export, a fake kernel run), where
    the decode must keep shapes that depend on shapes only."""
    return not torch.compiler.is_compiling() and not is_fake(t)


def page_classes(page_table: Tensor) -> list[tuple[Tensor, int]]:
    """One layer's heads ([B, Hkv, W] ``page_table``, flattened) grouped by the pages each owns (its non-zero
    entries: a head may own a few pages ahead of its length) into classes that minimise the pages a decode step
    reads, each class padded to its longest head, plus ``CLASS_OVERHEAD`` per class: [(indices, width in pages)].
    One class (equal heads, or too few to gain) means the plain path. Read on the host once per page-table change
    (``paging.per_page_table``), not at every decode step."""
    def build(table: Tensor) -> list[tuple[Tensor, int]]:
        owned = (table != 0).sum(-1).reshape(-1).tolist()
        return [(torch.tensor(run, device=table.device), max(owned[i] for i in run)) for run in _page_runs(owned)]

    return per_page_table(page_table, ("classes", CLASS_OVERHEAD), build)


def _page_runs(pages: list[int]) -> list[list[int]]:
    """The optimal classes of heads with ``pages`` pages each, as index lists. Exact: a dynamic programme over the
    heads sorted by pages, where every optimal class is a contiguous run (host-side; eager decode only)."""
    if min(pages) == max(pages):  # equal heads (a uniform recipe): nothing to gain, no programme to run
        return [list(range(len(pages)))]
    order = sorted(range(len(pages)), key=pages.__getitem__)
    p = [pages[i] for i in order]
    best, cut = [0] + [None] * len(p), [0] * (len(p) + 1)  # best[j]: cost of the first j heads
    for j in range(1, len(p) + 1):
        best[j], cut[j] = min((best[i] + (j - i) * p[j - 1] + CLASS_OVERHEAD, i) for i in range(j))
    runs, j = [], len(p)
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    return runs[::-1]


def decode_by_length_class(q, k_pages, v_pages, page_table, lengths, scale: float,
                           classes: list[tuple[Tensor, int]], log_weights: Tensor | None = None) -> Tensor:
    """One decode query per row [B, Hq, 1, D] over ragged heads, class by class (``page_classes``: heads and the
    pages to read): each class gathers its heads' pages only up to its longest head, so a step reads about the
    pages held, not heads x the longest. The same attention as the single-gather path."""
    B, Hq, _, D = q.shape
    Hkv, P = page_table.shape[1], k_pages.shape[1]
    G = Hq // Hkv
    tables, n = page_table.reshape(B * Hkv, -1), lengths.reshape(-1).long()
    qh, out = q.reshape(B * Hkv, G, D), q.new_zeros(B * Hkv, G, D)
    weighted = log_weights is not None and log_weights.shape[0] > 0
    for heads, width in classes:
        if width == 0:
            continue
        table = tables[heads, :width][None]  # [1, m, width]
        keys = reference.gather_pages(k_pages, table)[0].to(q.dtype)
        values = reference.gather_pages(v_pages, table)[0].to(q.dtype)
        weights = reference.gather_pages(log_weights, table)[0] if weighted else None
        visible = torch.arange(width * P, device=q.device) < n[heads, None]
        out[heads] = reference.decode_rows(qh[heads], keys, values, visible, scale, weights)
    return out.view(B, Hq, 1, D)
