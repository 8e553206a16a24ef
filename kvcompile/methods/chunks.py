"""Chunks as retention units (kvpress's ChunkKV, EntropyGatedChunkKV and ChunkPress wrappers, docs/methods_wrappers.md).

Each wraps any registered scorer. ChunkKV and EntropyGatedChunkKV turn its scores into one ranking shared by every
head (heads meet by position); ChunkPress ranks within position chunks so every chunk keeps the same share. A
wrapper returns a ranking, never a count: any top k of it is what the kvpress press keeps at a budget of k tokens.
Chunks are spans of ``chunk`` original positions, which are kvpress's chunks of consecutive tokens on a prompt
that nothing was evicted from yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Observation, Wrapper, at_positions, descending_rank, is_pinned, position_sums, register_scorer


def _shared(wrapper: Wrapper, obs: Observation) -> tuple[Tensor, Tensor, Tensor]:
    """The base's scores summed over KV heads per position [B, P], which positions some head holds [B, P], and
    which the base pinned in some head [B, P]."""
    scores = wrapper._base.score(obs).float()
    pinned = is_pinned(scores) & obs.valid
    summed = position_sums(scores.masked_fill(pinned, 0), obs)
    held = position_sums(obs.valid.float(), obs) > 0
    return summed, held, position_sums(pinned.float(), obs) > 0


def _by_chunk(x: Tensor, chunk: int, fill: float = 0.0) -> Tensor:
    """[B, P] -> [B, n_chunks, chunk], padded at the end with ``fill``."""
    return torch.nn.functional.pad(x, (0, -x.shape[1] % chunk), value=fill).view(x.shape[0], -1, chunk)


def _back(order_key: Tensor, held: Tensor, pinned: Tensor, obs: Observation) -> Tensor:
    """Per-position ranking keys [B, P] (lower = kept first) -> scores per held entry [B, Hkv, S]; pinned
    positions rank first."""
    table = (-order_key.float()).masked_fill(~held, float("-inf")).masked_fill(pinned, torch.finfo(torch.float32).max)
    return at_positions(table, obs)


@register_scorer("chunkkv")
@dataclass
class ChunkKV(Wrapper):
    """ChunkKV (https://arxiv.org/abs/2502.00299): a chunk's score is the mean over its held positions of the base
    scores summed over KV heads; whole chunks rank by it, one ranking for every head of the layer (its selection is
    group-consistent). kvpress keeps the top ``max(1, n_chunks (1 - ratio))`` chunks whole, so its kept count only
    approximates the budget; here the budget's last chunk is cut to its first tokens, so no head exceeds it. The
    paper's layer-wise index reuse is not in kvpress and not here."""

    chunk: int = 20

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1:
            raise ValueError(f"chunkkv: chunk must be >= 1, got {self.chunk}")

    def score(self, obs: Observation) -> Tensor:
        summed, held, pinned = _shared(self, obs)
        c = self.chunk
        mean = _by_chunk(summed, c).sum(-1) / _by_chunk(held.float(), c).sum(-1).clamp_min(1)  # [B, n_chunks]
        chunk_rank = descending_rank(mean).repeat_interleave(c, 1)[:, : summed.shape[1]]
        offset = torch.arange(summed.shape[1], device=summed.device) % c
        return _back(chunk_rank * c + offset, held, pinned, obs)


@register_scorer("entropy-gated-chunkkv")
@dataclass
class EntropyGatedChunkKV(Wrapper):
    """kvpress's EntropyGatedChunkKV (0.5.5, no paper): chunks visited by decreasing mean score, as ChunkKV; a chunk
    at or above the median mean whose normalised score entropy is below the median entropy keeps only its top
    ``low_entropy_chunk_length`` tokens; the rest of the budget goes to the best remaining tokens. As a ranking:
    the visited chunks' kept tokens (each chunk best-first), then every other token by score, so any top k keeps
    exactly k tokens, as kvpress does. Entropy: of the chunk's scores shifted up by its minimum when that is
    negative, over ln(held tokens in the chunk)."""

    chunk: int = 10
    low_entropy_chunk_length: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not self.chunk > self.low_entropy_chunk_length >= 1:
            raise ValueError("entropy-gated-chunkkv needs chunk > low_entropy_chunk_length >= 1, got "
                             f"{self.chunk}, {self.low_entropy_chunk_length}")

    def score(self, obs: Observation) -> Tensor:
        summed, held, pinned = _shared(self, obs)
        B, P = summed.shape
        c, inf = self.chunk, float("inf")
        tokens = _by_chunk(summed.masked_fill(~held, -inf), c, -inf)  # [B, n, c]
        present = tokens > -inf
        count = present.sum(-1)
        mean = tokens.masked_fill(~present, 0).sum(-1) / count.clamp_min(1)
        shifted = tokens - tokens.masked_fill(~present, inf).amin(-1, keepdim=True).clamp(max=0)
        shifted = shifted.masked_fill(~present, 0)
        p = shifted / (shifted.sum(-1, keepdim=True) + 1e-8)
        entropy = -(p * (p + 1e-8).log()).sum(-1) / count.clamp_min(2).float().log()
        entropy = entropy.clamp(0, 1).masked_fill(count <= 1, 0)
        real = count > 0
        spiky = (mean >= _median(mean, real)) & (entropy < _median(entropy, real))
        within = descending_rank(tokens)  # [B, n, c] best first; absent slots last
        first = present & ((within < self.low_entropy_chunk_length) | ~spiky[..., None])
        chunk_rank = descending_rank(mean.masked_fill(~real, -inf))[..., None]
        key = torch.where(first, chunk_rank * c + within, (P + c) + descending_rank(tokens.flatten(1)).view_as(within))
        return _back(key.flatten(1)[:, :P], held, pinned, obs)


def _median(x: Tensor, real: Tensor) -> Tensor:
    """[B, 1] the lower median of each row's ``real`` entries (``torch.median``'s convention)."""
    return torch.stack([row[keep].median() for row, keep in zip(x, real)])[:, None]


@register_scorer("chunk")
@dataclass
class ChunkPress(Wrapper):
    """kvpress's ChunkPress (FINCH-style): the base scores each chunk of ``chunk`` positions on its own (it sees
    only that chunk's keys, and only queries inside the chunk, the last ones as many as it reads), and every chunk
    keeps the same share of its tokens, per head: the ranking is each token's rank within its chunk over the
    chunk's held count (what the base pins comes first within its chunk only). kvpress keeps
    ``max(1, len (1 - ratio))`` per chunk; here the shares differ from that by rounding only. A base that reads
    queries makes the cache remember the whole prompt's (up to ``window``), since each chunk's last queries are
    needed, not only the prompt's."""

    chunk: int = 1024
    window: int = 8192

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1 or self.window < 1:
            raise ValueError(f"chunk: chunk and window must be >= 1, got {self.chunk}, {self.window}")

    @property
    def observation_window(self) -> int:
        return self.window if self._base.observation_window else 0

    def score(self, obs: Observation) -> Tensor:
        ids = obs.positions // self.chunk
        qids = obs.query_positions.clamp_min(0) // self.chunk
        out = torch.full(obs.valid.shape, float("-inf"), device=obs.keys.device)
        reads = self._base.observation_window
        for j in ids[obs.valid].unique().tolist():
            valid = obs.valid & (ids == j)
            qp = obs.query_positions.masked_fill(qids != j, -1)
            qp = qp.masked_fill(qp <= qp.amax(-1, keepdim=True) - reads, -1)  # the chunk's last ``reads`` queries
            scores = self._base.score(dataclasses.replace(obs, valid=valid, query_positions=qp)).float()
            held = valid.sum(-1, keepdim=True).clamp_min(1)
            share = -(descending_rank(scores.masked_fill(~valid, float("-inf"))) + 0.5) / held
            out = torch.where(valid, share, out)
        return out
