"""The method contract: a Scorer ranks tokens within a head, an Allocator decides how many each head keeps.

Both are small dataclasses whose fields are hyperparameters; runtime state lives in the cache. Neither touches
the model or the cache: the compressor hands them tensors and does top-k selection and compaction itself.
Shape letters: L layers, B batch rows, Hq/Hkv query/KV heads, S tokens held, W observed queries, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from .sources import (  # noqa: F401  (the sources a method declares, importable from here)
    ContextTokens,
    ExtraPass,
    Gradients,
    HiddenStates,
    LayerWeights,
    ProbeInputNorms,
    QueryWindow,
    Question,
    Reconstruction,
    Restore,
    Segments,
    Source,
)

SCORERS: dict[str, type] = {}
SPAN_QUERIES = 64  # a block of this many observed queries or more attends over only the span of keys it sees
ALLOCATORS: dict[str, type] = {}


def _registrar(table: dict[str, type]):
    def register(name: str):
        def deco(cls):
            table[name] = cls
            cls.name = name
            return cls

        return deco

    return register


register_scorer = _registrar(SCORERS)
register_allocator = _registrar(ALLOCATORS)


@dataclass
class Observation:
    """What prefill already has for one layer, as dense per-head views of the cache.

    keys, values: [B, Hkv, S, D] post-RoPE; positions: [B, Hkv, S] original positions; valid: [B, Hkv, S];
    queries: [B, Hq, W, D] the layer's last W queries (post-RoPE), in ring order (query p sits in slot p mod W: read
    ``query_positions``, not the slot order); query_positions: [B, W], -1 where there was no query (short prompt,
    padding); scale: the layer's softmax scale; window: its sliding window (0 = none); token_ids, weights: what the
    ``ContextTokens`` and ``LayerWeights`` sources supply (None / empty unless the method declares them), and in
    ``weights["inv_freq"]`` the layer's RoPE inverse frequencies whenever kvcompile can read them (``methods.rope``);
    log_weights: [B, Hkv, S] each entry's log-weight (``cache.weights``; None: every entry is one token);
    segments: [B, P] the segment index of every position read (P = the most any row read; ``Segments``; None when
    the caller gave no segments: one segment); query_gradients: [B, W] per window slot, the norm of the gradient of
    the model's output with respect to that query's attention output (the ``Gradients`` source,
    ``kvcompile.gradients``; None unless declared); hidden: [B, Hkv, S, hidden] each held entry's attention input
    (the ``HiddenStates`` source, ``kvcompile.attention_inputs``; None unless declared); query_input_norms: [B, W] per
    window slot, the norm of that query's attention input (``ProbeInputNorms``; None unless declared; 0 where there
    was no query); query_lse: [B, Hq, W] per window slot, the log-sum-exp of the attention that read that query, over
    what the heads held then (``cache.QueryRing``; NaN where the attention op did not compute it).
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    valid: Tensor
    queries: Tensor
    query_positions: Tensor
    scale: float
    window: int
    layer: int
    num_layers: int
    token_ids: Tensor | None = None
    weights: dict = field(default_factory=dict)
    log_weights: Tensor | None = None
    segments: Tensor | None = None
    query_gradients: Tensor | None = None
    hidden: Tensor | None = None
    query_input_norms: Tensor | None = None
    query_lse: Tensor | None = None

    def first_query(self) -> Tensor:
        """[B] the position of each row's first observed query (2**62 for a row with none): the window's queries,
        and the tokens a ``Reconstruction`` prompt appended, begin there."""
        return self.query_positions.masked_fill(self.query_positions < 0, 2**62).amin(-1)

    def window_attention(self, queries: slice = slice(None), chunk: int = 0) -> Tensor:
        """Softmax attention of the observed queries over the held keys: [B, Hq, W, S] (0 where not visible); an
        entry standing for w tokens (``log_weights``) draws the attention of w tokens with its key.

        ``queries`` picks a slice of the window ([B, Hq, w, S]), so a scorer that reads many queries can go block by
        block and never hold a W x S tensor. ``chunk > 0``: non-causal attention within position chunks of that
        size (query and key in the same chunk) instead of causal attention."""
        attn, keys = self.attention_span(queries, chunk)
        attn = attn.flatten(1, 2)
        S = self.keys.shape[2]
        if keys == slice(0, S):
            return attn
        full = attn.new_zeros(*attn.shape[:-1], S)
        full[..., keys] = attn
        return full

    def attention_span(self, queries: slice, chunk: int = 0, buffer: Tensor | None = None) -> tuple[Tensor, slice]:
        """``window_attention`` over only the span of held slots the queries may see: attention [B, Hkv, G, w, s]
        and the span (a slice of S). A block of early queries under causal attention stops at the last key it
        reads, so a scorer that sums or maxes over every query of a long prompt does half the work. The span is
        searched (a few reads of the device) for blocks of ``SPAN_QUERIES`` queries or more; a smaller window (a
        decode-time schedule's) reads every held slot. ``buffer``: a flat fp32 tensor the attention is written
        into (reused across blocks: no new memory per block)."""
        search = self.queries[:, :, queries].shape[2] >= SPAN_QUERIES
        keys = self._seen_keys(queries, chunk) if search else slice(0, self.keys.shape[2])
        logits, every_row_sees = self._logits(queries, keys, chunk, buffer, search)
        attn = torch.ops.aten._softmax.out(logits, -1, False, out=logits)  # in place: each row read, then written
        return (attn if every_row_sees else attn.nan_to_num_(0.0)), keys

    def received_attention(self, block: int, chunk: int = 0) -> Tensor:
        """[B, Hq, S] attention each held key received, summed over every observed query, ``block`` queries at a
        time (so no W x S tensor exists); ``chunk`` as in ``window_attention``."""
        B, Hkv, S, _ = self.keys.shape
        Hq = self.queries.shape[1]
        total = torch.zeros(B, Hkv, Hq // Hkv, S, device=self.keys.device)
        buffer = self.block_buffer(block)
        for queries in self.query_blocks(block):
            attn, keys = self.attention_span(queries, chunk, buffer)
            total[..., keys] += attn.sum(3)
        return total.flatten(1, 2)

    def block_buffer(self, block: int) -> Tensor:
        """A flat fp32 buffer that holds ``attention_span`` of any block of ``block`` observed queries."""
        B, Hq, W, _ = self.queries.shape
        return torch.empty(B * Hq * min(block, W) * self.keys.shape[2], device=self.keys.device)

    def _seen_keys(self, queries: slice, chunk: int) -> slice:
        """The span of held slots any query of ``queries`` may see (by position: a superset of what each sees)."""
        qp = self.query_positions[:, queries]
        real = qp >= 0
        if not bool(real.any()):
            return slice(0, 0)
        first, last = self._query_range(qp)
        kp = self.positions
        if chunk > 0:
            seen = (kp // chunk >= first // chunk) & (kp // chunk <= last // chunk)
        else:
            seen = (kp <= last) & ((kp > first - self.window) if self.window > 0 else True)
        idx = (seen & self.valid).flatten(0, 1).any(0).nonzero()
        return slice(int(idx[0]), int(idx[-1]) + 1) if idx.numel() else slice(0, 0)

    @staticmethod
    def _query_range(qp: Tensor) -> tuple[Tensor, Tensor]:
        """The first and last real query position of each row, [B, 1, 1] each."""
        real = qp >= 0
        first = qp.masked_fill(~real, 2**62).amin(-1)[:, None, None]
        return first, qp.masked_fill(~real, -1).amax(-1)[:, None, None]

    def _logits(self, queries: slice, keys: slice, chunk: int, buffer: Tensor | None,
                search: bool) -> tuple[Tensor, bool]:
        """[B, Hkv, G, w, s] scaled logits of the queries ``queries`` over the held slots ``keys``, -inf where a
        query does not see a key, and whether every query row sees some key (no row is all -inf). ``search``: the
        mask is applied only to the slots some query of the block does not see (under causal attention, the
        diagonal)."""
        B, Hkv, _, D = self.keys.shape
        q = self.queries[:, :, queries]
        G, w, s = q.shape[1] // Hkv, q.shape[2], keys.stop - keys.start
        out = None if buffer is None else buffer[: B * Hkv * G * w * s].view(B, Hkv, G * w, s)
        q = q.reshape(B, Hkv, G * w, D).float() * self.scale  # scaled before the product: w x D, not w x s
        logits = torch.matmul(q, self.keys[:, :, keys].float().transpose(-1, -2), out=out)
        logits = logits.view(B, Hkv, G, w, s)
        if self.log_weights is not None:
            logits += self.log_weights[:, :, None, None, keys]
        qp = self.query_positions[:, queries]
        masked, every_row_sees = keys, False
        if search and chunk == 0 and bool((qp >= 0).all()):  # the slots every query sees need no mask
            first, last = self._query_range(qp)
            kp = self.positions[:, :, keys]
            always = self.valid[:, :, keys] & (kp <= first) & ((kp > last - self.window) if self.window > 0 else True)
            partly = (~always).flatten(0, 1).any(0).nonzero()
            every_row_sees = s > 0 and bool(always.flatten(0, 1).all(0).any())
            if partly.numel() == 0:
                return logits, every_row_sees
            masked = slice(keys.start + int(partly[0]), keys.start + int(partly[-1]) + 1)
        qp = qp[:, None, None, :, None]
        kp = self.positions[:, :, None, None, masked]
        order = (qp // chunk == kp // chunk) if chunk > 0 else (kp <= qp)
        visible = self.valid[:, :, None, None, masked] & order & (qp >= 0)
        if self.window > 0:
            visible = visible & (qp - kp < self.window)
        logits[..., masked.start - keys.start : masked.stop - keys.start].masked_fill_(~visible, float("-inf"))
        return logits, every_row_sees

    def query_blocks(self, block: int) -> list[slice]:
        """Slices of at most ``block`` window slots that cover every real observed query, skipping empty blocks."""
        real = (self.query_positions >= 0).any(0)
        W = real.numel()
        has = torch.nn.functional.pad(real, (0, -W % block)).view(-1, block).any(1).tolist()
        return [slice(i * block, (i + 1) * block) for i, any_real in enumerate(has) if any_real]


class Scorer:
    """Per-token importance within each KV head."""

    def score(self, obs: Observation) -> Tensor:
        """Return [B, Hkv, S] scores; higher scores are kept. Invalid positions are ignored by the caller."""
        raise NotImplementedError

    @property
    def observation_window(self) -> int:
        """How many recent queries per layer the cache must remember for this scorer (0 = none)."""
        return 0

    def sources(self) -> tuple[Source, ...]:
        """What this scorer reads besides the held keys and values (default: its query window, if any)."""
        return (QueryWindow(self.observation_window),) if self.observation_window else ()

    def score_per_query_head(self, obs: Observation) -> Tensor | None:
        """[B, Hq, S] the scores each query head alone would rank by (before GQA pooling), or None (the default)
        where the method has no per-query-head form (key- or value-only scores). ``eval.uor`` reads it."""
        return None

    def reconstruction_prompt(self, input_ids: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
        """For a ``Reconstruction`` source: the prompt prefilled after the context and before scoring.
        input_ids, real: [B, T] the tokens just prefilled and their non-pad mask."""
        raise NotImplementedError

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int = 0) -> None:
        """Refuse, at ``apply``, what does not fit this shape of model (learned weights, a calibrated per-head
        table); nothing by default."""


def check_per_head_table(what: str, shape: tuple, num_layers: int, num_kv_heads: int) -> None:
    """Refuse a table of one value per (layer, KV head) made for another shape of model."""
    if tuple(shape) != (num_layers, num_kv_heads):
        raise ValueError(f"{what} are {tuple(shape)}, the model has {num_layers} layers of {num_kv_heads} KV heads")


@dataclass
class Wrapper(Scorer):
    """A scorer that changes how another registered scorer's scores select tokens (kvpress's wrapper presses):
    ``base`` names that scorer, ``base_args`` its parameters. It reads what its base reads."""

    base: str = "snapkv"
    base_args: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.base not in SCORERS:
            raise ValueError(f"{self.name}: base must be a registered scorer, got {self.base!r}; known: "
                             f"{sorted(SCORERS)}")
        self._base = SCORERS[self.base](**self.base_args)

    @property
    def observation_window(self) -> int:
        return self._base.observation_window

    def sources(self) -> tuple[Source, ...]:
        return self._base.sources()

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int = 0) -> None:
        self._base.check_model(num_layers, num_kv_heads, head_dim, hidden_size)

    def reconstruction_prompt(self, input_ids: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
        return self._base.reconstruction_prompt(input_ids, real)


@dataclass(frozen=True)
class Strategy:
    """How the compression engine turns an allocator's choice into a plan (``compress.PLANNERS`` holds the code of
    each), and which of the allocator's hooks it calls: ``TOKENS`` (default): keep each head's top ``allocate``
    tokens. ``PAGES``: ``allocate`` gets page scores (the max over each page's tokens), pages held and a budget in
    pages, returns pages, and whole pages are kept or evicted. ``TAIL_SUMMARY``: a head that evicts spends the last
    of its counted slots on one new entry that summarises its evicted tail (``summarize``). ``PROTOTYPES``: the
    allocator's ``prototypes`` returns the kept tokens and the weighted entries that stand for the others.
    ``MEMORY``: per-head counts as ``TOKENS``; ``retain`` keeps tokens by the allocator's own rule and ``memorize``
    writes up to ``memory`` weighted entries of what it evicts. ``weighted``: its plans write weighted entries
    (``cache.weights``)."""

    name: str
    weighted: bool = False


TOKENS, PAGES = Strategy("tokens"), Strategy("pages")
TAIL_SUMMARY, PROTOTYPES, MEMORY = (Strategy(n, weighted=True) for n in ("tail-summary", "prototypes", "memory"))


class Allocator:
    """How many tokens each (layer, KV head) keeps under one budget per sequence; ``strategy`` (a ``Strategy``)
    declares how the engine turns that into a plan and which hooks below it calls."""

    strategy: ClassVar[Strategy] = TOKENS

    def allocate(self, scores: Tensor, lengths: Tensor, budget: Tensor) -> Tensor:
        """scores [L, B, Hkv, S] (-inf where nothing is held), lengths [L, B, Hkv], budget [B] tokens per sequence
        summed over all layers and KV heads. Return counts [L, B, Hkv] (int64) with counts <= lengths and
        counts.sum((0, 2)) <= budget. An allocator whose ``layer_stats`` returns tensors gets them, stacked over
        layers, as a fourth argument ``stats``."""
        raise NotImplementedError

    def allocate_pages(self, scores: Tensor, lengths: Tensor, max_pages: Tensor, page_size: int) -> Tensor | None:
        """Counts [L, B, Hkv] in whole pages of ``page_size`` tokens (a head's last page may be its partial one),
        at most ``max_pages`` [B] pages per sequence, chosen by this allocator's own rule; None (the default):
        the engine rounds ``allocate``'s token counts down to pages (``compress.fit_to_pages``)."""
        return None

    def check(self, num_layers: int) -> None:
        """Refuse, before anything runs, parameters that do not fit a model of ``num_layers`` layers."""

    def layer_stats(self, obs: Observation, scores: Tensor) -> Tensor | None:
        """Statistics beyond the scores that ``allocate`` needs from one layer's dense view (``obs``; ``scores``
        [B, Hkv, S] as the compressor cleaned them): a tensor [B, Hkv, ...], or None (the default)."""
        return None

    def summarize(self, obs: Observation, evicted: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For ``TAIL_SUMMARY`` allocators: the summary entry of each head's ``evicted`` [B, Hkv, S] tokens as key,
        value [B, Hkv, D], position and log-weight [B, Hkv] (it stands for e^log-weight tokens: ``cache.weights``)."""
        raise NotImplementedError


def per_head_share(lengths: Tensor, budget: Tensor) -> Tensor:
    """[B] average tokens per (layer, KV head) that ``budget`` [B] allows."""
    L, _, Hkv = lengths.shape
    return budget // (L * Hkv)


def position_sums(values: Tensor, obs: Observation) -> Tensor:
    """[B, P] the sum over heads of ``values`` [B, H, S] (H = Hkv or Hq) at each original position, P = the largest
    held position + 1: heads may hold different tokens (earlier compressions are per head), so they meet by
    position. Unheld entries add nothing."""
    B, H, S = values.shape
    G = H // obs.keys.shape[1]
    valid = obs.valid.repeat_interleave(G, 1)
    held = obs.positions.masked_fill(~obs.valid, 0)
    total = torch.zeros(B, int(held.max()) + 1, device=values.device)
    pos = held.repeat_interleave(G, 1).reshape(B, -1)
    return total.scatter_add_(1, pos, values.float().masked_fill(~valid, 0).reshape(B, -1))


def at_positions(table: Tensor, obs: Observation) -> Tensor:
    """A per-position table [B, P] read back for every held entry: [B, Hkv, S]."""
    pos = obs.positions.masked_fill(~obs.valid, 0)
    return table.gather(1, pos.reshape(pos.shape[0], -1)).reshape(pos.shape)


def pool_groups(scores: Tensor, num_kv_heads: int, how: str = "mean") -> Tensor:
    """Per-query-head scores [B, Hq, S] -> per-KV-head [B, Hkv, S], pooled over each GQA group ("mean" or "max")."""
    B, Hq, S = scores.shape
    grouped = scores.reshape(B, num_kv_heads, Hq // num_kv_heads, S)
    return grouped.mean(2) if how == "mean" else grouped.amax(2)


def descending_rank(x: Tensor) -> Tensor:
    """Rank of every entry along the last dim, 0 = largest; equal values rank by position."""
    return x.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)


def merge_rankings(first: Tensor, second: Tensor, ratio: float) -> Tensor:
    """One ranking from two score tensors [..., S] (higher = keep, -inf = not held) such that any top k holds the
    top ~ratio*k of ``first`` and the top ~(1 - ratio)*k of ``second``: a method that splits a budget it does not
    know between two criteria (H2O's heavy hitters and recent tokens, CriticalKV's two stages). A token ranks by
    min((rank in first + 1) / ratio, (rank in second + 1) / (1 - ratio)).

    Returns scores in ``first``'s scale: the token ranked i-th gets ``first``'s i-th largest value. Ranks alone
    would be the same numbers in every head, and an allocator that compares heads (Ada-KV) would see none differ.
    """

    def rank(x):
        return descending_rank(x).float() + 1

    merged = torch.minimum(rank(first) / ratio, rank(second) / (1 - ratio))
    order = merged.argsort(dim=-1, stable=True)
    return torch.empty_like(first).scatter_(-1, order, first.sort(dim=-1, descending=True).values)


def pooled_rank(scores: Tensor) -> Tensor:
    """Rank (0 = best) of every entry of the rows [..., N, S] taken together -> [..., N * S]. Equal scores (the
    pinned tokens of ``protect`` above all) go round-robin between rows, by their rank within the row, instead of
    all to the first row: a budget smaller than the pins then splits them evenly."""
    within = descending_rank(scores).flatten(-2)
    flat = scores.flatten(-2)
    order = within.argsort(dim=-1, stable=True)  # by rank within the row, then by row
    order = order.gather(-1, flat.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    return order.argsort(dim=-1)


def protect(scores: Tensor, mask: Tensor) -> Tensor:
    """Scores where ``mask`` tokens rank above everything else (kept whenever the head keeps any)."""
    return scores.masked_fill(mask, torch.finfo(scores.dtype).max)


_PINNED = torch.finfo(torch.bfloat16).max  # what ``protect`` writes, in float32 or bfloat16 scores


def is_pinned(scores: Tensor) -> Tensor:
    """[..., S] True at the tokens ``protect`` pinned (the compression engine keeps them first)."""
    return scores >= _PINNED
