"""Any prefill scorer at decode time (kvpress's DecodingPress, docs/methods_wrappers.md): re-score every held token from
the queries generation produced since the last run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .base import SCORERS, Observation
from .decoding import DecodePolicy, LayerState, register_policy


@register_policy("scorer")
@dataclass
class ScorerDecode(DecodePolicy):
    """Scores from the registered scorer ``scorer`` (``scorer_args`` its parameters) over the whole cache (prompt
    and generated tokens); its queries are the decode steps since the previous run, the last ``buffer`` of them
    (kvpress's ``hidden_states_buffer_size``: its buffer empties at every compression); no state between runs.
    kvpress searches the compression ratio that yields its target size; the schedule here passes the count."""

    scorer: str = "snapkv"
    scorer_args: dict = field(default_factory=dict)
    buffer: int = 256

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r}; known: {sorted(SCORERS)}")
        if self.buffer < 1:
            raise ValueError(f"buffer must be >= 1, got {self.buffer}")
        self._scorer = SCORERS[self.scorer](**self.scorer_args)

    def ring(self, every: int) -> int:
        return min(self.buffer, every) if self._scorer.observation_window else 0

    def score(self, state: LayerState, obs: Observation, fresh):
        qp = obs.query_positions.masked_fill(~fresh, -1)
        return self._scorer.score(dataclasses.replace(obs, query_positions=qp)).float()
