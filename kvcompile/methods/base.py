"""The method contract: a Scorer ranks tokens within a head, an Allocator decides how many each head keeps.

Both are small dataclasses whose fields are hyperparameters; runtime state lives in the cache. Neither touches
the model or the cache: the compressor hands them tensors and does top-k selection and compaction itself.
Shape letters: L layers, B batch rows, Hq/Hkv query/KV heads, S tokens held, W observed queries, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCORERS: dict[str, type] = {}
ALLOCATORS: dict[str, type] = {}


def _registrar(table: dict[str, type]):
    def register(name: str):
        def deco(cls):
            table[name] = cls
            cls.name = name
            return cls

        return deco

    return register


register_scorer = _registrar(SCORERS)
register_allocator = _registrar(ALLOCATORS)


@dataclass
class Observation:
    """What prefill already has for one layer, as dense per-head views of the cache.

    keys, values: [B, Hkv, S, D] post-RoPE; positions: [B, Hkv, S] original positions; valid: [B, Hkv, S];
    queries: [B, Hq, W, D] the layer's last W queries (post-RoPE); query_positions: [B, W], -1 where there was no
    query (short prompt, padding); scale: the layer's softmax scale; window: its sliding window (0 = none).
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    valid: Tensor
    queries: Tensor
    query_positions: Tensor
    scale: float
    window: int
    layer: int
    num_layers: int

    def window_attention(self) -> Tensor:
        """Softmax attention of the observed queries over the held keys: [B, Hq, W, S] (0 where not visible)."""
        B, Hkv, S, D = self.keys.shape
        Hq, W = self.queries.shape[1], self.queries.shape[2]
        q = self.queries.reshape(B, Hkv, Hq // Hkv, W, D).float()
        logits = torch.einsum("bhgwd,bhsd->bhgws", q, self.keys.float()) * self.scale
        qp = self.query_positions[:, None, None, :, None]
        kp = self.positions[:, :, None, None, :]
        visible = self.valid[:, :, None, None, :] & (kp <= qp) & (qp >= 0)
        if self.window > 0:
            visible = visible & (qp - kp < self.window)
        attn = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        return attn.reshape(B, Hq, W, S)


class Scorer:
    """Per-token importance within each KV head."""

    def score(self, obs: Observation) -> Tensor:
        """Return [B, Hkv, S] scores; higher scores are kept. Invalid positions are ignored by the caller."""
        raise NotImplementedError

    @property
    def observation_window(self) -> int:
        """How many recent queries per layer the cache must remember for this scorer (0 = none)."""
        return 0


class Allocator:
    """How many tokens each (layer, KV head) keeps under one budget per sequence."""

    def allocate(self, scores: Tensor, lengths: Tensor, budget: Tensor) -> Tensor:
        """scores [L, B, Hkv, S] (-inf where nothing is held), lengths [L, B, Hkv], budget [B] tokens per sequence
        summed over all layers and KV heads. Return counts [L, B, Hkv] (int64) with counts <= lengths and
        counts.sum((0, 2)) <= budget."""
        raise NotImplementedError


def per_head_share(lengths: Tensor, budget: Tensor) -> Tensor:
    """[B] average tokens per (layer, KV head) that ``budget`` [B] allows."""
    L, _, Hkv = lengths.shape
    return budget // (L * Hkv)


def protect(scores: Tensor, mask: Tensor) -> Tensor:
    """Scores where ``mask`` tokens rank above everything else (kept whenever the head keeps any)."""
    return scores.masked_fill(mask, torch.finfo(scores.dtype).max)
