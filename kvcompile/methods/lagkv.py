"""LagKV (https://arxiv.org/abs/2504.04704): tokens scored against the min/max range of the partition after them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Observation, Scorer, protect, register_scorer


@register_scorer("lagkv")
@dataclass
class LagKV(Scorer):
    """After the first ``n_sink`` held tokens, each head's sequence is cut into partitions of ``lag_size``; a
    partition's keys (and values) are min/max-normalised per channel by the range of the *next* partition, and a
    token's score is the std of its normalised channels, softmax over its partition, averaged over keys and values.
    Unless ``cross_scoring``, that is replaced by the token's rank within its partition / ``lag_size``, so any
    top-k keeps about as many tokens of every partition. The sinks and the tail (the last full partition plus the
    remainder, which have no successor) are always kept; a head holding fewer than ``n_sink + 2 * lag_size``
    tokens ranks by recency. Attention-free. Algorithm and defaults follow kvpress's ``LagKVPress``.

    Inferred: partitions follow each head's held order (after an earlier compression, held tokens, not
    positions); a channel whose reference range is 0 is divided by 1e-6 (kvpress: NaN)."""

    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def __post_init__(self):
        if self.n_sink < 0 or self.lag_size < 2:
            raise ValueError(f"need n_sink >= 0 and lag_size >= 2, got {self.n_sink}, {self.lag_size}")

    def score(self, obs: Observation):
        S, L = obs.keys.shape[2], self.lag_size
        N = max(2, -(-(S - self.n_sink) // L))  # partitions that cover every held token
        n = obs.valid.sum(-1, keepdim=True)  # [B, Hkv, 1] tokens held
        j = torch.arange(S, device=n.device)
        part = (j - self.n_sink).div(L, rounding_mode="floor")  # [S]; negative on the sinks
        lagged = (self._lagged(obs.keys, N) + self._lagged(obs.values, N)) / 2  # [B, Hkv, N, L]
        if not self.cross_scoring:
            lagged = lagged.argsort(dim=-1, stable=True).argsort(dim=-1) / L  # rank within the partition, 0 = lowest
        ramp = (j - self.n_sink) / (n - self.n_sink).clamp_min(1)
        short = n < self.n_sink + 2 * L
        scores = torch.where(short, ramp, F.pad(lagged.flatten(2), (self.n_sink, 0))[..., :S])
        tail = part >= (n - self.n_sink) // L - 1  # the last full partition and the rest: no successor
        return protect(scores.float(), obs.valid & ((part < 0) | (~short & tail)))

    def _lagged(self, x, N: int):
        """[B, Hkv, N, L] softmax score of each token of partition p against partition p + 1 (0 for the last)."""
        B, Hkv, S, D = x.shape
        x = F.pad(x.float(), (0, 0, 0, self.n_sink + N * self.lag_size - S))[:, :, self.n_sink :]
        x = x.reshape(B, Hkv, N, self.lag_size, D)
        ref = x[:, :, 1:]
        low, high = ref.amin(3, keepdim=True), ref.amax(3, keepdim=True)
        spread = ((x[:, :, :-1] - low) / (high - low).clamp_min(1e-6)).std(-1)
        return F.pad(spread.softmax(-1), (0, 0, 0, 1))

