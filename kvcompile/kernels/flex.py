"""Paged decode through ``torch.nn.attention.flex_attention``, so Inductor lowers it with its own templates (Triton
on CUDA, C++ on CPU) instead of our hand-written kernel.

The page pool is one long key sequence ([1, 1, N_pages * P, D]) and every (row, query head) is a flex head over it.
A ``BlockMask`` built from the page table says which 128-token flex blocks a head reads: page p of P = 16 tokens
lies in block (p * P) // 128, so one block covers 8 consecutive pool pages, which may belong to different heads;
within a block a ``mask_mod`` keeps the rows the head owns and holds (``owner``, ``index`` per pool page, from the
page table, built once per page-table change). A packed cache (each head's pages consecutive) reads about
held / 128 blocks per head; a shuffled one up to one block per page. Positions enter as a mask too: with a sliding
window, rows more than ``window`` positions behind the query are masked. The reference
(``reference.paged_attention``) is the oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .paging import per_page_table

BLOCK = 128  # flex_attention's default block size, in tokens


def page_block_mask(page_table: Tensor, lengths: Tensor, page_pos: Tensor, q_pos: Tensor, num_q_heads: int,
                    window: int = 0) -> BlockMask:
    """The ``BlockMask`` of one decode step: flex head b * Hq + r (row b, query head r) reads the pool rows that
    KV head r // G of row b holds. page_table [B, Hkv, W], lengths [B, Hkv], page_pos [N, P], q_pos [B, 1]. What
    follows from the page table alone (``_pool_blocks``) is built once per page-table change; a step adds only
    its lengths and query positions, read by ``mask_mod`` where they are."""
    B, Hkv, _ = page_table.shape
    N, P = page_pos.shape
    G = num_q_heads // Hkv
    owner, index, kv_num, kv_idx = per_page_table(page_table, ("flex", N, P, G),
                                                  lambda table: _pool_blocks(table, N, P, G))
    n = lengths.reshape(B * Hkv)
    positions = page_pos.reshape(N * P)
    query_at = q_pos.reshape(B).repeat_interleave(Hkv)  # [heads]

    def mask_mod(b, h, q_idx, kv_idx):
        head, page = h // G, kv_idx // P
        keep = (owner[page] == head) & (index[page] * P + kv_idx % P < n[head])
        if window > 0:
            keep = keep & (query_at[head] - positions[kv_idx] < window)
        return keep

    # no block is full (a block's rows may belong to other heads): every block goes through mask_mod. Inductor's CPU
    # template wants the full-block tensors even then, so they are given, empty. No backward: the q-side block
    # index (a sort over every block of the pool, 8 ms of a 9 ms call) is not built.
    return BlockMask.from_kv_blocks(kv_num, kv_idx, torch.zeros_like(kv_num), torch.zeros_like(kv_idx),
                                    BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(1, N * P),
                                    compute_q_blocks=False)


def _pool_blocks(page_table: Tensor, N: int, P: int, G: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per pool page, the head owning it (-1: none) and its page number in that head ([N] int32 each: kept per layer
    until the table changes); per flex head, the flex blocks holding its owned pages (a head may own pages ahead of
    its length: ``mask_mod`` masks them by length)."""
    B, Hkv, W = page_table.shape
    heads = B * Hkv
    table = page_table.reshape(heads, W).long()
    owned = table != 0  # page 0 is nobody's
    owner = torch.full((N,), -1, dtype=torch.int32, device=table.device)
    index = torch.zeros(N, dtype=torch.int32, device=table.device)
    owner[table[owned]] = torch.arange(heads, device=table.device, dtype=torch.int32)[:, None].expand(heads, W)[owned]
    index[table[owned]] = torch.arange(W, device=table.device, dtype=torch.int32).expand(heads, W)[owned]
    none = torch.iinfo(torch.long).max
    blocks = torch.where(owned, table * P // BLOCK, none).sort(-1).values  # [heads, W]
    repeat = torch.cat([torch.zeros_like(blocks[:, :1], dtype=torch.bool), blocks[:, 1:] == blocks[:, :-1]], 1)
    unique = torch.where(repeat, none, blocks).sort(-1).values
    count = (unique < none).sum(-1)
    unique = torch.where(unique < none, unique, 0)
    # a BlockMask's index rows span every kv block of the sequence (its dense form is that wide)
    width = -(-N * P // BLOCK)
    unique = torch.nn.functional.pad(unique, (0, max(0, width - unique.shape[1])))[:, :width]
    # every query head of a KV head reads its blocks: [1, B * Hq, 1 query block, ...]
    return (owner, index, count.repeat_interleave(G)[None, :, None].int(),
            unique.repeat_interleave(G, 0)[None, :, None, :].int())


def flex_paged_decode(q: Tensor, q_pos: Tensor, k_pages: Tensor, v_pages: Tensor, page_pos: Tensor,
                      page_table: Tensor, lengths: Tensor, scale: float, window: int = 0,
                      attend=flex_attention, log_weights: Tensor | None = None) -> Tensor:
    """One decode query per row, q [B, Hq, 1, D], over each KV head's pages -> [B, Hq, 1, D] (zeros for an empty
    head), as ``reference.paged_attention`` computes it. ``attend``: ``flex_attention`` or a compiled version.
    ``log_weights`` [N, P] (entries standing for several tokens; empty or None: plain tokens) enter as a
    ``score_mod`` adding each pool row's log-weight to its logit. The pool is read in place (flex takes a key
    length that ends mid-block)."""
    B, Hq, _, D = q.shape
    N, P = page_pos.shape
    mask = page_block_mask(page_table, lengths, page_pos, q_pos, Hq, window)
    keys, values = (x.reshape(1, 1, N * P, D) for x in (k_pages, v_pages))
    weighted = log_weights is not None and log_weights.shape[0] > 0
    lw = log_weights.reshape(-1).float() if weighted else None

    def add_log_weight(score, b, h, q_idx, kv_idx):
        return score + lw[kv_idx]
    out = attend(q.reshape(1, B * Hq, 1, D), keys.to(q.dtype), values.to(q.dtype), block_mask=mask, scale=scale,
                 score_mod=add_log_weight if weighted else None, enable_gqa=True)
    empty = (lengths == 0).repeat_interleave(Hq // lengths.shape[1], 1)  # a head that holds nothing attends to zeros
    return out.reshape(B, Hq, 1, D).masked_fill(empty[..., None, None], 0.0)
