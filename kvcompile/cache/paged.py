"""The ragged per-head paged KV cache, and the only writer of its own state.

Layout (shape letters: L layers, B batch rows, Hkv KV heads, P page size, D head dim)::

    k_pages, v_pages : [N, P, D]             one pool for all layers; a page holds P tokens of ONE (layer, b, h)
    page_pos         : [N, P] int32          original sequence position of each stored token
    page_lw          : [N, P] float32        log-weight of each stored entry ([0, P] unless ``weighted``: ``weights``)
    page_table       : [L, B, Hkv, W] int32  logical page i of head (l, b, h) -> physical page (W >= 2)
    lengths          : [L, B, Hkv] int32     tokens head (l, b, h) holds
    n_pages          : [L, B, Hkv] int64     pages head (l, b, h) owns (its length's pages plus reserved room)
    seen             : [B] int64             tokens row b has read: the position of its next token
    token_ids        : [B, C] int64          the token read at each position (``keep_ids`` only; C >= seen)
    segment_starts   : [B, K] int64          where the caller's segments start (``mark_segments``; -1 = none)
    ring             : ``QueryRing``         the last queries of each layer (``cache.ring``)
    fmt_*            : the format pool       entries stored in the cache's ``page_format`` (``formatted``)

Token j of head (l, b, h) sits at row j % P of page ``page_table[l, b, h, j // P]``; ``kernels.reference`` has
the loop that rebuilds dense keys from this. Page 0 is scratch: padding writes zeros there, and page-table slots
past a head's pages point at it.

Isolation: every pool row that does not hold a token is zero (new pages are zeroed, the rows past a head's length
are zeroed when it shrinks, padding writes zeros), so attention that reads a whole page under a mask multiplies
zeros, never what another row or an earlier request left behind.

The cache changes its state only through its own methods: ``setup`` (a new request), ``append`` (make room for a
step and say where its tokens go; the program writes them), ``keep`` (apply a compression ``Plan``), ``drop_from``
and ``rewind`` (take tokens back), ``reserve`` / ``provision`` / ``trim`` (pages). With a ``page_format``, a head's
entries are its format entries then its model-dtype ones (``held``, ``dense``), and ``keep`` stores what a plan puts
in the format. ``stats`` reports every byte it allocates (``tensors`` names each tensor and what it is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import ops
from ..kernels import reference
from ..plan import NewEntries, Plan, padded
from ..signature import CACHE_NAMES
from .accounting import ByteAccounting
from .formatted import FORMAT_TENSORS, FormatPool
from .pages import MIN_WIDTH, PagePool
from .ring import QueryRing
from .weights import WeightChannel


@dataclass
class Step:
    """Where one call's new tokens go (``PagedKVCache.append``): position_ids, q_pos [B, T] (q_pos is -1 for
    padding), slots [L, B, Hkv, T] pool rows, ring_slots [B, T] observation-ring slots."""

    position_ids: Tensor
    q_pos: Tensor
    slots: Tensor
    ring_slots: Tensor


class PagedKVCache(PagePool, WeightChannel, FormatPool, ByteAccounting, nn.Module):
    def __init__(
        self, num_layers: int, num_kv_heads: int, num_q_heads: int, head_dim: int, *,
        dtype: torch.dtype = torch.float32, page_size: int = 16, device: torch.device | str = "cpu",
        keep_ids: bool = False, page_format: str | None = None, weighted: bool = False, basis: Tensor | None = None,
    ):
        super().__init__()
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_format = None
        self.num_layers, self.num_kv_heads, self.num_q_heads = num_layers, num_kv_heads, num_q_heads
        self.head_dim, self.page_size = head_dim, page_size
        dev = torch.device(device)
        L, Hkv, P, D = num_layers, num_kv_heads, page_size, head_dim
        self.register_buffer("k_pages", torch.zeros(1, P, D, dtype=dtype, device=dev))
        self.register_buffer("v_pages", torch.zeros(1, P, D, dtype=dtype, device=dev))
        self.register_buffer("page_pos", torch.zeros(1, P, dtype=torch.int32, device=dev))
        self.weighted = weighted  # the recipe writes weighted entries: a log-weight channel beside page_pos
        self.register_buffer("page_lw", torch.zeros(1 if weighted else 0, P, device=dev))
        self.register_buffer("page_table", torch.zeros(L, 0, Hkv, MIN_WIDTH, dtype=torch.int32, device=dev))
        self.register_buffer("lengths", torch.zeros(L, 0, Hkv, dtype=torch.int32, device=dev))
        self.register_buffer("n_pages", torch.zeros(L, 0, Hkv, dtype=torch.int64, device=dev))
        self.register_buffer("seen", torch.zeros(0, dtype=torch.int64, device=dev))
        self.register_buffer("token_ids", torch.zeros(0, 0, dtype=torch.int64, device=dev))
        self.register_buffer("segment_starts", torch.zeros(0, 0, dtype=torch.int64, device=dev))
        for name in FORMAT_TENSORS:
            self.register_buffer(name, torch.zeros(0, device=dev))
        self._empty_format_pool(0)
        self.set_format(page_format, basis)  # an unknown name or a head dim it cannot pack raises here
        self.keep_ids = keep_ids  # a method reads the token id of each held entry (``ContextTokens``)
        self.ring = QueryRing(num_layers, num_q_heads, head_dim, dtype, dev)
        self.room = 0  # tokens every head can still take without reserving pages (a host count)
        self.appended = 0  # tokens any row appended since the last ``keep``, at most (a host count: T per step)
        self.peaks: dict[str, int] = {}
        self._packed_for: tuple = (lambda: None, -1, False)  # ``packed``'s answer, and for which page table

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]

    # ------------------------------------------------------------------ lifecycle
    def setup(self, batch_size: int) -> None:
        """Empty the cache for ``batch_size`` rows and give back its pool: nothing of an earlier request remains."""
        L, Hkv, P, D = self.num_layers, self.num_kv_heads, self.page_size, self.head_dim
        self.k_pages, self.v_pages = self.k_pages.new_zeros(1, P, D), self.v_pages.new_zeros(1, P, D)
        self.page_pos = self.page_pos.new_zeros(1, P)
        self._empty_weights(1)
        self.page_table = self.page_table.new_zeros(L, batch_size, Hkv, MIN_WIDTH)
        self.lengths = self.lengths.new_zeros(L, batch_size, Hkv)
        self.n_pages = self.n_pages.new_zeros(L, batch_size, Hkv)
        self.seen = self.seen.new_zeros(batch_size)
        self.token_ids, self.logged = self.token_ids.new_zeros(batch_size, 0), 0
        self.segment_starts = self.segment_starts.new_zeros(batch_size, 0)
        self.ring.setup(batch_size)
        self._empty_format_pool(batch_size)
        self.room, self.peaks, self.appended = 0, {}, 0

    # ------------------------------------------------------------------ steps
    def append(self, real: Tensor, observe: int = 0, reserve_ahead: int = 0, ids: Tensor | None = None) -> Step:
        """Take a step of T tokens per row (``real`` [B, T] marks the non-pad ones): reserve pages when the room is
        short (a decode step: at least ``reserve_ahead`` tokens at a time), size the ring for ``observe`` queries
        (at most the queries it has been given), bump lengths and ``seen``, and return where the program writes the
        new tokens."""
        T, n_new = real.shape[1], real.sum(1)
        if T > 1:
            self.reserve(n_new)
        elif self.room < 1:
            self.reserve(max(1, reserve_ahead))
        pos = self.seen[:, None] + real.long().cumsum(1) - 1
        q_pos = pos.masked_fill(~real, -1)
        if self.keep_ids:
            self._log_ids(ids, q_pos)
        self.seen = self.seen + n_new
        C = self.ring.capacity
        if observe != C:  # the ring grows by the queries it is given, up to the window
            self.ring.resize(min(observe, C + T))
        ring_slots = self.ring.slots(q_pos)
        self.ring.record(q_pos, ring_slots)
        rank = real.long().cumsum(-1) - 1  # [B, T]: real token t is token lengths + rank of each of its row's heads
        j = self.lengths.long()[..., None] + rank[None, :, None, :]
        rows = reference.rows_of(self.page_table, j.clamp_min(0), self.page_size)
        slots = torch.where(real[None, :, None, :], rows, 0)
        self.lengths += n_new.to(torch.int32)[None, :, None]
        self.room, self.appended = max(self.room - T, 0), self.appended + T
        return Step(pos.clamp_min(0), q_pos, slots, ring_slots)

    def append_entries(self, keys: Tensor, values: Tensor) -> None:
        """Append the entries ``keys``, ``values`` [L, B, Hkv, n, D] (computed outside the programs: a restore pass)
        to every head as the next n tokens of each row; no query of theirs is observed."""
        start, before = self.seen.clone(), self.lengths.clone()
        step = self.append(torch.ones(self.batch_size, keys.shape[-2], dtype=torch.bool, device=self.device))
        positions = step.position_ids[None, :, None].expand(*keys.shape[:-1])
        self._write_new(before, NewEntries(keys, values, positions, torch.full_like(before, keys.shape[-2])))
        self.ring.forget_from(start)

    def _log_ids(self, ids: Tensor, q_pos: Tensor) -> None:
        """Write the step's token ids at their positions; the log grows by doubling, sized by an upper bound of
        the positions (``logged``: every row advances at most T per step)."""
        self.logged += q_pos.shape[1]
        width = self.token_ids.shape[1]
        if self.logged > width:
            grown = self.token_ids.new_zeros(self.batch_size, max(self.logged, 2 * width))
            grown[:, :width] = self.token_ids
            self.token_ids = grown
        if q_pos.shape[1] == 1:  # a decode step: every row real, no host sync
            self.token_ids.scatter_(1, q_pos, ids.to(self.device))
            return
        row, t = (q_pos >= 0).nonzero(as_tuple=True)
        self.token_ids[row, q_pos[row, t]] = ids.to(self.device)[row, t]

    def mark_segments(self, starts: Tensor) -> None:
        """Record segment starts [B, K] given relative to each row's next token (``seen``; -1 = none): the tokens
        the next step appends are split there (``segments``)."""
        starts = starts.to(self.device)
        absolute = torch.where(starts >= 0, starts + self.seen[:, None], -1)
        self.segment_starts = torch.cat([self.segment_starts, absolute], 1)

    def observe(self, window: int, exact: bool = False) -> None:
        """Keep at most ``window`` queries in the ring (0 releases it): what the methods that read queries still
        need; ``exact``: make room for exactly ``window`` (a decode policy's window, filled as it decodes)."""
        self.ring.resize(window if exact else min(window, self.ring.capacity))
        self._note()

    # ------------------------------------------------------------------ compression
    def keep(self, plan: Plan, shrink: bool = True) -> None:
        """Apply ``plan``: move each head's kept entries to the front of its pages (``ops.compact``), write its new
        entries after them, zero what is past the new lengths, give up the pages no longer needed and, with
        ``shrink``, shrink the pool to what is owned (a decode-time schedule keeps its pool for the next tokens).
        Entries the plan puts in the page format go to a new format pool first (``FormatPool._keep_formatted``)."""
        if plan.new is not None and bool((plan.new.log_weights != 0).any()):
            if not self.weighted:
                raise ValueError("the plan writes weighted entries, but this cache has no weight channel "
                                 "(PagedKVCache(weighted=True))")
            if plan.formats is not None:
                raise NotImplementedError("weighted entries live in the model-dtype pool only; the plan stores them "
                                          f"in {self.page_format} pages")
        self._note(held=True)
        if plan.formats is not None or self.format_used:
            plan = self._keep_formatted(plan)
        L, B, Hkv = plan.counts.shape
        flat = (L * B, Hkv)
        ops.compact(self.k_pages, self.v_pages, self.page_pos, self.page_lw, self.page_table.reshape(*flat, -1),
                    plan.keep.reshape(*flat, -1), plan.counts.reshape(flat))
        if plan.new is not None:
            self._write_new(plan.counts, plan.new)
        self.lengths = plan.lengths.to(torch.int32)
        self._zero_past_lengths()
        self.release_unused()
        if shrink:
            self.trim()
        self.appended = 0
        self._note(held=True)

    def drop_from(self, seen: Tensor) -> None:
        """Forget every held token at position >= ``seen`` [B] and rewind to it (what a ``Reconstruction``
        source's prompt appended). Kept tokens are in position order, so those are each head's tail."""
        views = map(self.dense, range(self.num_layers))
        counts = torch.stack([(valid & (pos < seen[:, None, None])).sum(-1) for *_, pos, valid in views])
        keep = torch.arange(max(int(counts.max()), 1), device=self.device).expand(*counts.shape, -1)
        self.keep(Plan(keep, counts))
        self.seen = seen.clone()
        self.ring.clear()

    def _write_new(self, counts: Tensor, new) -> None:
        """Write ``new``'s entries at logical indices counts, counts + 1, ... of each head (pages must be owned)."""
        E = new.positions.shape[-1]
        index = counts.long()[..., None] + torch.arange(E, device=self.device)  # [L, B, Hkv, E]
        where = (torch.arange(E, device=self.device) < new.counts[..., None]).reshape(-1)
        L, B, Hkv = counts.shape
        rows = reference.rows_of(self.page_table.reshape(L * B, Hkv, -1), index.reshape(L * B, Hkv, E), self.page_size)
        rows, D = rows.reshape(-1)[where], self.head_dim
        self.k_pages.view(-1, D).index_copy_(0, rows, new.keys.reshape(-1, D)[where].to(self.dtype))
        self.v_pages.view(-1, D).index_copy_(0, rows, new.values.reshape(-1, D)[where].to(self.dtype))
        self.page_pos.view(-1).index_copy_(0, rows, new.positions.reshape(-1)[where].to(self.page_pos.dtype))
        if self.weighted:
            self.page_lw.view(-1).index_copy_(0, rows, new.log_weights.reshape(-1)[where].float())

    def rewind(self, seen: Tensor) -> None:
        """Forget the tokens at positions >= ``seen`` [B] (speculative decoding's rejected drafts): as ``drop_from``,
        but they must have been appended since the last ``keep``, so they are each head's tail and nothing is
        compacted: lengths go back, the emptied rows are zeroed, their pages stay owned as room."""
        drop = self.seen - seen.to(self.seen)
        low, high = drop.aminmax()
        if int(low) < 0 or int(high) > self.appended:
            raise ValueError(f"rewind forgets only tokens appended since the last compression ({self.appended} at "
                             f"most), not {int(high)}, nor tokens not yet read ({-int(low)})")
        lengths = self.lengths - drop.to(torch.int32)[None, :, None]
        self._zero_entries(lengths, self.lengths, int(high))
        self.lengths, self.seen = lengths, seen.to(self.seen).clone()
        self.ring.forget_from(self.seen)
        self.appended -= int(low)

    def _zero_past_lengths(self) -> None:
        """Zero the rows past each head's length in its last held page (the isolation invariant)."""
        self._zero_entries(self.lengths, self.pages_held() * self.page_size, self.page_size)

    def _zero_entries(self, start: Tensor, stop: Tensor, width: int) -> None:
        """Zero the pool rows of each head's logical entries ``start <= j < stop`` ([L, B, Hkv], at most ``width``
        apart) in pages it owns: a row that holds no token is zero."""
        P = self.page_size
        j = start.long()[..., None] + torch.arange(width, device=self.device)  # [L, B, Hkv, width]
        inside = j < stop[..., None]
        rows = reference.rows_of(self.page_table, j.clamp_max(self.page_table.shape[-1] * P - 1), P)[inside]
        for pool in (getattr(self, name) for name in self.row_pools()):
            pool.view(-1, *pool.shape[2:]).index_fill_(0, rows, 0)

    def rewrite(self, layer: int, keys: Tensor | None = None, values: Tensor | None = None,
                positions: Tensor | None = None) -> None:
        """Write back, in place, what layer ``layer`` holds from dense views shaped as ``dense``'s (keys, values
        [B, Hkv, S, D], positions [B, Hkv, S]); ``None`` leaves that part as it is. Entries past a head's length are
        ignored (a calibration's perturbation, key re-rotation)."""
        if self.format_used:
            raise NotImplementedError("rewriting entries stored in a page format is not supported")
        lengths = self.lengths[layer]
        S = next(x for x in (keys, values, positions) if x is not None).shape[2]
        index = torch.arange(S, device=self.device).expand(*lengths.shape, S)
        valid = index < lengths[..., None]
        rows = reference.rows_of(self.page_table[layer], index, self.page_size)[valid]
        for pool, new in ((self.k_pages, keys), (self.v_pages, values), (self.page_pos, positions)):
            if new is not None:
                flat = pool.view(-1, self.head_dim) if pool.dim() == 3 else pool.view(-1)
                flat.index_copy_(0, rows, new[valid].to(pool.dtype))

    def fold_evicted(self, plan: Plan, merge) -> None:
        """Before ``plan`` applies, fold what it evicts into what it keeps: each layer's values become what
        ``merge(layer, keys, values, valid, kept)`` returns (dense views as ``dense``'s, ``kept`` [B, Hkv, S]; None
        leaves them); keys and positions stay. The one merging path of a compression and of a decode schedule."""
        kept = plan.kept(int(self.held().max()))
        for layer in range(self.num_layers):
            keys, values, _, valid = self.dense(layer)
            merged = merge(layer, keys, values, valid, padded(kept[layer], keys.shape[2]))
            if merged is not None:
                self.rewrite(layer, values=merged)

    # ------------------------------------------------------------------ reads
    def dense(self, layer: int):
        """Dense views of one layer, format entries decoded first: keys, values [B, Hkv, S, D] (the model's
        dtype), positions [B, Hkv, S], valid [B, Hkv, S] (each head's ``held`` entries, then padding)."""
        return self._logical(layer, reference.gather_dense(self.k_pages, self.v_pages, self.page_pos,
                                                           self.page_table[layer], self.lengths[layer]))

    def program_tensors(self) -> tuple[Tensor, ...]:
        """The tensors a program reads and writes, named and ordered by the calling convention
        (``signature.CACHE_NAMES``; ``obs_q`` and ``obs_lse`` are the observation ring's queries and their
        log-sum-exps)."""
        ring = {"obs_q": self.ring.queries, "obs_lse": self.ring.lse}
        return tuple(ring[name] if name in ring else getattr(self, name) for name in CACHE_NAMES)
