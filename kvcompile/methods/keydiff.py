"""KeyDiff (https://arxiv.org/abs/2504.15364): keep the keys least similar to the head's mean key direction."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from .base import Observation, Scorer, register_scorer


@register_scorer("keydiff")
@dataclass
class KeyDiff(Scorer):
    """Score = -cos(k, a), a = mean of the head's unit-length held keys: distinctive keys are kept; needs no
    attention. The paper evicts block by block while prefilling: ``apply(..., prefill_chunk=block)`` gives that
    schedule, one compression per block."""

    def score(self, obs: Observation):
        keys = obs.keys.float()
        unit = F.normalize(keys, dim=-1) * obs.valid[..., None]
        anchor = unit.sum(2, keepdim=True) / obs.valid.sum(-1)[..., None, None].clamp_min(1)
        return -F.cosine_similarity(keys, anchor, dim=-1)
