"""Triton in-place compaction of the ragged per-head paged cache (layout: ``kvcompile.kernels.reference``).

Same semantics as ``reference.compact``: token j of head (b, h) becomes the token that was at ``keep_idx[b, h, j]``
for j < keep_count[b, h]; K, V, positions and (WEIGHTED) log-weights move in one pass; everything else is left as
it was.

Why in place is race-free. One program owns one head and touches only that head's pages (no two heads share a
page), so programs never meet. Inside a program, blocks of destinations j run in ascending order, and each block
loads all its source rows, waits at a barrier, then stores. Sources are ascending and distinct, so
``keep_idx[j] >= j``:
  * a block's sources are never rows an earlier block wrote (those are rows < the block's first j);
  * a later block writes rows >= its own first j, possibly sources of an earlier block, but only after that
    earlier block's loads, in program order;
  * within a block, a store may hit another lane's source row (keep_idx[j'] == j for j' < j), so the barrier
    makes every lane's load happen before any lane's store.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

BLOCK_J = 32  # destination rows per block


@triton.jit
def _compact_kernel(
    k_ptr, v_ptr, page_pos_ptr, lw_ptr, page_table_ptr, keep_idx_ptr, keep_count_ptr,
    stride_kn, stride_kp, stride_vn, stride_vp,
    K: tl.constexpr, D: tl.constexpr, P: tl.constexpr, MAXP: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr,
):
    bh = tl.program_id(0)
    count = tl.minimum(tl.load(keep_count_ptr + bh), K)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    for j0 in range(0, count, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        live = j < count
        src = tl.load(keep_idx_ptr + bh * K + j, mask=live, other=0)
        src_page = tl.load(page_table_ptr + bh * MAXP + src // P, mask=live, other=0).to(tl.int64)
        dst_page = tl.load(page_table_ptr + bh * MAXP + j // P, mask=live, other=0).to(tl.int64)
        m = live[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + src_page[:, None] * stride_kn + (src % P)[:, None] * stride_kp + d[None, :], mask=m)
        v = tl.load(v_ptr + src_page[:, None] * stride_vn + (src % P)[:, None] * stride_vp + d[None, :], mask=m)
        pos = tl.load(page_pos_ptr + src_page * P + src % P, mask=live)
        if WEIGHTED:
            lw = tl.load(lw_ptr + src_page * P + src % P, mask=live)
        tl.debug_barrier()  # every lane has loaded its source before any lane overwrites a row
        tl.store(k_ptr + dst_page[:, None] * stride_kn + (j % P)[:, None] * stride_kp + d[None, :], k, mask=m)
        tl.store(v_ptr + dst_page[:, None] * stride_vn + (j % P)[:, None] * stride_vp + d[None, :], v, mask=m)
        tl.store(page_pos_ptr + dst_page * P + j % P, pos, mask=live)
        if WEIGHTED:
            tl.store(lw_ptr + dst_page * P + j % P, lw, mask=live)


def compact(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_lw: Tensor, page_table: Tensor, keep_idx: Tensor,
    keep_count: Tensor,
) -> None:
    """In-place compaction, ``reference.compact`` semantics.

    k_pages, v_pages: [N_pages, P, D]; page_pos, page_lw: [N_pages, P] (contiguous, written in place; page_lw
    [0, P]: no log-weights);
    page_table: [B, Hkv, MAXP]; keep_idx: [B, Hkv, K], ascending in its first keep_count entries; keep_count: [B, Hkv].
    """
    B, Hkv, MAXP = page_table.shape
    P, D = k_pages.shape[1], k_pages.shape[2]
    assert k_pages.stride(-1) == 1 and v_pages.stride(-1) == 1 and page_pos.is_contiguous() and page_lw.is_contiguous()
    weighted = page_lw.shape[0] > 0
    page_table, keep_idx, keep_count = (t.contiguous() for t in (page_table, keep_idx, keep_count))
    wrap_triton(_compact_kernel)[(B * Hkv,)](
        k_pages, v_pages, page_pos, page_lw if weighted else page_pos, page_table, keep_idx, keep_count,
        k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
        K=keep_idx.shape[-1], D=D, P=P, MAXP=MAXP, BLOCK_J=BLOCK_J, BLOCK_D=max(16, triton.next_power_of_2(D)),
        WEIGHTED=weighted,
    )
