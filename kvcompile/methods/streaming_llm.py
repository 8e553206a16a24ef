"""StreamingLLM (https://arxiv.org/abs/2309.17453): keep the attention sinks and the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Observation, Scorer, protect, register_scorer


@register_scorer("streamingllm")
@dataclass
class StreamingLLM(Scorer):
    """The first ``sinks`` positions always rank first, then recency (later positions score higher)."""

    sinks: int = 4

    def score(self, obs: Observation):
        recency = obs.positions.float()
        return protect(recency, obs.positions < self.sinks)
