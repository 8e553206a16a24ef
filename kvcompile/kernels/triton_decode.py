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

Weighted entries (``cache.weights``) add their log-weight to their logit in stage 1 (WEIGHTED, a constant: an
unweighted cache compiles the kernel without the load).

A format pool (``reference.FormatPages``: entries stored in a page format) gets a stage-1 launch of its own,
with the format's layout as constants, whose splits follow the model-dtype pool's in the work buffers; the one
stage 2 merges them all. Its rows are decoded in registers (``_load_rows``): the K/V traffic is the stored bytes
plus their scales, and no dequantized copy is written. A rotated codec's Hadamard rotation is never applied to a key
or value: ``q . H(x) = H(q) . x``, so the launch rotates the query once and, since attention is linear in the values,
rotates its output back once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from .formats import codec_of
from .hadamard import fwht

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
def _three_bits(base, d, mask, D: tl.constexpr):
    """3-bit codes of channels d: a 2-bit plane (D / 4 bytes) then a 1-bit plane (D / 8 bytes)."""
    W2: tl.constexpr = D // 4
    W1: tl.constexpr = D // 8
    lo = (tl.load(base + (d % W2)[None, :], mask=mask, other=0) >> ((d // W2) * 2)[None, :].to(tl.uint8)) & 3
    hi = (tl.load(base + (W2 + d % W1)[None, :], mask=mask, other=0) >> (d // W1)[None, :].to(tl.uint8)) & 1
    return lo | (hi << 2)


@triton.jit
def _load_rows(ptr, meta_ptr, page, row, d, mask, stride_n, stride_p, stride_mn, stride_mp,
               D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] fp32 tile of stored rows, decoded in registers (``kernels.formats``): BITS 0 reads
    the rows as they are (a float dtype, float8 included, with an fp32 scale per row when GROUP is 1 -- fp8),
    BITS 8/4/2 unpack plane ``d // W`` of byte ``d % W`` (W = D * BITS / 8) and 3 joins a 2-bit and a 1-bit
    plane, then apply the fp16 scale and minimum of channel d's group of GROUP (GROUP -1: of channel d in the
    row's page, ``ChannelCodec``). Three layouts need more than a scale: BITS -1 pruned keys (GROUP kept
    channels, put back at the channels the page lists, zeros elsewhere), -2 rotated keys (the 3-bit direction times
    norm / |levels|, still rotated: the caller rotates the query instead) and -3 rotated values (the page's affine
    grid, still rotated: the caller rotates the output back)."""
    base = ptr + page[:, None] * stride_n + row[:, None] * stride_p
    if GROUP == -1 or BITS < 0:
        meta = meta_ptr + page[:, None] * stride_mn  # one metadata row per page
    else:
        meta = meta_ptr + page[:, None] * stride_mn + row[:, None] * stride_mp
    # one return at the end: Triton's compiler (unlike its interpreter) builds the statements after a return too
    if BITS == 0:
        x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
        if GROUP == 1:  # fp8: one fp32 scale per row
            x = x * tl.load(meta + 0 * d[None, :], mask=mask, other=0.0)
    elif BITS == -1:  # row [n, w] is channel list[n, w] of the row: a one-hot sum puts it there
        kept = mask & (d < GROUP)[None, :]
        x = tl.load(base + d[None, :], mask=kept, other=0.0).to(tl.float32)
        channel = tl.load(meta + d[None, :], mask=kept, other=-1).to(tl.int32)
        x = tl.sum(x[:, :, None] * (channel[:, :, None] == d[None, None, :]).to(tl.float32), 1)
    elif BITS == -2:  # symmetric levels; the fp16 norm's two bytes follow the codes (rows of page 0 when masked)
        levels = tl.where(mask, _three_bits(base, d, mask, D).to(tl.float32) - 3.0, 0.0)
        norm = (tl.load(base + 3 * D // 8) | (tl.load(base + 3 * D // 8 + 1).to(tl.uint16) << 8)).to(
            tl.float16, bitcast=True).to(tl.float32)  # [BLOCK_N, 1]
        size = tl.sqrt(tl.sum(levels * levels, 1))[:, None]
        x = levels * (norm / tl.maximum(size, 1e-30))
    elif BITS == -3:  # one (scale, minimum) per page
        scale = tl.load(meta + 0 * d[None, :], mask=mask, other=0.0)
        low = tl.load(meta + 1 + 0 * d[None, :], mask=mask, other=0.0)
        x = tl.where(mask, _three_bits(base, d, mask, D).to(tl.float32) * scale + low, 0.0)
    else:
        if BITS == 3:
            q = _three_bits(base, d, mask, D)
        else:
            W: tl.constexpr = D * BITS // 8
            q = (tl.load(base + (d % W)[None, :], mask=mask, other=0) >> ((d // W) * BITS)[None, :].to(tl.uint8)) \
                & ((1 << BITS) - 1)
        group = d[None, :] if GROUP == -1 else (d // GROUP)[None, :]
        scale = tl.load(meta + 2 * group, mask=mask, other=0.0).to(tl.float32)
        low = tl.load(meta + 2 * group + 1, mask=mask, other=0.0).to(tl.float32)
        x = q.to(tl.float32) * scale + low
    return x


@triton.jit
def _decode_split_kernel(
    q_ptr, q_pos_ptr, k_ptr, v_ptr, k_meta_ptr, v_meta_ptr, page_pos_ptr, lw_ptr, page_table_ptr, lengths_ptr,
    rotation_ptr, part_out_ptr, part_lse_ptr, scale, window,
    stride_qb, stride_qh, stride_kn, stride_kp, stride_vn, stride_vp, stride_kmn, stride_kmp, stride_vmn, stride_vmp,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, P: tl.constexpr, MAXP: tl.constexpr,
    MAX_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_BITS: tl.constexpr,
    V_GROUP: tl.constexpr, FIRST_SPLIT: tl.constexpr, ALL_SPLITS: tl.constexpr, WEIGHTED: tl.constexpr,
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
    if K_BITS == -2 or V_BITS == -3:  # rotated: the orthonormal Hadamard matrix [D, D] (symmetric, its own inverse)
        rotation = tl.load(rotation_ptr + d[:, None] * D + d[None, :], mask=d_ok[:, None] & d_ok[None, :], other=0.0)
    if K_BITS == -2:  # q . H(x) = H(q) . x: rotate the query once instead of every key
        q = _dot(q.to(tl.float32), rotation, True)

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
        k = _load_rows(k_ptr, k_meta_ptr, page, j % P, d, kv_ok, stride_kn, stride_kp, stride_kmn, stride_kmp,
                       D, K_BITS, K_GROUP)
        v = _load_rows(v_ptr, v_meta_ptr, page, j % P, d, kv_ok, stride_vn, stride_vp, stride_vmn, stride_vmp,
                       D, V_BITS, V_GROUP)
        # [BLOCK_G, BLOCK_N] fp32; the cast: Inductor passes a Python float to a kernel as fp64
        s = (_dot(q, tl.trans(k.to(q.dtype)), F32_DOT) * scale).to(tl.float32)
        if WEIGHTED:  # an entry standing for w tokens: + log w on its logit
            s = s + tl.load(lw_ptr + page * P + j % P, mask=j_ok, other=0.0)[None, :]
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
    if V_BITS == -3:  # the values were summed in the rotated basis: rotate the output back
        out = _dot(out, rotation, True)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (bh * G + g) * ALL_SPLITS + FIRST_SPLIT + split  # [B, Hkv, G, ALL_SPLITS] flattened
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
    stored=None,
    log_weights: Tensor | None = None,
) -> Tensor:
    """Decode attention of one new token per batch row; ``reference.paged_attention`` with T == 1.

    q: [B, Hq, 1, D]; q_pos: [B, 1]; k_pages, v_pages: [N_pages, P, D]; page_pos: [N_pages, P];
    page_table: [B, Hkv, MAXP]; lengths: [B, Hkv]. Returns ``out`` (allocated if None): [B, Hq, 1, D], q's dtype.
    Query heads that see no key get zeros. ``stored``: the layer's format pool (``reference.FormatPages``), read
    by a second stage-1 launch that decodes its rows in registers into splits of their own; stage 2 merges both.
    ``log_weights``: [N_pages, P] fp32 added to the model-dtype pool's logits (None or [0, P]: none; a shape, so
    the kernel's WEIGHTED constant, picks the path).
    """
    B, Hq, T, D = q.shape
    _, Hkv, MAXP = page_table.shape
    assert T == 1 and Hq % Hkv == 0, "one query token per row, Hq a multiple of Hkv"
    assert q.stride(-1) == 1 and k_pages.stride(-1) == 1 and v_pages.stride(-1) == 1
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    q_pos = q_pos.contiguous()
    weighted = log_weights is not None and log_weights.shape[0] > 0
    pools = [(k_pages, None, v_pages, None, page_pos, page_table, lengths, weighted)]
    if stored is not None and not stored.empty:
        if not stored.triton_reads(D):  # ops reads them in PyTorch on every device
            raise NotImplementedError("these pages have no Triton decode layout (their codecs' triton_layout)")
        pools.append((stored.k, stored.k_meta, stored.v, stored.v_meta, stored.pos, stored.table, stored.lengths,
                      False))
    splits = max_splits * len(pools)
    part_out = torch.empty(B, Hkv, G, splits, D, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(B, Hkv, G, splits, device=q.device, dtype=torch.float32)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    for i, (k, k_meta, v, v_meta, pos, table, lens, lw) in enumerate(pools):
        (k_bits, k_group), (v_bits, v_group) = _layout(k, k_meta, D), _layout(v, v_meta, D)
        rotation = _hadamard(D, q.device) if k_bits == -2 or v_bits == -3 else q  # read by rotated pages only
        k_meta, v_meta = (k if k_meta is None else k_meta), (v if v_meta is None else v_meta)
        pos, table, lens = (t.contiguous() for t in (pos, table, lens))
        wrap_triton(_decode_split_kernel)[(B * Hkv, max_splits)](
            q, q_pos, k, v, k_meta, v_meta, pos, log_weights.contiguous() if lw else pos, table, lens, rotation,
            part_out, part_lse,
            scale, window if window > 0 else 2**31 - 1,  # no window: every causal key is in range
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_meta.stride(0), k_meta.stride(1), v_meta.stride(0), v_meta.stride(1),
            HKV=Hkv, G=G, D=D, P=k.shape[1], MAXP=table.shape[-1], MAX_SPLITS=max_splits,
            BLOCK_G=max(MIN_ROWS, triton.next_power_of_2(G)), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
            # CPU tensors only run under the Triton interpreter, whose tl.dot (triton 3.9) multiplies bf16
            # operands as their raw uint16 bits; feed it fp32 there (same rounding of p, exact products).
            F32_DOT=q.device.type == "cpu" and q.dtype == torch.bfloat16,
            K_BITS=k_bits, K_GROUP=k_group, V_BITS=v_bits, V_GROUP=v_group,
            FIRST_SPLIT=i * max_splits, ALL_SPLITS=splits, WEIGHTED=lw,
        )
    wrap_triton(_decode_merge_kernel)[(B * Hq,)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        HQ=Hq, D=D, MAX_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=BLOCK_D,
    )
    return out


@functools.cache
def _hadamard(head_dim: int, device: torch.device) -> Tensor:
    """The orthonormal Hadamard matrix of rotated codecs, built once per head dim and device (not per decode step)."""
    return fwht(torch.eye(head_dim, device=device))


def _layout(codes: Tensor, meta: Tensor | None, head_dim: int) -> tuple[int, int]:
    """(BITS, GROUP) constants of ``_load_rows`` for rows stored by ``formats.codec_of(codes, meta)``: (0, 0) a
    float dtype, (0, 1) fp8 with a row scale, (bits, group) the integer codecs, (bits, -1) per-channel pages,
    (-1, kept channels) pruned keys, (-2, 0) rotated keys, (-3, 0) rotated values. Each codec says which
    (``triton_layout``); a codec without one is not read by this kernel."""
    return (0, 0) if meta is None else codec_of(codes, meta, head_dim).triton_layout(codes, meta, head_dim)
