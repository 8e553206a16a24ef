"""Expected Attention (https://arxiv.org/abs/2510.00636): the attention future queries are expected to pay."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer, pool_groups, protect, register_scorer
from .rope import future_rotation, pre_rope


@register_scorer("expected-attention")
@dataclass
class ExpectedAttention(Scorer):
    """Queries are modelled as Gaussian, q ~ N(mu, Sigma), per query head; a key's expected attention logit is
    z = scale * mu.k + scale^2 / 2 * k' Sigma k (the log of E[exp(scale * q.k)]), softmax over the held keys
    after the ``n_sink`` sinks, mean over each GQA group, then (score + epsilon) * ||v|| (``use_vnorm``). Sinks
    are always kept. Formula and defaults follow kvpress's ``ExpectedAttentionPress``.

    mu and Sigma are those of the prompt's queries before RoPE (after the sinks), moved by the RoPE rotation R
    averaged over the ``n_future_positions`` positions after the prompt: R mu, R Sigma R', as kvpress does.

    Inferred: kvpress takes the statistics over every prompt query; the observation ring holds the last
    ``window``, so these are over those (rotated back by their positions). On a model whose rotary frequencies
    kvcompile cannot read, the post-RoPE queries are used as they are, with no future rotation (version 2's
    behaviour on every model: their spread averages the rotation over the last ``window`` positions instead)."""

    window: int = 512
    n_sink: int = 4
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        if self.window < 1 or self.n_sink < 0 or self.epsilon < 0 or self.n_future_positions < 1:
            raise ValueError(f"need window >= 1, n_sink >= 0, epsilon >= 0, n_future_positions >= 1; got "
                             f"{self.window}, {self.n_sink}, {self.epsilon}, {self.n_future_positions}")

    @property
    def observation_window(self) -> int:
        return self.window

    def _expected(self, obs: Observation):
        """[B, Hq, S] softmax of the expected logits over each head's non-sink held keys."""
        q = pre_rope(obs, obs.queries.float(), obs.query_positions[:, None])  # [B, Hq, W, D]
        use = (obs.query_positions >= self.n_sink)[:, None, :, None].float()  # [B, 1, W, 1]
        n = use.sum(2).clamp_min(1)
        mu = (q * use).sum(2) / n  # [B, Hq, D]
        R = future_rotation(obs, self.n_future_positions).float()  # [B, D, D]
        G = q.shape[1] // obs.keys.shape[1]
        keys = obs.keys.float().repeat_interleave(G, 1)  # [B, Hq, S, D]
        z = torch.einsum("bhse,bed,bhd->bhs", keys, R, mu) * obs.scale
        if self.use_covariance:
            centred = (q - mu[:, :, None]) * use
            cov = torch.einsum("bhwi,bhwj->bhij", centred, centred) / n[..., None]
            cov = torch.einsum("bie,bhef,bjf->bhij", R, cov, R)
            z = z + 0.5 * obs.scale**2 * ((keys @ cov) * keys).sum(-1)
        held = (obs.valid & (obs.positions >= self.n_sink)).repeat_interleave(G, 1)
        return torch.softmax(z.masked_fill(~held, float("-inf")), -1).nan_to_num(0.0)

    def _finish(self, scores, obs: Observation):
        if self.use_vnorm:
            G = scores.shape[1] // obs.values.shape[1]
            scores = (scores + self.epsilon) * obs.values.float().norm(dim=-1).repeat_interleave(G, 1)
        G = scores.shape[1] // obs.keys.shape[1]
        return protect(scores, (obs.positions < self.n_sink).repeat_interleave(G, 1))

    def score_per_query_head(self, obs: Observation):
        return self._finish(self._expected(obs), obs)

    def score(self, obs: Observation):
        return self._finish(pool_groups(self._expected(obs), obs.keys.shape[1]), obs)
