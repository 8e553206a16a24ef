"""Decode-time compression: keep a generating sequence's KV cache under a cap by evicting between decode steps.

A recipe's ``decode`` entry describes a ``DecodeSchedule``. The runtime calls ``DecodeCompressor.start`` at the
first decode step after a prefill and ``DecodeCompressor.step`` after every decode step; after the first decode
step and then every ``every`` steps, ``run``:

1. lets the policy (``methods.decoding``) fold the queries the decode ops wrote into the observation ring since the
   previous run, and score every held token, layer by layer;
2. asks the policy how many tokens each head keeps: the cap minus ``every`` (room for the tokens until the next
   run), so no head ever holds more than the cap (a policy with ``max_share`` > 1 shares the row's cap unevenly);
3. keeps the protected levels first (recent window > sinks > prompt), then the top scores: one ``plan.Plan``,
   applied by ``PagedKVCache.keep`` (the pool keeps its size), moving the policy's per-token state along; a
   policy that merges (CaM) first folds evicted values into kept ones (``MergingPolicy.merge``);
4. reserves room for the next ``every`` tokens in the pages given up.

The cap is the model's budget, per sequence: a token count is tokens per KV head, a byte size is spread evenly over
(layer, KV head), a fraction is that fraction of the tokens the row has seen; rounded down to whole pages, so the
bytes held never pass the budget between runs. ``start`` sizes the pool for the cap
once (``PagedKVCache.provision``); a fraction cap grows it by at most ``GROWTH`` at a time as the cap grows. The
ring keeps only the window the policy reads. Runs sync with the host; decode steps do not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .budget import Budget
from .cache import PagedKVCache
from .methods.decoding import POLICIES, DecodePolicy, LayerState, MergingPolicy
from .observation import observe
from .plan import EMPTY, PROMPT, RECENT, SCORED, SINK, select

GROWTH = 1.1  # how much a fraction cap grows the pool at a time: storage stays within ~1.1x the cap


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

    @property
    def smallest_cap(self) -> int:
        """Tokens per KV head the least a fitted schedule needs: its sinks, one recent or interval slot and one
        scored slot."""
        return self.sinks + 2

    @property
    def need(self) -> int:
        """Tokens per KV head a run of this schedule needs under its cap: sinks, the recent window, one interval of
        new tokens and one scored slot."""
        return self.sinks + self.recent + self.every + 1

    def fitted(self, cap: int) -> DecodeSchedule:
        """This schedule for a cap of ``cap`` tokens per KV head: ``every`` and ``recent`` scaled down together
        (every >= 1) when every + recent + sinks does not fit under the cap; raises, naming what to change, when
        not even one scored slot fits beside the sinks."""
        room = cap - self.sinks - 1
        if self.every + self.recent <= room:
            return self
        if room < 1:
            raise ValueError(
                f"a decode cap of {cap} tokens per KV head leaves no room beside the schedule's {self.sinks} sinks; "
                f"raise the budget to at least {self.sinks + 2} tokens per KV head or lower the recipe's decode sinks"
            )
        every = max(1, self.every * room // (self.every + self.recent))
        return dataclasses.replace(self, every=every, recent=min(self.recent, room - every))

    def build(self) -> DecodePolicy:
        try:
            return POLICIES[self.policy](**self.args)
        except TypeError as e:  # an unknown or missing parameter name
            raise ValueError(f"decode policy {self.policy!r}: {e}") from e


class DecodeCompressor:
    """Runs one ``DecodeSchedule`` over a ``PagedKVCache``; the policy's state lives here from one ``start`` to
    the next. ``layers``: the model's ``LayerSpec``s."""

    def __init__(self, schedule: DecodeSchedule, budget: Budget, layers):
        self.requested, self.schedule, self.budget, self.layers = schedule, schedule, budget, layers
        self.policy = schedule.build()
        self.floor = 0  # tokens per KV head no row is brought below (``start`` sets it)

    def start(self, cache: PagedKVCache) -> None:
        """Before the first decode step after a prefill: forget earlier signals, fit the schedule to the rows'
        caps, size the pool and the ring for it. A row whose cap cannot hold even the smallest fitted schedule (a
        short prompt under a fraction cap) does not fail the batch: the schedule fits the other rows, and that row's
        cap is floored at what the schedule needs (``floor``; ``uncapped`` names such rows)."""
        seen = cache.seen
        cap = self.cap(cache, seen + 1)
        fits = cap >= self.requested.smallest_cap
        self.schedule = self.requested.fitted(int(cap[fits].min())) if bool(fits.any()) else self.requested
        P = cache.page_size
        self.floor = -(-self.schedule.need // P) * P
        ceiling = self.ceiling(cache, seen + 1)
        self.prompt_end, self.folded = seen.clone(), seen - 1  # prefill queries are not decode signals
        self.states = [LayerState() for _ in range(cache.num_layers)]
        self.steps = 0
        cache.observe(self.schedule.observation_window, exact=True)
        cache.reserve((ceiling - cache.lengths.amax((0, 2))).clamp_min(1))
        L, B, Hkv = cache.lengths.shape
        P, share = cache.page_size, self.policy.max_share
        if share > 1:  # heads share the row's cap unevenly: its tokens, plus one partial page per head
            pages = int((-(-ceiling * L * Hkv // P)).sum()) + L * B * Hkv
        else:  # every head at most at the cap
            pages = L * Hkv * int((-(-ceiling // P)).sum())
        cache.provision(1 + pages, -(-int(share * int(ceiling.max())) // P))

    def until_run(self) -> int:
        """Decode steps from now up to and including the one after which the next run is due."""
        return -self.steps % self.schedule.every + 1

    def step(self, cache: PagedKVCache, n: int = 1) -> int | None:
        """After ``n`` decode steps (at most ``until_run()``): run when one is due. Returns the bytes held just
        before the run (the peak since the previous run), or None when no run was due."""
        self.steps += n
        if (self.steps - 1) % self.schedule.every:
            return None
        return self.run(cache)

    def run(self, cache: PagedKVCache) -> int:
        """Fold signals, evict every head to its count, re-reserve pages; returns the bytes held before."""
        sched, seen = self.schedule, cache.seen
        held = int(cache.bytes_held().sum())
        newest = seen - 1
        scores, levels = [], []
        for layer, state in zip(self.layers, self.states):
            obs = observe(cache, layer)
            state.tokens = _fit(state.tokens, obs.positions)
            fresh = obs.query_positions > self.folded[:, None]
            s = self.policy.score(state, obs, fresh).float().nan_to_num(0.0)
            scores.append(s.masked_fill(~obs.valid, float("-inf")))
            levels.append(self._levels(obs, newest))
        self.folded = newest
        lengths = cache.lengths.long()
        target = self.ceiling(cache, seen) - sched.every
        counts = self.policy.allocate(self.states, lengths, target, sched.every).long().clamp_min(0).minimum(lengths)
        if bool((counts < lengths).any()):
            plan = select(torch.stack(scores), counts, torch.stack(levels))
            if isinstance(self.policy, MergingPolicy):  # the compression's merging path, with the policy's rule
                states, every, steps = self.states, self.schedule.every, self.steps
                cache.fold_evicted(plan, lambda layer, keys, values, valid, kept: self.policy.merge(
                    states[layer], values, valid, kept, every, steps))
            cache.keep(plan, shrink=False)
            S = scores[0].shape[-1]
            for layer, state in enumerate(self.states):
                state.tokens = state.tokens.gather(-1, plan.keep[layer].clamp_max(S - 1))
        for layer, state in enumerate(self.states):  # tokens appended from now on are new to the policy
            idx = torch.arange(state.tokens.shape[-1], device=cache.device)
            state.tokens = state.tokens.masked_fill(idx >= cache.lengths[layer, ..., None], float("nan"))
        cache.reserve(sched.every, growth=GROWTH)
        return held

    def cap(self, cache: PagedKVCache, seen: Tensor) -> Tensor:
        """[B] tokens per KV head the budget allows a row that has read ``seen`` tokens, in whole pages: bytes are
        held by the page, so a head filled to a cap that ended mid-page would hold more than the budget."""
        P = cache.page_size
        return cache.budget_tokens(self.budget, seen) // P * P

    def ceiling(self, cache: PagedKVCache, seen: Tensor) -> Tensor:
        """[B] tokens per KV head a row is brought back to: its ``cap``, floored at what the schedule needs."""
        return self.cap(cache, seen).clamp_min(self.floor)

    def uncapped(self, cache: PagedKVCache) -> list[int]:
        """The rows whose cap is below what the schedule needs now, so they hold up to ``floor`` tokens per KV head
        instead (over their budget)."""
        return (self.cap(cache, cache.seen) < self.floor).nonzero().flatten().tolist()

    def _levels(self, obs, newest: Tensor) -> Tensor:
        """[B, Hkv, S] protection level of every held token (EMPTY where nothing is held)."""
        pos, sched = obs.positions, self.schedule
        level = torch.full_like(pos, SCORED)
        if sched.prompt:
            level = level.masked_fill(pos < self.prompt_end[:, None, None], PROMPT)
        level = level.masked_fill(pos < sched.sinks, SINK)
        level = level.masked_fill(pos > newest[:, None, None] - sched.recent, RECENT)
        return level.masked_fill(~obs.valid, EMPTY)


def _fit(tokens: Tensor | None, like: Tensor) -> Tensor:
    """Per-token state padded with NaN (tokens not seen yet) or cut to the shape of ``like`` [B, Hkv, S]."""
    if tokens is None:
        return torch.full(like.shape, float("nan"), device=like.device)
    S = like.shape[-1]
    if tokens.shape[-1] >= S:
        return tokens[..., :S]
    return nn.functional.pad(tokens, (0, S - tokens.shape[-1]), value=float("nan"))
