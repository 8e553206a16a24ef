"""The decode-time policy contract: how a policy ranks held tokens while the model generates.

The decode schedule (``kvcompile.schedule``) runs a ``DecodePolicy`` between decode steps. At every run it hands
the policy, per layer, an ``Observation`` whose queries are the ring of the layer's last W queries (the decode
op writes each step's query there; ``fresh`` [B, W] marks the ones not folded by an earlier run) and the layer's
``LayerState``. The policy folds the fresh queries into its state and returns scores [B, Hkv, S] (higher = keep).
The schedule then keeps protected spans, selects, compacts, and moves the per-token state along with the tokens.
Because no token is evicted between runs, the attention a fresh query paid at its own step is recomputed exactly
from the ring: a key at a later position is invisible to it (causal by position).
Shape letters as in ``methods.base``; W: ring slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import Observation, _registrar

POLICIES: dict[str, type] = {}
register_policy = _registrar(POLICIES)


@dataclass
class LayerState:
    """One layer's policy state. ``tokens`` [B, Hkv, S]: one value per held token, NaN for tokens the policy has not
    seen yet (the schedule pads with NaN and keeps it aligned with the tokens through eviction); ``extra``:
    anything else, left where it is."""

    tokens: Tensor | None = None
    extra: dict = field(default_factory=dict)


class DecodePolicy:
    """Ranks the tokens of each KV head during generation; hyperparameters are dataclass fields."""

    max_share = 1.0  # the most one head may hold, as a multiple of the per-head cap (> 1: heads share unevenly)

    def ring(self, every: int) -> int:
        """Queries per layer the decode ops must remember for this policy (0 = none), given the run interval."""
        return every

    def score(self, state: LayerState, obs: Observation, fresh: Tensor) -> Tensor:
        """Fold the ``fresh`` [B, W] ring queries into ``state``; return scores [B, Hkv, S], higher = keep."""
        raise NotImplementedError

    def allocate(self, states: list[LayerState], lengths: Tensor, target: Tensor, every: int) -> Tensor:
        """Tokens each head keeps, counts [L, B, Hkv] <= lengths, summing to at most ``target`` [B] per head on
        average. Default: every head keeps at most ``target``."""
        return lengths.minimum(target[None, :, None])


class MergingPolicy(DecodePolicy):
    """A policy that folds what a run evicts into what it keeps (CaM); the schedule calls ``merge`` per layer
    before the run's plan applies."""

    def merge(self, state: LayerState, values: Tensor, valid: Tensor, kept: Tensor, candidates: int,
              step: int) -> Tensor | None:
        """One layer's values [B, Hkv, S, D] with what this run evicts folded into the ``kept`` [B, Hkv, S] entries
        (CaM), or None (nothing merges). ``candidates``: tokens generated since the last run;
        ``step``: decode steps so far."""
        raise NotImplementedError


def step_attention(obs: Observation) -> Tensor:
    """[B, Hkv, W, S]: the attention each ring query paid the held keys at its step, averaged over its GQA group
    (0 for empty slots and keys it could not see)."""
    B, Hkv, S, _ = obs.keys.shape
    attn = obs.window_attention()
    return attn.reshape(B, Hkv, -1, attn.shape[2], S).mean(2)


def chronological(obs: Observation, fresh: Tensor):
    """Ring slots in position order, fresh ones first in time: (slots [B, W], positions [B, W], fresh [B, W])."""
    key = obs.query_positions.masked_fill(~fresh, torch.iinfo(torch.int64).max)
    order = key.argsort(-1)
    return order, obs.query_positions.gather(1, order), fresh.gather(1, order)
