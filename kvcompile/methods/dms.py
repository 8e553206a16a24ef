"""The DMS threshold wrapper (kvpress ``DMSPress``, docs/methods_learned.md#dms): the newest ``window`` tokens are
always kept; every older token is evicted iff its score is below ``tau``. A dense-prefill imitation of DMS (arXiv
2506.05345), not its trained evictor.

kvcompile's choice: the budget caps what is kept. kvpress lets the threshold alone decide (the budget is an
outcome); here a recipe must hold ``bytes_held <= budget_bytes``, so when the tokens at or above ``tau`` exceed the
budget, the budget's best of them are kept (one competition over layers and heads, as ``global-topk``). Under the
cap the kept set is exactly the window plus ``{score >= tau}``, ragged per head. Decisions are final: an evicted
token is gone. Compression runs when the cache is over its budget (the engine's rule), so pick a budget above what
the threshold keeps to let ``tau`` alone decide.

While decoding (``DMSDecoding``, the decode policy "dms"): DMS decides each generated token when it leaves the
window. Here the decode schedule runs every ``every`` steps and decides, at once, the tokens that left the window
since its last run: kept iff scored at least ``tau``. The base scores a token from what the cache holds of it
(KVzap: its key and value), so a score never changes after the token is written and the kept set after a run is
the window plus ``{score >= tau}`` whatever ``every`` is (inferred: the batching; the cap is the schedule's, as
for prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import Allocator, Observation, Wrapper, protect, register_allocator, register_scorer
from .decoding import DecodePolicy, LayerState, register_policy
from .kvzip import GlobalTopK


@register_scorer("dms")
@dataclass
class DMS(Wrapper):
    """The base's scores with each row's newest ``window`` positions pinned (kept first)."""

    base: str = "kvzap"
    window: int = 128

    def __post_init__(self):
        super().__post_init__()
        if self.window < 0:
            raise ValueError(f"dms: window must be >= 0, got {self.window}")

    def score(self, obs: Observation) -> Tensor:
        scores = self._base.score(obs).float()
        newest = obs.positions.masked_fill(~obs.valid, -1).amax((1, 2))  # [B]
        return protect(scores, obs.valid & (obs.positions > newest[:, None, None] - self.window))


@register_allocator("threshold")
@dataclass
class Threshold(Allocator):
    """Keep every token scored at least ``tau`` (pinned ones always), capped by the budget (see the module)."""

    tau: float = -4.0

    def allocate(self, scores: Tensor, lengths: Tensor, budget: Tensor) -> Tensor:
        return GlobalTopK().allocate(scores.masked_fill(scores < self.tau, float("-inf")), lengths, budget)


@register_policy("dms")
@dataclass
class DMSDecoding(DecodePolicy):
    """DMS's threshold on the tokens that leave the newest ``window`` while decoding (see the module); ``base``,
    ``base_args``: the scorer (as ``DMS``). Pair it with a schedule whose ``recent`` is ``window``."""

    base: str = "kvzap"
    base_args: dict = field(default_factory=dict)
    window: int = 128
    tau: float = -4.0

    def __post_init__(self):
        self._scorer = DMS(self.base, self.base_args, self.window)

    def ring(self, every: int) -> int:
        return self._scorer.observation_window  # KVzap reads no queries

    def score(self, state: LayerState, obs: Observation, fresh: Tensor) -> Tensor:
        scores = self._scorer.score(obs).float()
        state.extra["kept"] = ((scores >= self.tau) & obs.valid).sum(-1)  # [B, Hkv], the window pinned in it
        return scores

    def allocate(self, states: list[LayerState], lengths: Tensor, target: Tensor, every: int) -> Tensor:
        kept = torch.stack([state.extra["kept"] for state in states])
        return kept.minimum(lengths).minimum(target[None, :, None])
