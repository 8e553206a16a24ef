"""Compactor's leverage component (https://arxiv.org/abs/2507.08143) alone: outlying keys by statistical leverage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer, register_scorer
from .compactor import leverage, zscore
from .rope import pre_rope


@register_scorer("leverage-score")
@dataclass
class LeverageScore(Scorer):
    """Score = z(leverage of the head's centred held keys), approximated through a right Gaussian sketch of width
    ``sketch``; z = z-score over the head's held tokens. Attention-free. The same component as ``compactor``'s,
    without its sinks. Algorithm and defaults follow kvpress's ``LeverageScorePress``.

    The keys are taken before RoPE, as kvpress recomputes them (rotated back by their positions; as held on a model
    whose rotary frequencies kvcompile cannot read). Inferred: (1) version 2 used the post-RoPE keys. (2) The
    sketch is drawn from ``seed`` + layer, once per head for every batch row (kvpress: fresh per call, batch row
    and head), so scores are reproducible and a row's do not depend on the others. (3) The Gram matrix gets a
    1e-9 relative ridge (kvpress: Cholesky jitter from 1e-2), so leverage is exact where the sketch spans the
    keys. (4) z-scores are per head (kvpress: over the whole layer)."""

    sketch: int = 48
    seed: int = 0

    def __post_init__(self):
        if self.sketch < 1:
            raise ValueError(f"sketch must be >= 1, got {self.sketch}")

    def score(self, obs: Observation):
        g = torch.Generator(device=obs.keys.device).manual_seed(self.seed + obs.layer)
        return zscore(leverage(pre_rope(obs, obs.keys, obs.positions), obs.valid, self.sketch, g), obs.valid)
