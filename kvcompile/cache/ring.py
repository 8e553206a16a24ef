"""The observation ring: each layer's most recent queries, kept for the scorers and decode policies that read them.

Layout (L layers, B rows, Hq query heads, C slots, D head dim)::

    queries   : [L, B, Hq, C, D]   post-RoPE queries; the query at position p sits in slot p mod C
    lse       : [L, B, Hq, C] fp32 the log-sum-exp of the attention that read each query, over what the heads held
                                   then, where the op computed it (NaN elsewhere: ``Observation.query_lse``)
    positions : [B, C] int64       the position held in each slot, -1 where a slot is empty

C, the capacity, follows what is read: min(window, tokens seen) while a prompt is observed, a decode policy's
window while generating, 0 (nothing allocated) when no method reads queries. The cache computes the slot of each
new query (``slots``) and records its position (``record``); the attention op writes the query itself into the
same slot, so both halves of a write come from one computation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class QueryRing(nn.Module):
    def __init__(self, num_layers: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        queries = torch.zeros(num_layers, 0, num_q_heads, 0, head_dim, dtype=dtype, device=device)
        self.register_buffer("queries", queries)
        self.register_buffer("lse", torch.zeros(num_layers, 0, num_q_heads, 0, device=device))
        self.register_buffer("positions", torch.full((0, 0), -1, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def setup(self, batch_size: int) -> None:
        """Empty, for ``batch_size`` rows, holding nothing."""
        L, _, Hq, _, D = self.queries.shape
        self.queries = self.queries.new_zeros(L, batch_size, Hq, 0, D)
        self.lse = self.lse.new_zeros(L, batch_size, Hq, 0)
        self.positions = self.positions.new_full((batch_size, 0), -1)

    def resize(self, capacity: int) -> None:
        """Keep each row's ``capacity`` newest queries, laid out for that capacity (0 releases the ring)."""
        if capacity == self.capacity:
            return
        L, B, Hq, C, D = self.queries.shape
        queries = self.queries.new_zeros(L, B, Hq, capacity, D)
        lse = self.lse.new_full((L, B, Hq, capacity), float("nan"))
        positions = self.positions.new_full((B, capacity), -1)
        if capacity and C:
            slot = self.slots(self.positions, capacity)  # [B, C]; `capacity` = dropped
            row, old = (slot < capacity).nonzero(as_tuple=True)
            positions[row, slot[row, old]] = self.positions[row, old]
            queries[:, row, :, slot[row, old]] = self.queries[:, row, :, old]
            lse[:, row, :, slot[row, old]] = self.lse[:, row, :, old]
        self.queries, self.lse, self.positions = queries, lse, positions

    def slots(self, q_pos: Tensor, capacity: int | None = None) -> Tensor:
        """Slot [B, T] of each new query (position mod C), or C (nowhere) for padding (-1) and for the queries that
        C newer ones of the same call push out. Slot s then always holds the newest query at a position = s (mod C)."""
        C = self.capacity if capacity is None else capacity
        if C == 0:
            return torch.zeros_like(q_pos)
        newest = q_pos.amax(-1, keepdim=True)
        kept = (q_pos >= 0) & (q_pos > newest - C)
        return torch.where(kept, q_pos % C, C)

    def record(self, q_pos: Tensor, slots: Tensor) -> None:
        """Write the positions of new queries (``q_pos``, ``slots`` [B, T] from ``slots``) into their slots; their
        log-sum-exp is unknown until an attention op that computes it writes it."""
        if self.capacity == 0:
            return
        if q_pos.shape[1] == 1:  # a decode step: one real query per row, in place, no host sync
            self.positions.scatter_(1, slots, q_pos)
            L, B, Hq, _ = self.lse.shape
            self.lse.scatter_(3, slots[None, :, None, :].expand(L, B, Hq, 1), float("nan"))
            return
        row, t = (slots < self.capacity).nonzero(as_tuple=True)
        self.positions[row, slots[row, t]] = q_pos[row, t]
        self.lse[:, row, :, slots[row, t]] = float("nan")

    def clear(self) -> None:
        """Forget every query but keep the capacity (a reconstruction pass fills the ring with its own queries)."""
        self.positions.fill_(-1)
        self.queries.zero_()
        self.lse.fill_(float("nan"))

    def forget_from(self, seen: Tensor) -> None:
        """Empty the slots of the queries at positions >= ``seen`` [B] (their tokens were taken back)."""
        if self.capacity:
            gone = self.positions >= seen[:, None]
            self.positions.masked_fill_(gone, -1)
            self.queries.masked_fill_(gone[None, :, None, :, None], 0)
            self.lse.masked_fill_(gone[None, :, None, :], float("nan"))
