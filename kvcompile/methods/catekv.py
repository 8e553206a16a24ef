"""CateKV (ICML 2025, https://github.com/jhy-123/CateKV): consistent heads are compressed, adaptive heads kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Allocator, Observation, Scorer, register_allocator, register_scorer
from .shares import attention_mass, water_fill


@register_scorer("catekv")
@dataclass
class CateKV(Scorer):
    """Chunks of ``chunk`` tokens score the number of the last ``last_q`` queries that hit them (chunk_top_num),
    plus half the chunk's mean attention to break ties; the first ``init`` and last ``recent`` positions are kept
    (a head that cannot keep them all takes the earliest init and the newest recent tokens in turn; inferred).

    A query hits a chunk when it pays any of its tokens more than the head's threshold v_min + (v_max - v_min) *
    ``top_threshold``, with v_min / v_max the (1 - ``top_fraction``) / ``top_fraction`` quantiles of the head's
    attention (GQA group mean) to the middle tokens. From the official code.
    """

    last_q: int = 64
    init: int = 64
    recent: int = 256
    chunk: int = 16
    top_threshold: float = 0.6
    top_fraction: float = 0.995

    def __post_init__(self):
        if min(self.last_q, self.chunk) < 1 or min(self.init, self.recent) < 0:
            raise ValueError("last_q and chunk must be >= 1, init and recent >= 0")
        if not (0 <= self.top_threshold <= 1 and 0.5 <= self.top_fraction <= 1):
            raise ValueError(f"need 0 <= top_threshold <= 1 and 0.5 <= top_fraction <= 1, got {self.top_threshold}, "
                             f"{self.top_fraction}")

    @property
    def observation_window(self) -> int:
        return self.last_q

    def score(self, obs: Observation):
        B, Hkv, S, _ = obs.keys.shape
        attn = obs.window_attention()  # [B, Hq, W, S]
        attn = attn.reshape(B, Hkv, -1, *attn.shape[2:]).mean(2)  # [B, Hkv, W, S]
        last = obs.query_positions.amax(-1)[:, None, None]
        edge = (obs.positions < self.init) | (obs.positions > last - self.recent)
        middle = obs.valid & ~edge  # [B, Hkv, S]
        asked = (obs.query_positions >= 0)[:, None, :, None]  # [B, 1, W, 1]
        counted = middle[:, :, None, :] & asked
        v_min, v_max = _quantiles(attn, counted, (1 - self.top_fraction, self.top_fraction))
        thr = v_min + (v_max - v_min) * self.top_threshold
        hit = (attn > thr[..., None, None]) & counted
        n_chunks = -(-S // self.chunk)
        pad = n_chunks * self.chunk - S
        hits = F.pad(hit, (0, pad)).unflatten(-1, (n_chunks, self.chunk)).any(-1).sum(2)  # chunk_top_num [B, Hkv, C]
        mean = F.pad(attn * asked, (0, pad)).unflatten(-1, (n_chunks, self.chunk)).mean((2, 4))  # [B, Hkv, C]
        per_chunk = hits + 0.5 * mean / mean.amax(-1, keepdim=True).clamp_min(torch.finfo(mean.dtype).tiny)
        tokens = per_chunk.repeat_interleave(self.chunk, dim=-1)[..., :S]
        preference = torch.where(obs.positions < self.init, 2 * obs.positions, 2 * (last - obs.positions) + 1)
        return _pin_in_order(tokens, obs.valid & edge, preference)


def _pin_in_order(scores: Tensor, mask: Tensor, preference: Tensor) -> Tensor:
    """Like ``protect``, but a head that cannot keep every pinned token keeps those of lowest ``preference``
    first: pinned scores count down from the float32 max one step per preference rank, staying above what
    ``protect`` writes for any other dtype."""
    top = torch.tensor(torch.finfo(torch.float32).max).view(torch.int32)
    pinned = (top - preference.clamp(0, 2**16 - 1).to(torch.int32)).view(torch.float32)
    return torch.where(mask, pinned, scores.float())


def _quantiles(x: Tensor, mask: Tensor, qs: tuple[float, ...]) -> list[Tensor]:
    """The ``qs`` quantiles (lower) of each head's masked entries: x, mask [B, Hkv, ...] -> [B, Hkv] each (0 if
    the head has none)."""
    flat = x.masked_fill(~mask, float("inf")).flatten(2).sort(-1).values
    n = mask.flatten(2).sum(-1)
    picks = [((n - 1).clamp_min(0).double() * q).floor().long() for q in qs]
    return [flat.gather(-1, i[..., None])[..., 0].masked_fill(n == 0, 0.0) for i in picks]


@register_allocator("catekv")
@dataclass
class CateKVHeads(Allocator):
    """The ``adaptive_fraction`` of heads whose scores vary least across their tokens (lowest coefficient of
    variation std / mean: no few chunks stand out) are adaptive and keep as much as the budget allows; the other,
    consistent heads keep ``consistent_share`` of the uniform per-head share, and get what adaptive heads cannot
    hold on top (paper: consistent heads a fixed sparse budget, adaptive heads the full cache).

    ``adaptive_heads`` [L][Hkv] (True = adaptive) comes from ``calibration.catekv.calibrate`` (the paper's offline
    classification over calibration texts); without it the same test runs on each prompt's own scores (inferred).
    Inferred: the consistent heads' budget as a share of the uniform one, needed to honour a byte budget.
    """

    adaptive_fraction: float = 0.4
    consistent_share: float = 0.25
    adaptive_heads: tuple[tuple[bool, ...], ...] | None = None

    def __post_init__(self):
        if not (0 <= self.adaptive_fraction <= 1 and 0 <= self.consistent_share <= 1):
            raise ValueError("adaptive_fraction and consistent_share must be in [0, 1]")
        if self.adaptive_heads is not None:
            self.adaptive_heads = tuple(tuple(bool(a) for a in row) for row in self.adaptive_heads)

    def classify(self, cv: Tensor) -> Tensor:
        """[L, B, Hkv] coefficient of variation -> adaptive [L, B, Hkv] (the lowest ``adaptive_fraction`` per row)."""
        L, B, Hkv = cv.shape
        flat = cv.permute(1, 0, 2).reshape(B, L * Hkv)
        rank = flat.argsort(dim=-1, stable=True).argsort(dim=-1)
        adaptive = rank < round(self.adaptive_fraction * L * Hkv)
        return adaptive.reshape(B, L, Hkv).permute(1, 0, 2)

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, _ = scores.shape
        if self.adaptive_heads is None:
            adaptive = self.classify(variation(scores))
        elif (len(self.adaptive_heads), len(self.adaptive_heads[0])) != (L, Hkv):
            raise ValueError(f"adaptive_heads is {len(self.adaptive_heads)}x{len(self.adaptive_heads[0])}, "
                             f"the cache {L}x{Hkv}")
        else:
            adaptive = torch.tensor(self.adaptive_heads, device=scores.device)[:, None, :].expand(L, B, Hkv)
        adaptive, caps = (x.permute(1, 0, 2).reshape(B, L * Hkv) for x in (adaptive, lengths.long()))
        share = budget // (L * Hkv)
        floor = (~adaptive * (self.consistent_share * share[:, None]).long()).minimum(caps)
        rest = budget - floor.sum(-1)
        first = water_fill(adaptive.double(), caps - floor, rest)
        then = water_fill((~adaptive).double(), caps - floor - first, rest - first.sum(-1))
        return (floor + first + then).reshape(B, L, Hkv).permute(1, 0, 2)


def variation(scores: Tensor) -> Tensor:
    """Coefficient of variation [...] of each head's held, unpinned scores [..., S] (clamped at 0; 0 if all 0)."""
    _, pinned = attention_mass(scores)
    free = (scores > float("-inf")) & ~pinned
    x = scores.clamp_min(0).masked_fill(~free, 0.0)
    n = free.sum(-1).clamp_min(1)
    mean = x.sum(-1) / n
    var = ((x - mean[..., None]).pow(2) * free).sum(-1) / n
    return (var.sqrt() / mean).nan_to_num(0.0, posinf=0.0)
