"""Presses in sequence (kvpress's ComposedPress): a first scorer prefilters, the wrapped scorer picks among what
it kept."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .base import SCORERS, Observation, Wrapper, descending_rank, register_scorer


@register_scorer("composed")
@dataclass
class Composed(Wrapper):
    """``first`` (a registered scorer, ``first_args`` its parameters) keeps ``keep`` of each head's held tokens (at
    least one); the base scorer then ranks those survivors as if they were all the head held. The ranking puts
    the survivors first, in the base's order, then the rest in ``first``'s order: at any budget up to ``keep``
    of the tokens the selection is kvpress's, whose final ratio is the product of the presses' ratios; a larger
    budget keeps first's next best too, so the budget, not the ratios, sets what is held."""

    first: str = ""
    first_args: dict = field(default_factory=dict)
    keep: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if self.first not in SCORERS:
            raise ValueError(f"composed: first must be a registered scorer, got {self.first!r} (give it with "
                             f"recipes.compose('composed', <recipe>, first='knorm', keep=0.5)); known: "
                             f"{sorted(SCORERS)}")
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"composed: keep must be in (0, 1], got {self.keep}")
        self._first = SCORERS[self.first](**self.first_args)

    @property
    def observation_window(self) -> int:
        return max(self._first.observation_window, self._base.observation_window)

    def sources(self):
        return tuple(dict.fromkeys(self._first.sources() + self._base.sources()))

    def score(self, obs: Observation):
        first = descending_rank(self._first.score(obs).float().masked_fill(~obs.valid, float("-inf")))
        n = (obs.valid.sum(-1, keepdim=True) * self.keep).floor().clamp_min(1)
        survives = obs.valid & (first < n)
        then = self._base.score(dataclasses.replace(obs, valid=survives)).float()
        then = descending_rank(then.masked_fill(~survives, float("-inf")))
        key = torch.where(survives, then, n.long() + first)
        return (-key.float()).masked_fill(~obs.valid, float("-inf"))
