"""Expected Attention (https://arxiv.org/abs/2510.00636): the attention future queries are expected to pay."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer, pool_groups, protect, register_scorer


@register_scorer("expected-attention")
@dataclass
class ExpectedAttention(Scorer):
    """Queries are modelled as Gaussian, q ~ N(mu, Sigma), per query head; a key's expected attention logit is
    z = scale * mu.k + scale^2 / 2 * k' Sigma k (the log of E[exp(scale * q.k)]), softmax over the held keys
    after the ``n_sink`` sinks, mean over each GQA group, then (score + epsilon) * ||v|| (``use_vnorm``). Sinks
    are always kept. Formula and defaults follow kvpress's ``ExpectedAttentionPress``.

    Inferred: kvpress takes mu and Sigma of the *pre-RoPE* queries of the whole prompt and rotates them by the
    RoPE matrix averaged over the next 512 positions. kvcompile stores queries after RoPE and does not know the
    rotary frequencies, so mu and Sigma are those of the last ``window`` post-RoPE prompt queries: their spread
    already averages the rotation, over the last ``window`` positions instead of the next 512."""

    window: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        if self.window < 1 or self.n_sink < 0 or self.epsilon < 0:
            raise ValueError(f"need window >= 1, n_sink >= 0, epsilon >= 0; got {self.window}, {self.n_sink}, "
                             f"{self.epsilon}")

    @property
    def observation_window(self) -> int:
        return self.window

    def _expected(self, obs: Observation):
        """[B, Hq, S] softmax of the expected logits over each head's non-sink held keys."""
        q = obs.queries.float()  # [B, Hq, W, D]
        use = (obs.query_positions >= self.n_sink)[:, None, :, None].float()  # [B, 1, W, 1]
        n = use.sum(2).clamp_min(1)
        mu = (q * use).sum(2) / n  # [B, Hq, D]
        G = q.shape[1] // obs.keys.shape[1]
        keys = obs.keys.float().repeat_interleave(G, 1)  # [B, Hq, S, D]
        z = torch.einsum("bhsd,bhd->bhs", keys, mu) * obs.scale
        if self.use_covariance:
            centred = (q - mu[:, :, None]) * use
            cov = torch.einsum("bhwi,bhwj->bhij", centred, centred) / n[..., None]
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
