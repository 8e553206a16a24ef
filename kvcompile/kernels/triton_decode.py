"""Triton split-K decode attention over the ragged per-head paged cache (layout: ``kvcompile.kernels.reference``).

Each (batch row b, KV head h) is one virtual sequence whose G = Hq // Hkv query heads are the G query rows of a
``tl.dot`` (padded up to 16 rows, the smallest tile ``tl.dot`` accepts), so every K/V tile is read once per group.

Stage 1, grid (B * Hkv, max_splits): split s of head (b, h) covers tokens ``[s * T, min((s + 1) * T, L))`` with
T = ``L / max_splits`` rounded up to whole BLOCK_N tiles (short heads use fewer splits; the unused ones
write an empty LSE). It runs an online softmax and writes the split's normalised fp32 output and its
log-sum-exp to fixed work buffers [B, Hkv, G, max_splits, D] / [B, Hkv, G, max_splits].
Stage 2, grid (B * Hq,): merges the splits of one query head by log-sum-exp.

Token rows come from the page table one tile at a time (``page_table[b, h, j // P] * P + j % P``), so any
physical page order works. A separate contiguous-pages fast path is not provided: it would only skip those
page-id loads (one int32 per token, all from the same few cache lines), not any K/V traffic.

Grid and buffer sizes depend only on shapes (B, Hkv, G, D, max_splits), never on tensor values, so a decode step
launches without a host sync and can be captured in a CUDA graph.

A query head that sees no key (length 0, or every key masked by causality or the window) gets zeros, as in the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

BLOCK_N = 32  # tokens per K/V tile
MIN_ROWS = 16  # tl.dot needs at least 16 rows


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """fp32-accumulating tl.dot; F32 upcasts the operands first (see ``paged_decode``)."""
    if F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")  # ieee: no silent tf32 for fp32 inputs


@triton.jit
def _decode_split_kernel(
    q_ptr, q_pos_ptr, k_ptr, v_ptr, page_pos_ptr, page_table_ptr, lengths_ptr, part_out_ptr, part_lse_ptr,
    scale, window,
    stride_qb, stride_qh, stride_kn, stride_kp, stride_vn, stride_vp,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, P: tl.constexpr, MAXP: tl.constexpr,
    MAX_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    length = tl.load(lengths_ptr + bh)
    per_split = tl.cdiv(tl.cdiv(length, MAX_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(q_pos_ptr + b)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        j = tile + tl.arange(0, BLOCK_N)
        j_ok = j < end
        page = tl.load(page_table_ptr + bh * MAXP + j // P, mask=j_ok, other=0).to(tl.int64)  # no i32 overflow
        k_pos = tl.load(page_pos_ptr + page * P + j % P, mask=j_ok, other=0)
        visible = j_ok & (k_pos <= q_pos) & (q_pos - k_pos < window)
        kv_ok = visible[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kn + (j % P)[:, None] * stride_kp + d[None, :],
                    mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vn + (j % P)[:, None] * stride_vp + d[None, :],
                    mask=kv_ok, other=0.0)
        s = _dot(q, tl.trans(k.to(q.dtype)), F32_DOT) * scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: keep exp() away from NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), F32_DOT)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (bh * G + g) * MAX_SPLITS + split  # [B, Hkv, G, MAX_SPLITS] flattened
    tl.store(part_lse_ptr + row, lse, mask=g_ok)
    tl.store(part_out_ptr + row[:, None] * D + d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bq = tl.program_id(0)  # = b * Hq + query head = (b * Hkv + h) * G + g: the same row order as the buffers
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + bq * MAX_SPLITS + s, mask=s < MAX_SPLITS, other=float("-inf"))
    used = lse > float("-inf")  # empty splits hold no output: never read it
    part = tl.load(part_out_ptr + (bq * MAX_SPLITS + s)[:, None] * D + d[None, :],
                   mask=used[:, None] & (d < D)[None, :], other=0.0)
    m = tl.max(lse, 0)
    w = tl.where(used, tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)  # no split used -> zeros
    tl.store(out_ptr + (bq // HQ) * stride_ob + (bq % HQ) * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)


def paged_decode(
    q: Tensor,
    q_pos: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_pos: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    scale: float,
    window: int = 0,
    *,
    out: Tensor | None = None,
    max_splits: int = 16,
) -> Tensor:
    """Decode attention of one new token per batch row; ``reference.paged_attention`` with T == 1.

    q: [B, Hq, 1, D]; q_pos: [B, 1]; k_pages, v_pages: [N_pages, P, D]; page_pos: [N_pages, P];
    page_table: [B, Hkv, MAXP]; lengths: [B, Hkv]. Returns ``out`` (allocated if None): [B, Hq, 1, D], q's dtype.
    Query heads that see no key get zeros.
    """
    B, Hq, T, D = q.shape
    _, Hkv, MAXP = page_table.shape
    P = k_pages.shape[1]
    assert T == 1 and Hq % Hkv == 0, "one query token per row, Hq a multiple of Hkv"
    assert q.stride(-1) == 1 and k_pages.stride(-1) == 1 and v_pages.stride(-1) == 1
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    page_pos, page_table, lengths, q_pos = (t.contiguous() for t in (page_pos, page_table, lengths, q_pos))
    part_out = torch.empty(B, Hkv, G, max_splits, D, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(B, Hkv, G, max_splits, device=q.device, dtype=torch.float32)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    wrap_triton(_decode_split_kernel)[(B * Hkv, max_splits)](
        q, q_pos, k_pages, v_pages, page_pos, page_table, lengths, part_out, part_lse,
        scale, window if window > 0 else 2**31 - 1,  # no window: every causal key is in range
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
        HKV=Hkv, G=G, D=D, P=P, MAXP=MAXP, MAX_SPLITS=max_splits,
        BLOCK_G=max(MIN_ROWS, triton.next_power_of_2(G)), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        # CPU tensors only run under the Triton interpreter, whose tl.dot (triton 3.9) multiplies bf16 operands
        # as their raw uint16 bits; feed it fp32 there (same rounding of p, exact products).
        F32_DOT=q.device.type == "cpu" and q.dtype == torch.bfloat16,
    )
    wrap_triton(_decode_merge_kernel)[(B * Hq,)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        HQ=Hq, D=D, MAX_SPLITS=max_splits, BLOCK_S=triton.next_power_of_2(max_splits), BLOCK_D=BLOCK_D,
    )
    return out
