"""KVpop (arXiv 2607.05061, PARTIAL: read through summaries, its code not found): a small per-(layer,
KV head) model trained to tell whether the queries after a protected window will attend to a token among the most
(``train.kvpop``), so a cache evicts to a fixed per-head budget.

Two scorers. The stateless one (``kvpop``) reads a token alone, so it ranks a prompt without reading any query.
The delayed one (``kvpop-delayed``, a decode policy) fixes a token's score only ``DELAY`` steps after the token is
written, once the scorer has seen what follows it; pending tokens stay in the protected recent window meanwhile.

Inferred (stated in the recipes): the scorers read what the cache holds of the token (its value and key norms,
``methods.kvzap.token_features``; the paper names the token's key, value or hidden state), linear per (layer, KV head);
the delayed scorer's memory of the next tokens (the paper's: a recurrent, xLSTM-style state) is here the attention the
next ``DELAY`` queries paid the token (``lookahead_mass``), one more feature; the boundary-weighted loss's form; the
protected window of 32 and the 4 sinks kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import Observation, protect, register_scorer
from .decoding import DecodePolicy, LayerState, register_policy
from .kvzap import TRAIN_HINT, KVzap, load_surrogate, token_features

DELAY = 8  # steps between a token's write and its score (inferred: the paper names the mechanism, not a value)


def lookahead_mass(obs: Observation, delay: int, block: int = 128) -> Tensor:
    """[B, Hkv, S] the attention each held entry received from the observed queries at the ``delay`` positions
    after it, summed over the GQA group and those queries (0 where none is observed); ``block`` queries at a
    time."""
    B, Hkv, S, _ = obs.keys.shape
    out = torch.zeros(B, Hkv, S, device=obs.keys.device)
    for slots in obs.query_blocks(block):
        attn = obs.window_attention(slots)  # [B, Hq, b, S], 0 where a query does not see a key
        q = obs.query_positions[:, slots][:, None, :, None]
        k = obs.positions[:, :, None, :]
        near = (q > k) & (q <= k + delay)
        out += (attn.reshape(B, Hkv, -1, attn.shape[2], S).sum(2) * near).sum(2)
    return out


def delayed_features(keys: Tensor, values: Tensor, lookahead: Tensor) -> Tensor:
    """[..., S, F + 1]: ``token_features`` and the log of the token's ``lookahead`` mass [..., S]."""
    return torch.cat([token_features(keys, values), lookahead.float().clamp_min(1e-6).log()[..., None]], -1)


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


@register_policy("kvpop-delayed")
@dataclass
class KVpopDelayed(DecodePolicy):
    """At each run, every token written at least ``DELAY`` steps ago and not scored yet is scored, once and for
    good, from its entries and the attention of the ``DELAY`` queries after it (still in the ring: it holds
    ``every + DELAY``); a token not yet due scores +inf, so it is never evicted before it is judged. The queries
    of an earlier run are read over what is held now, so their attention is renormalised over fewer keys
    (inferred). ``weights``, ``sha256``: as ``kvpop``."""

    method: ClassVar[str] = "kvpop-delayed"
    weights: str = "smollm2-135m"
    sha256: str = ""

    def __post_init__(self):
        self.net, self.card = load_surrogate(self.method, self.weights, self.sha256)

    def ring(self, every: int) -> int:
        return every + DELAY

    def score(self, state: LayerState, obs: Observation, fresh: Tensor) -> Tensor:
        B, Hkv, S, D = obs.keys.shape
        if self.net.shape[1:] != (Hkv, 3 * (D // 2) + 3):
            raise ValueError(f"{self.method} weights {self.weights!r} were trained for {self.net.shape[1]} KV heads "
                             f"(card: {self.card.get('model', '?')}); this model has {Hkv}: "
                             + TRAIN_HINT.format(method=self.method, name="<model>"))
        self.net.to(obs.keys.device)
        newest = obs.query_positions.amax(-1)[:, None, None]  # [B, 1, 1]
        due = obs.valid & (obs.positions + DELAY <= newest) & state.tokens.isnan()
        scored = self.net(delayed_features(obs.keys, obs.values, lookahead_mass(obs, DELAY)), obs.layer)
        state.tokens = torch.where(due, scored, state.tokens)
        return state.tokens.nan_to_num(float("inf"))
