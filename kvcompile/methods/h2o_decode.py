"""H2O at decode time (https://arxiv.org/abs/2306.14048; details as in awslabs/keys_values):
rank held tokens by the attention they received, summed over the generated steps."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Observation
from .decoding import DecodePolicy, LayerState, register_policy, step_attention


@register_policy("h2o-decode")
@dataclass
class H2ODecode(DecodePolicy):
    """Cumulative attention (averaged over each GQA group) of every decode query since the first decode step;
    prefill attention is not counted (keys_values' ``h2o-orig``), and a new token starts at 0. The recent window
    is the schedule's protected span (keys_values' grace period)."""

    def score(self, state: LayerState, obs: Observation, fresh):
        received = (step_attention(obs) * fresh[:, None, :, None]).sum(2)
        state.tokens = state.tokens.nan_to_num(0.0) + received
        return state.tokens
