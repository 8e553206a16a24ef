"""Decode over ragged heads by length class: a per-head allocator leaves heads of different lengths, and one gather
per layer would pad every head to the longest. Grouping heads by page count reads about the pages held."""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import reference  # (reference imports this module too: names are read at call time)

CLASS_OVERHEAD = 32  # what one more length class costs (launches, indexing), in head-pages read


def concrete(t: Tensor) -> bool:
    """Whether ``t``'s values can be read on the host: not while tracing (compile, export, a fake kernel run), where
    the decode must keep shapes that depend on shapes only."""
    return not torch.compiler.is_compiling() and not is_fake(t)


def read_for_free(t: Tensor) -> bool:
    """Whether reading ``t``'s values costs no device synchronisation: eager (``concrete``) and on the CPU. Only
    then does a decode group heads by length (on an accelerator the Triton kernel reads ragged heads in place)."""
    return t.device.type == "cpu" and concrete(t)


def length_classes(lengths: Tensor, page_size: int) -> list[Tensor]:
    """Heads ([B, Hkv] ``lengths``, flattened) grouped by page count into classes that minimise the pages a decode
    step reads, each class padded to its longest head, plus ``CLASS_OVERHEAD`` per class: [indices of each class].
    One class (equal heads, or too few to gain) means the plain path. Exact: a dynamic programme over the heads
    sorted by pages, where every optimal class is a contiguous run (host-side; eager decode only)."""
    pages = ((lengths.reshape(-1) + page_size - 1) // page_size).tolist()
    if min(pages) == max(pages):  # equal heads (a uniform recipe): nothing to gain, no programme to run
        return [torch.arange(len(pages), device=lengths.device)]
    order = sorted(range(len(pages)), key=pages.__getitem__)
    p = [pages[i] for i in order]
    best, cut = [0] + [None] * len(p), [0] * (len(p) + 1)  # best[j]: cost of the first j heads
    for j in range(1, len(p) + 1):
        best[j], cut[j] = min((best[i] + (j - i) * p[j - 1] + CLASS_OVERHEAD, i) for i in range(j))
    runs, j = [], len(p)
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    return [torch.tensor(r, device=lengths.device) for r in reversed(runs)]


def decode_by_length_class(q, k_pages, v_pages, page_table, lengths, scale: float, classes: list[Tensor],
                           log_weights: Tensor | None = None) -> Tensor:
    """One decode query per row [B, Hq, 1, D] over ragged heads, class by class (``length_classes``): each class
    gathers its heads' pages only up to its longest head, so a step reads about the pages held, not heads x the
    longest. The same attention as the single-gather path (the ops and their order per head are the same)."""
    B, Hq, _, D = q.shape
    Hkv, P = page_table.shape[1], k_pages.shape[1]
    G = Hq // Hkv
    tables, n = page_table.reshape(B * Hkv, -1), lengths.reshape(-1).long()
    qh, out = q.reshape(B * Hkv, G, D), q.new_zeros(B * Hkv, G, D)
    weighted = log_weights is not None and log_weights.shape[0] > 0
    for heads in classes:
        width = int(-(-int(n[heads].max()) // P))
        if width == 0:
            continue
        table = tables[heads, :width][None]  # [1, m, width]
        keys = reference.gather_pages(k_pages, table)[0].to(q.dtype)
        values = reference.gather_pages(v_pages, table)[0].to(q.dtype)
        weights = reference.gather_pages(log_weights, table)[0] if weighted else None
        visible = torch.arange(width * P, device=q.device) < n[heads, None]
        out[heads] = reference.decode_rows(qh[heads], keys, values, visible, scale, weights)
    return out.view(B, Hq, 1, D)
