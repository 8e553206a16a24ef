"""Pure-PyTorch reference kernels over the paged cache layout.

These are the CPU path of every kvcompile op and the oracle the Triton kernels are tested against.

Layout (see ``kvcompile.cache.PagedKVCache`` for the whole story)::

    k_pages, v_pages : [N_pages, P, D]      page pool, one page = P tokens of one (layer, batch row, KV head)
    page_pos         : [N_pages, P] int32   original sequence position of every stored token
    page_lw          : [N_pages, P] float32 log-weight of every stored entry, added to its logit ([0, P]: none)
    page_table       : [B, Hkv, MAXP] int32 logical page i of head (b, h) -> physical page id
    lengths          : [B, Hkv] int32       tokens held by head (b, h)

Token ``j`` of head ``(b, h)`` lives at row ``j % P`` of page ``page_table[b, h, j // P]``. Page 0 is a scratch
page that no head owns: padding writes zeros there. Every row that holds no token is zero, so reading a whole
page under a mask is safe (``kvcompile.cache``). The dense loop that rebuilds
one head's keys, the definition every function here follows::

    keys = torch.stack([k_pages[page_table[b, h, j // P], j % P] for j in range(lengths[b, h])])
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_native, ragged
from .format_pages import FormatPages
from .paging import gather_pages, heads_view, rows_of

__all__ = ["FormatPages", "gather_pages", "heads_view", "rows_of"]  # read by the cache and the tests from here


def gather_dense(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_table: Tensor, lengths: Tensor,
    first_page: int | None = None,
):
    """Dense per-head views of the cache: keys, values [B, Hkv, S, D], positions [B, Hkv, S], valid [B, Hkv, S].

    Whole pages are gathered, so S = MAXP * P (the page table's width): shapes depend on shapes only (no host
    sync), and rows past a head's length are marked invalid. ``first_page``: see ``heads_view``.
    """
    keys, values = heads_view(k_pages, page_table, first_page), heads_view(v_pages, page_table, first_page)
    positions = heads_view(page_pos, page_table, first_page).long()
    valid = torch.arange(keys.shape[2], device=keys.device) < lengths.unsqueeze(-1)
    return keys, values, positions, valid


def paged_attention(
    q: Tensor,
    q_pos: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_pos: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    scale: float,
    window: int = 0,
    block_bytes: int = 1 << 26,
    first_page: int | None = None,
    stored: FormatPages | None = None,
    log_weights: Tensor | None = None,
) -> Tensor:
    """Attention of new queries over the keys each KV head holds.

    q: [B, Hq, T, D]; q_pos: [B, T] original positions of the queries. A query sees a stored key when the key's
    position is not after its own (causal) and, if ``window > 0``, is less than ``window`` positions behind.
    Hq must be a multiple of Hkv (GQA: query head i reads KV head i // (Hq // Hkv)). Returns [B, Hq, T, D]; a
    query that sees no key (a padding row, an empty head) gets zeros. A single query (T == 1) is a decode step:
    the newest token, so without a window no position check is needed; on the CPU, outside a trace, fp32 pages are
    then read in place by ``cpu_native`` (one pass, each head as far as it holds). ``first_page``: the heads' pages
    are the packed run starting there (``PagedKVCache.packed``), read in place instead of gathered. ``stored``: the
    layer's format pool, whose entries every head also holds (``FormatPages``; attended by ``stored_decode`` for a
    decode step without a window, else by ``merged_attention`` where it holds any entry). ``log_weights``: the
    pool's log-weights ([N_pages, P], added to each entry's logit: an entry of weight w gets the mass of w tokens
    with its key); None or empty ([0, P]) for plain tokens. A cache holds weighted entries in its model-dtype pool
    only, so the format paths take none.
    """
    if stored is not None and not stored.empty:
        pages = (k_pages, v_pages, page_pos, page_table, lengths, first_page)
        if q.shape[2] == 1 and window == 0:
            both = _native_two_pools(q, pages, stored, scale)
            return both if both is not None else stored_decode(q, gather_dense(*pages), stored, scale)
        if stored.holds_entries():  # else (a prefill before any compression) the model-dtype pages alone
            return merged_attention(q, q_pos, gather_dense(*pages), stored, scale, window, block_bytes)
    B, Hq, T, D = q.shape
    if T == 1 and window == 0 and ragged.concrete(lengths):  # in place, each head as far as it holds
        out = cpu_native.decode(q, k_pages, v_pages, page_table, lengths, scale, log_weights)
        if out is not None:
            return out
    weighted = log_weights is not None and log_weights.shape[0] > 0  # a shape, not values, picks the path
    weights = heads_view(log_weights, page_table, first_page) if weighted else None  # [B, Hkv, S]
    if T == 1 and window == 0 and first_page is None and ragged.concrete(lengths):
        classes = ragged.page_classes(page_table)
        if len(classes) > 1:  # ragged heads: each class reads only up to its own longest head
            return ragged.decode_by_length_class(q, k_pages, v_pages, page_table, lengths, scale, classes, log_weights)
    if T == 1 and window == 0:  # decode of the newest token: every held key is at or before it
        keys, values = heads_view(k_pages, page_table, first_page), heads_view(v_pages, page_table, first_page)
        visible = torch.arange(keys.shape[2], device=q.device) < lengths.unsqueeze(-1)
    else:
        keys, values, k_pos, valid = gather_dense(k_pages, v_pages, page_pos, page_table, lengths, first_page)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    if T == 1:  # decode: one [G, S] score matrix per KV head, no mask beyond [B, Hkv, S]
        if window > 0:
            dq = q_pos.long()[:, None, :]
            visible = valid & (k_pos <= dq) & (dq - k_pos < window)
        out = decode_rows(q.view(B, Hkv, G, D), keys, values, visible, scale, weights)
        return out.reshape(B, Hq, 1, D)  # reshape: CUDA's SDPA may return it strided
    step = max(1, block_bytes // max(1, B * Hq * S))  # queries per block: bounds the [B, Hq, Tb, S] mask
    # heads that hold the same positions share one mask (built once, broadcast); otherwise one per query head
    held = k_pos.masked_fill(~valid, -1)
    shared = not weighted and bool((held == held[:, :1]).all())
    heads = slice(0, 1) if shared else slice(None)
    out = []
    for t0 in range(0, T, step):
        dq = q_pos[:, t0 : t0 + step].long()[:, None, :, None]  # [B, 1, Tb, 1]
        dk = k_pos[:, heads, None, :]  # [B, Hkv or 1, 1, S]
        visible = valid[:, heads, None, :] & (dk <= dq)
        if window > 0:
            visible = visible & (dq - dk < window)
        visible = visible if shared else visible.repeat_interleave(G, 1)
        mask, qb = visible, q[:, :, t0 : t0 + step]
        if weighted:  # a float mask, in fp32 as in decode: each entry's log-weight added to its logit
            mask, qb = torch.where(visible, weights.repeat_interleave(G, 1)[:, :, None, :], float("-inf")), qb.float()
        o = torch.nn.functional.scaled_dot_product_attention(
            qb, keys.to(qb.dtype), values.to(qb.dtype), attn_mask=mask, scale=scale, enable_gqa=G > 1
        )
        out.append((o.nan_to_num(0.0) * visible.any(-1, keepdim=True)).to(q.dtype))
    return torch.cat(out, 2)


def after_held(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, held, scale: float) -> tuple[Tensor, Tensor] | None:
    """Attention of T new queries q [B, Hq, T, D] at positions q_pos [B, T] over the entries the heads held before
    them (``held``: ``gather_dense``'s views of those alone) and over their own keys and values k, v [B, Hkv, T, D],
    on the CPU, for new tokens at consecutive positions after every held entry (a later prefill chunk, a question read
    after compression, a reconstruction prompt): every query then sees every held entry, so that part takes no causal
    mask, and the new keys a plain causal one. Two flash-attention calls merged by log-sum-exp, where one masked call
    would score the whole upper triangle it then discards. Returns the output and its log-sum-exp [B, Hq, T] (fp32);
    None, with nothing computed, where a held entry does not stand before the row's first new token (the general
    path serves)."""
    keys, values, positions, valid = held
    B, Hq, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    if S and bool((positions.masked_fill(~valid, -1).amax((1, 2)) >= q_pos[:, 0]).any()):
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    new_k, new_v = (x.to(q.dtype).repeat_interleave(G, 1).contiguous() for x in (k, v))
    out, lse = flash(q.contiguous(), new_k, new_v, is_causal=True, scale=scale)
    if S == 0:
        return out, lse
    mask = None if bool(valid.all()) else torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~valid, float("-inf"))[:, :, None]  # [B, Hkv, 1, S]: one row for every query of the head
    rows = q.reshape(B, Hkv, G * T, D).contiguous()  # each KV head's G query heads read as G x T rows
    old, old_lse = flash(rows, keys.to(q.dtype).contiguous(), values.to(q.dtype).contiguous(), attn_mask=mask,
                         scale=scale)
    blind = ~valid.any(-1)[:, :, None]  # a head that held nothing: the op leaves lse 0, the output undefined
    old_lse = old_lse.view(B, Hkv, G * T).masked_fill(blind, float("-inf")).view(B, Hq, T)
    old = old.view(B, Hkv, G * T, D).masked_fill(blind[..., None], 0.0).view(B, Hq, T, D)
    merged, total = _merge(old.float(), old_lse, out.float(), lse)
    return merged.to(q.dtype), total


def decode_rows(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float,
                log_weights: Tensor | None = None) -> Tensor:
    """Each head's G decode queries q [..., G, D] over its keys and values [..., S, D], where ``visible`` [..., S]
    -> [..., G, D] (zeros where nothing is visible). ``log_weights`` [..., S]: added to the logits, in fp32 (a
    log-weight rounded to a 16-bit float would misstate the entry's mass). Eager and unweighted, one fused SDPA call
    (CPU flash attention; measured ~25% faster than the three steps at SmolLM2's decode shapes); traced or weighted,
    scores, softmax and values, which Inductor fuses."""
    if log_weights is None and ragged.concrete(q):
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible[..., None, :],
                                                               scale=scale)
        # a head that sees nothing: NaN on CPU, but CUDA's kernels return finite garbage (seen on an H200)
        return out.masked_fill(~visible.any(-1)[..., None, None], 0.0)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [..., G, S]
    if log_weights is not None:
        scores = scores.float() + log_weights[..., None, :]
    probs = torch.softmax(scores.masked_fill(~visible[..., None, :], float("-inf")), -1).nan_to_num(0.0)
    return torch.matmul(probs.to(values.dtype), values)


def merged_attention(q, q_pos, dense, stored: FormatPages, scale: float, window: int, block_bytes: int,
                     tile_tokens: int = 1024) -> Tensor:
    """Attention over a head's model-dtype entries (``dense``: ``gather_dense``'s views) and its format pool,
    which is decoded one tile of pages at a time: one partial softmax state per tile, merged by log-sum-exp (the
    split-K merge). Called by opaque ops only (``ops.format_attention``): its loops are over tensor sizes."""
    B, Hq, T, D = q.shape
    P, width = stored.pos.shape[1], stored.table.shape[-1]
    step = max(1, tile_tokens // P)
    tiles = [lambda: dense] + [lambda s=s: stored.dense(D, q.dtype, slice(s, s + step)) for s in range(0, width, step)]
    Tb = max(1, block_bytes // max(1, B * Hq * 4 * (dense[0].shape[2] + min(width, step) * P)))
    out = []
    for t0 in range(0, T, Tb):
        qb, pb = q[:, :, t0 : t0 + Tb], q_pos[:, t0 : t0 + Tb]
        o, lse = None, None
        for tile in tiles:
            o, lse = _merge(o, lse, *_partial(qb, pb, *tile(), scale, window))
        out.append(o.to(q.dtype))
    return torch.cat(out, 2)


def stored_decode(q, dense, stored: FormatPages, scale: float, tile_tokens: int = 2048) -> Tensor:
    """A decode step without a window (every held entry is visible) over a head's model-dtype entries (``dense``)
    and its format pool, in two passes over the pool's tiles of pages: every tile's scores, read from the codes
    (``Codec.dot``), one softmax, then every tile's weighted sum (``Codec.mix``). A codec that folds its scales
    never writes decoded rows, and a tile is small enough to stay in cache where one is decoded. Called by opaque
    ops only, as ``merged_attention``. Where ``cpu_native`` reads the pool, it attends to it in one pass instead,
    and the dense entries' softmax state is merged with its by log-sum-exp."""
    B, Hq, _, D = q.shape
    keys, values, _, valid = dense
    Hkv, S0, P = keys.shape[1], keys.shape[2], stored.pos.shape[1]
    qg = q.float().view(B, Hkv, Hq // Hkv, D) * scale
    native = stored.native_attention(qg, D)
    if native is not None:
        out, _ = _merge(*native, *_dense_state(qg, dense)) if S0 > 0 else native
        return out.view(B, Hq, 1, D).to(q.dtype)
    step = max(1, tile_tokens // P)
    tiles = [slice(s, s + step) for s in range(0, stored.table.shape[-1], step)]
    scores = [torch.matmul(qg, keys.float().transpose(-1, -2))]
    scores += [stored.scores(qg, stored.table[..., t], D) for t in tiles]
    j = torch.arange(stored.table.shape[-1] * P, device=q.device)
    seen = torch.cat([valid, j < stored.lengths.unsqueeze(-1)], -1)[:, :, None]
    probs = torch.softmax(torch.cat(scores, -1).masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    out, done = torch.matmul(probs[..., :S0], values.float()), S0
    for t in tiles:
        width = stored.table[..., t].shape[-1] * P
        out = out + stored.mix(probs[..., done : done + width], stored.table[..., t], D)
        done += width
    return out.view(B, Hq, 1, D).to(q.dtype)


def _dense_state(qg, dense) -> tuple[Tensor, Tensor]:
    """Softmax attention of qg [B, Hkv, G, D] (scaled) over gathered model-dtype entries (``gather_dense``), in
    PyTorch: the output and its log-sum-exp (-inf where a head holds none)."""
    keys, values, _, valid = dense
    logits = torch.matmul(qg, keys.float().transpose(-1, -2)).masked_fill(~valid[:, :, None], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.matmul(torch.exp(logits - lse[..., None]).nan_to_num(0.0), values.float()), lse


def _native_two_pools(q, pages: tuple, stored: FormatPages, scale: float) -> Tensor | None:
    """A decode step over a layer's format pool and its model-dtype pages (``pages``: ``gather_dense``'s
    arguments), both read in place by ``cpu_native`` in one softmax; None, with nothing computed, where it does not
    read both (``stored_decode`` then serves: the format pool natively where it can, the pages in PyTorch)."""
    B, Hq, _, D = q.shape
    k_pages, v_pages, _, page_table, lengths, _ = pages
    qg = q.float().view(B, page_table.shape[1], -1, D) * scale
    dense = ((None, k_pages, None), (None, v_pages, None), page_table, lengths)
    state = stored.native_attention(qg, D, more=(dense,))
    return None if state is None else state[0].view(B, Hq, 1, D).to(q.dtype)


def _partial(q, q_pos, keys, values, k_pos, valid, scale: float, window: int):
    """Softmax attention of q [B, Hq, T, D] over one tile of keys: output [B, Hq, T, D] (fp32) and its
    log-sum-exp [B, Hq, T] (-inf where a query sees nothing in the tile). On the CPU one fused flash-attention call
    (scores never leave the cache), each KV head's G query heads read as G x T rows; elsewhere scores, softmax and
    values in PyTorch."""
    B, Hq, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    dq, dk = q_pos.long()[:, None, :, None], k_pos[:, :, None, :]  # [B, 1, T, 1], [B, Hkv, 1, S]
    visible = valid[:, :, None, :] & (dk <= dq)
    if window > 0:
        visible = visible & (dq - dk < window)
    qf, kf, vf = q.float().reshape(B, Hkv, G * T, D), keys.float(), values.float()
    if q.device.type == "cpu":
        mask = torch.zeros(visible.shape, device=q.device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, :, None].expand(B, Hkv, G, T, S).reshape(B, Hkv, G * T, S)
        qf, kf, vf = qf.contiguous(), kf.contiguous(), vf.contiguous()  # strided views: wrong results (torch 2.13)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, kf, vf, attn_mask=mask, scale=scale)
        blind = ~visible.any(-1)[:, :, None]  # a query that sees nothing here: the op leaves lse 0, out undefined
        lse = lse.view(B, Hkv, G, T).masked_fill(blind, float("-inf"))
        out = out.view(B, Hkv, G, T, D).masked_fill(blind[..., None], 0.0)
        return out.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    scores = scores.view(B, Hkv, G, T, S).masked_fill(~visible[:, :, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [B, Hkv, G, T]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.matmul(probs.view(B, Hkv, G * T, S), vf).view(B, Hq, T, D)
    return out, lse.reshape(B, Hq, T)


def _merge(o, lse, o_new, lse_new):
    """Merge two partial softmax states by log-sum-exp (an empty one has lse -inf and output 0)."""
    if o is None:
        return o_new, lse_new
    total = torch.logaddexp(lse, lse_new)
    a, b = (torch.exp(x - total).nan_to_num(0.0)[..., None] for x in (lse, lse_new))
    return o * a + o_new * b, total


def write_tokens(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, k: Tensor, v: Tensor, pos: Tensor, slots: Tensor,
    padded: bool = True,
) -> None:
    """Write new tokens into the pool in place. k, v: [B, Hkv, T, D]; pos: [B, T] (-1: padding, written as zeros
    to the scratch row its slot names, so a pad's values never reach anything); slots: [B, Hkv, T] flat rows.
    ``padded`` False: the caller knows no position is -1, so nothing is zeroed (a prefill without padding)."""
    D, P = k_pages.shape[-1], k_pages.shape[1]
    rows = slots.reshape(-1)
    if padded:
        pad = (pos < 0)[:, None, :, None]
        k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
    new = (k.reshape(-1, D), v.reshape(-1, D), pos[:, None, :].expand(slots.shape).reshape(-1))
    if ragged.concrete(rows):  # eager: one flat row index per token, half the indexing work of (page, row) pairs
        for pool, x in zip((k_pages, v_pages, page_pos), new):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, rows, x.to(pool.dtype))
        return
    at = (rows // P, rows % P)  # traced: (page, row) indices into the pools themselves, not a view of them (a
    # write through a view makes Inductor clone the whole pool every step)
    for pool, x in zip((k_pages, v_pages, page_pos), new):
        pool.index_put_(at, x.to(pool.dtype))


def compact(
    k_pages: Tensor, v_pages: Tensor, page_pos: Tensor, page_lw: Tensor, page_table: Tensor, keep_idx: Tensor,
    keep_count: Tensor,
) -> None:
    """Move each head's kept tokens to the front of its own pages, in place, K, V, positions and log-weights (when
    ``page_lw`` is not empty) together.

    page_table: [B, Hkv, MAXP]; keep_idx: [B, Hkv, K] logical token indices, ascending in the first
    ``keep_count[b, h]`` entries (the rest is ignored); keep_count: [B, Hkv]. After the call token j of head
    (b, h) is the token that was at ``keep_idx[b, h, j]``. Pages past the new length are left as they were;
    freeing them is the cache's job.
    """
    P, D = k_pages.shape[1], k_pages.shape[2]
    K = keep_idx.shape[-1]
    j = torch.arange(K, device=keep_idx.device)
    live = j < keep_count.unsqueeze(-1)
    src = rows_of(page_table, keep_idx.long(), P)[live]
    dst = rows_of(page_table, j.expand_as(keep_idx), P)[live]
    pools = (k_pages.view(-1, D), v_pages.view(-1, D), page_pos.view(-1, 1))
    for pool in pools + ((page_lw.view(-1, 1),) if page_lw.numel() else ()):
        pool.index_copy_(0, dst, pool[src])  # pool[src] is a copy, so overlapping src/dst are safe
