"""KVpop's stateless scorer (METHODS.md §49, arXiv 2607.05061, PARTIAL: read through summaries, its code not
found): a small per-(layer, KV head) model trained to tell, from a token alone, whether the queries after a
protected window will attend to it among the most (``train.kvpop``), so a cache evicts to a fixed per-head budget
without reading any query.

Inferred (stated in the recipe): the scorer reads what the cache holds of the token (its value and key norms,
``methods.kvzap.token_features``; §49 names the token's key, value or hidden state), linear per (layer, KV head);
the boundary-weighted loss's form; the protected window of 32 and the 4 sinks kept. Not built: the delayed,
memory-based variant (a token scored only after its next Δ tokens are read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .base import Observation, protect, register_scorer
from .kvzap import KVzap


@register_scorer("kvpop")
@dataclass
class KVpop(KVzap):
    """The trained keep logit of every token (``KVzap``'s surrogate and weights contract, KVpop's weights), with the
    newest ``window`` positions of each row kept: the protected window the targets count from."""

    method: ClassVar[str] = "kvpop"
    window: int = 32

    def score(self, obs: Observation) -> Tensor:
        newest = obs.positions.masked_fill(~obs.valid, -1).amax((1, 2))  # [B]
        return protect(super().score(obs), obs.valid & (obs.positions > newest[:, None, None] - self.window))
