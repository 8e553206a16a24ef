"""Paged decode through ``torch.nn.attention.flex_attention``, so Inductor lowers it with its own templates (Triton
on CUDA, C++ on CPU) instead of our hand-written kernel.

The page pool is one long key sequence ([1, 1, N_pages * P, D]) and every (row, query head) is a flex head over it.
A ``BlockMask`` built from the page table says which 128-token flex blocks a head reads: page p of P = 16 tokens
lies in block (p * P) // 128, so one block covers 8 consecutive pool pages, which may belong to different heads;
within a block a ``mask_mod`` keeps the rows the head owns and holds (``owner``, ``index`` per pool row, from the
page table). A packed cache (each head's pages consecutive) reads about held / 128 blocks per head; a shuffled one
up to one block per page. Positions enter as a mask too: with a sliding window, rows more than ``window`` positions
behind the query are masked. The reference (``reference.paged_attention``) is the oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # flex_attention's default block size, in tokens


def page_block_mask(page_table: Tensor, lengths: Tensor, page_pos: Tensor, q_pos: Tensor, num_q_heads: int,
                    pool_rows: int, window: int = 0) -> BlockMask:
    """The ``BlockMask`` of one decode step: flex head b * Hq + r (row b, query head r) reads the pool rows that
    KV head r // G of row b holds. page_table [B, Hkv, W], lengths [B, Hkv], page_pos [N, P], q_pos [B, 1]."""
    B, Hkv, W = page_table.shape
    P = page_pos.shape[1]
    G = num_q_heads // Hkv
    heads = B * Hkv
    table = page_table.reshape(heads, W).long()
    n = lengths.reshape(heads).long()
    used = torch.arange(W, device=table.device) < ((n + P - 1) // P)[:, None]  # [heads, W] pages holding tokens
    rows = table[:, :, None] * P + torch.arange(P, device=table.device)  # [heads, W, P] pool rows
    owner = torch.full((pool_rows,), -1, dtype=torch.long, device=table.device)
    index = torch.zeros(pool_rows, dtype=torch.long, device=table.device)
    held = used[:, :, None].expand_as(rows).reshape(-1)
    owner[rows.reshape(-1)[held]] = torch.arange(heads, device=table.device).repeat_interleave(W * P)[held]
    index[rows.reshape(-1)[held]] = torch.arange(W * P, device=table.device).repeat(heads)[held]
    positions = torch.nn.functional.pad(page_pos.reshape(-1).long(), (0, pool_rows - page_pos.numel()))
    query_at = q_pos.reshape(B).long().repeat_interleave(Hkv)  # [heads]

    def mask_mod(b, h, q_idx, kv_idx):
        head = h // G
        keep = (owner[kv_idx] == head) & (index[kv_idx] < n[head])
        if window > 0:
            keep = keep & (query_at[head] - positions[kv_idx] < window)
        return keep

    blocks = torch.where(used, table * P // BLOCK, torch.iinfo(torch.long).max)  # [heads, W]
    blocks = blocks.sort(-1).values
    repeat = torch.cat([torch.zeros_like(blocks[:, :1], dtype=torch.bool), blocks[:, 1:] == blocks[:, :-1]], 1)
    unique = torch.where(repeat, torch.iinfo(torch.long).max, blocks).sort(-1).values
    count = (unique < torch.iinfo(torch.long).max).sum(-1)
    unique = torch.where(unique < torch.iinfo(torch.long).max, unique, 0)
    # a BlockMask's index rows span every kv block of the sequence (its dense form is that wide)
    unique = torch.nn.functional.pad(unique, (0, pool_rows // BLOCK - unique.shape[1]))[:, : pool_rows // BLOCK]
    # every query head of a KV head reads its blocks: [1, B * Hq, 1 query block, ...]
    kv_num = count.repeat_interleave(G)[None, :, None].int()
    kv_idx = unique.repeat_interleave(G, 0)[None, :, None, :].int()
    # no block is full (a block's rows may belong to other heads): every block goes through mask_mod. Inductor's CPU
    # template wants the full-block tensors even then, so they are given, empty.
    return BlockMask.from_kv_blocks(kv_num, kv_idx, torch.zeros_like(kv_num), torch.zeros_like(kv_idx),
                                    BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(1, pool_rows))


def flex_paged_decode(q: Tensor, q_pos: Tensor, k_pages: Tensor, v_pages: Tensor, page_pos: Tensor,
                      page_table: Tensor, lengths: Tensor, scale: float, window: int = 0,
                      attend=flex_attention, log_weights: Tensor | None = None) -> Tensor:
    """One decode query per row, q [B, Hq, 1, D], over each KV head's pages -> [B, Hq, 1, D] (zeros for an empty
    head), as ``reference.paged_attention`` computes it. ``attend``: ``flex_attention`` or a compiled version.
    ``log_weights`` [N, P] (entries standing for several tokens; empty or None: plain tokens) enter as a
    ``score_mod`` adding each pool row's log-weight to its logit."""
    B, Hq, _, D = q.shape
    N, P = page_pos.shape
    rows = -(-N * P // BLOCK) * BLOCK  # flex reads whole blocks: a pool that ends mid-block is padded (a copy)
    mask = page_block_mask(page_table, lengths, page_pos, q_pos, Hq, rows, window)
    keys, values = (x.reshape(N * P, D) for x in (k_pages, v_pages))
    if rows > N * P:
        keys, values = (torch.nn.functional.pad(x, (0, 0, 0, rows - N * P)) for x in (keys, values))
    keys, values = keys.view(1, 1, rows, D), values.view(1, 1, rows, D)
    weighted = log_weights is not None and log_weights.shape[0] > 0
    lw = torch.nn.functional.pad(log_weights.reshape(-1).float(), (0, rows - N * P)) if weighted else None

    def add_log_weight(score, b, h, q_idx, kv_idx):
        return score + lw[kv_idx]
    out = attend(q.reshape(1, B * Hq, 1, D), keys.to(q.dtype), values.to(q.dtype), block_mask=mask, scale=scale,
                 score_mod=add_log_weight if weighted else None, enable_gqa=True)
    empty = (lengths == 0).repeat_interleave(Hq // lengths.shape[1], 1)  # a head that holds nothing attends to zeros
    return out.reshape(B, Hq, 1, D).masked_fill(empty[..., None, None], 0.0)
