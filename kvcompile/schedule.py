"""Decode-time compression: keep a generating sequence's KV cache under a cap by evicting between decode steps.

A recipe's ``decode`` entry describes a ``DecodeSchedule``. The runtime calls ``DecodeCompressor.start`` at the
first decode step after a prefill and ``DecodeCompressor.step`` after every decode step; after the first decode
step and then every ``every`` steps, ``run``:

1. lets the policy (``methods.decoding``) fold the queries the decode ops wrote into the ring ``obs_q`` since the
   previous run, and score every held token, layer by layer;
2. asks the policy how many tokens each head keeps: the cap minus ``every`` (room for the tokens until the next
   run), so no head ever holds more than the cap (GrowPage shares the sequence's cap unevenly instead);
3. keeps the protected spans first (recent window > sinks > prompt), then the top scores; compacts them with
   ``ops.compact``, gives up the freed pages (``release_unused``), and moves the policy's
   per-token state along with the tokens;
4. reserves room for the next ``every`` tokens in the pages given up (the pool keeps its size).

The cap is the model's budget, per sequence: a token count is tokens per KV head, a byte size is spread evenly over
(layer, KV head), a fraction is that fraction of the tokens the row has seen. ``start`` sizes the pool for the cap
once (``resize``); with a token or byte cap the pool tensors and the page table then keep one shape for the whole
generation, so a compiled decode program never recompiles (a fraction cap grows the pool as it grows). Runs sync
with the host; decode steps do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .budget import Budget
from .cache import PagedKVCache
from .compress import compact_heads, kept_indices, observe
from .methods.decoding import POLICIES, DecodePolicy, LayerState

RECENT, SINK, PROMPT, SCORED = 3, 2, 1, 0  # protection levels: a higher level is kept first


@dataclass(frozen=True)
class DecodeSchedule:
    """When and how far to compress while decoding, with which policy, and what is never evicted.

    policy: a name from ``methods.decoding.POLICIES``, ``args`` its parameters. every: run after the first decode
    step and then every ``every`` steps, each run bringing the heads to the cap minus ``every`` tokens. Protected
    spans, kept before any scored token in this order: the last ``recent`` positions, the first ``sinks``
    positions, and, with ``prompt``, every token prefilled before decoding began.
    """

    policy: str
    every: int = 16
    recent: int = 16
    sinks: int = 0
    prompt: bool = False
    args: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown decode policy {self.policy!r}; known: {sorted(POLICIES)}")
        if self.every < 1 or self.recent < 0 or self.sinks < 0:
            raise ValueError(
                "decode schedule needs every >= 1, recent >= 0, sinks >= 0; "
                f"got {self.every}, {self.recent}, {self.sinks}"
            )
        self.build()  # bad policy parameters fail here

    @property
    def observation_window(self) -> int:
        """Queries per layer the decode ops must keep in the ring for the policy."""
        return self.build().ring(self.every)

    def build(self) -> DecodePolicy:
        try:
            return POLICIES[self.policy](**self.args)
        except TypeError as e:  # an unknown or missing parameter name
            raise ValueError(f"decode policy {self.policy!r}: {e}") from e


class DecodeCompressor:
    """Runs one ``DecodeSchedule`` over a ``PagedKVCache``; the policy's state lives here from one ``start`` to
    the next. ``scales``/``windows``: per-layer softmax scale and sliding window."""

    def __init__(self, schedule: DecodeSchedule, budget: Budget, scales, windows):
        self.schedule, self.budget, self.scales, self.windows = schedule, budget, scales, windows
        self.policy = schedule.build()

    def start(self, cache: PagedKVCache, seen: Tensor) -> int:
        """Before the first decode step after a prefill: forget earlier signals, size the pool for the cap.
        ``seen`` [B]: tokens read so far. Returns the tokens every head can take before the next reservation."""
        sched = self.schedule
        if cache.obs_window < sched.observation_window:
            raise ValueError(
                f"decode policy {sched.policy!r} reads the last {sched.observation_window} queries but the cache keeps "
                f"{cache.obs_window}; build the model with this recipe (kvcompile.apply) rather than forking one"
            )
        self.prompt_end, self.folded = seen.clone(), seen - 1  # prefill queries are not decode signals
        self.states = [LayerState() for _ in range(cache.num_layers)]
        self.steps = 0
        ceiling = self._ceiling(cache, seen + 1)
        if bool((ceiling - sched.every < sched.recent + sched.sinks + 1).any()):
            raise ValueError(
                f"decode cap of {ceiling.min().item()} tokens per KV head is too small for the schedule: it must "
                f"exceed every ({sched.every}) + recent ({sched.recent}) + sinks ({sched.sinks}); raise the budget"
            )
        room = (ceiling - cache.lengths.amax((0, 2))).clamp_min(0)
        cache.reserve(room)
        self._provision(cache, ceiling)
        return int(room.min())

    def until_run(self) -> int:
        """Decode steps from now up to and including the one after which the next run is due."""
        return -self.steps % self.schedule.every + 1

    def step(self, cache: PagedKVCache, seen: Tensor, n: int = 1) -> int | None:
        """After ``n`` decode steps (at most ``until_run()``): run when one is due. Returns the bytes held just
        before the run (the peak since the previous run), or None when no run was due."""
        self.steps += n
        if (self.steps - 1) % self.schedule.every:
            return None
        return self.run(cache, seen)

    def run(self, cache: PagedKVCache, seen: Tensor) -> int:
        """Fold signals, evict every head to its count, free and re-reserve pages; returns the bytes held before."""
        sched = self.schedule
        held = int(cache.bytes_held().sum())
        newest = seen - 1
        scores, levels = [], []
        for layer, state in enumerate(self.states):
            obs = observe(cache, layer, self.scales[layer], self.windows[layer])
            state.tokens = _fit(state.tokens, obs.positions)
            fresh = obs.query_positions > self.folded[:, None]
            s = self.policy.score(state, obs, fresh).float().nan_to_num(0.0)
            scores.append(s.masked_fill(~obs.valid, float("-inf")))
            levels.append(self._levels(obs, newest))
        self.folded = newest
        lengths = cache.lengths.long()
        target = self._ceiling(cache, seen) - sched.every
        counts = self.policy.allocate(self.states, lengths, target, sched.every).long().clamp_min(0).minimum(lengths)
        if bool((counts < lengths).any()):
            self._evict(cache, torch.stack(scores), torch.stack(levels), counts)
        for layer, state in enumerate(self.states):  # tokens appended from now on are new to the policy
            idx = torch.arange(state.tokens.shape[-1], device=cache.device)
            state.tokens = state.tokens.masked_fill(idx >= cache.lengths[layer, ..., None], float("nan"))
        cache.reserve(sched.every)
        _pad_page_table(cache, self._width)
        return held

    # ------------------------------------------------------------------ helpers
    def _ceiling(self, cache: PagedKVCache, seen: Tensor) -> Tensor:
        """[B] tokens per KV head the cap allows a row that has read ``seen`` tokens."""
        L, Hkv, tb = cache.num_layers, cache.num_kv_heads, cache.token_bytes
        per_row = [self.budget.bytes_per_sequence(int(n), L, Hkv, tb) // (L * Hkv * tb) for n in seen.tolist()]
        return torch.tensor(per_row, dtype=torch.long, device=cache.device)

    def _levels(self, obs, newest: Tensor) -> Tensor:
        """[B, Hkv, S] protection level of every held token (-1 where nothing is held)."""
        pos, sched = obs.positions, self.schedule
        level = torch.full_like(pos, SCORED)
        if sched.prompt:
            level = level.masked_fill(pos < self.prompt_end[:, None, None], PROMPT)
        level = level.masked_fill(pos < sched.sinks, SINK)
        level = level.masked_fill(pos > newest[:, None, None] - sched.recent, RECENT)
        return level.masked_fill(~obs.valid, -1)

    def _evict(self, cache: PagedKVCache, scores: Tensor, levels: Tensor, counts: Tensor) -> None:
        """Keep each head's ``counts`` [L, B, Hkv] best tokens: highest level first, then highest score."""
        order = scores.argsort(dim=-1, descending=True, stable=True)
        order = order.gather(-1, levels.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
        keep = kept_indices(order.argsort(-1) < counts[..., None])  # [L, B, Hkv, K] ascending logical indices
        compact_heads(cache, keep, counts)
        cache.lengths = counts.to(torch.int32)
        cache.release_unused()
        S = scores.shape[-1]
        for layer, state in enumerate(self.states):
            state.tokens = state.tokens.gather(-1, keep[layer].clamp_max(S - 1))

    def _provision(self, cache: PagedKVCache, ceiling: Tensor) -> None:
        """Make the pool exactly what the cap needs (plus one page per head when heads share the cap unevenly) and
        the page table as wide as the longest head may get, so decode shapes stay fixed."""
        L, B, Hkv = cache.lengths.shape
        P = cache.page_size
        pages = -(-ceiling // P)  # [B] pages per head at the cap
        ragged = self.policy.max_share > 1
        capacity = 1 + L * Hkv * int(pages.sum()) + (L * B * Hkv if ragged else 0)
        self._width = math.ceil(self.policy.max_share * int(ceiling.max()) / P)
        cache.resize(capacity)
        _pad_page_table(cache, self._width)


def _fit(tokens: Tensor | None, like: Tensor) -> Tensor:
    """Per-token state padded with NaN (tokens not seen yet) or cut to the shape of ``like`` [B, Hkv, S]."""
    if tokens is None:
        return torch.full(like.shape, float("nan"), device=like.device)
    S = like.shape[-1]
    if tokens.shape[-1] >= S:
        return tokens[..., :S]
    return nn.functional.pad(tokens, (0, S - tokens.shape[-1]), value=float("nan"))


def _pad_page_table(cache: PagedKVCache, width: int) -> None:
    """Widen the page table to ``width`` pages (entries past a head's pages point at the scratch page 0)."""
    extra = width - cache.page_table.shape[-1]
    if extra > 0:
        cache.page_table = nn.functional.pad(cache.page_table, (0, extra))
