"""Heads that stream: a head judged local by its structure (a DuoAttention streaming head, a SimLayerKV lazy layer)
keeps its attention sinks and recent tokens and nothing else, and the budget it leaves goes to the other heads.

A scorer rules a held token out by scoring it ``RULED_OUT``; the ``fill-eligible`` allocator caps every head at
the tokens its scorer left eligible, so a streaming head holds exactly its window whatever the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Allocator, Observation, protect, register_allocator
from .shares import water_fill

RULED_OUT = torch.finfo(torch.float32).min  # what the compressor turns a scorer's -inf into: never eligible


def recent_window(obs: Observation, sinks: int, recent: int) -> Tensor:
    """[B, Hkv, S] the first ``sinks`` positions and the ``recent`` newest of each row (by position)."""
    newest = obs.positions.masked_fill(~obs.valid, -1).flatten(1).amax(1)[:, None, None]  # [B, 1, 1]
    return obs.valid & ((obs.positions < sinks) | (obs.positions > newest - recent))


def streaming_scores(obs: Observation, window: Tensor) -> Tensor:
    """[B, Hkv, S] StreamingLLM's order inside ``window`` (pinned; sinks and recent alike), everything else ruled
    out."""
    return protect(obs.positions.float(), window).masked_fill(~window, RULED_OUT)


@register_allocator("fill-eligible")
@dataclass
class FillEligible(Allocator):
    """Equal shares per (layer, KV head), each capped at the tokens its scorer did not rule out (``RULED_OUT``)
    and at what it holds; what the capped heads cannot take goes to the others (water-filling)."""

    def allocate(self, scores, lengths, budget):
        caps = (scores > RULED_OUT).sum(-1).minimum(lengths.long())  # [L, B, Hkv]
        L, B, Hkv = caps.shape
        flat = caps.permute(1, 0, 2).reshape(B, L * Hkv)
        counts = water_fill(torch.ones(flat.shape, device=flat.device), flat, budget)
        return counts.reshape(B, L, Hkv).permute(1, 0, 2)
