"""Jacap (arXiv 2609.08131, https://arxiv.org/abs/2609.08131): softmax-sensitivity weights x statistical leverage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Observation, Scorer, pool_groups, protect, register_scorer


@register_scorer("jacap")
@dataclass
class Jacap(Scorer):
    """Attention read as a Gaussian channel from query to output; a token's score is what removing it costs the
    channel's capacity: score_i = w_i u_i' A^-1 u_i with A = I + sum_j w_j u_j u_j' (weighted statistical
    leverage; by the determinant lemma, dropping i lowers log det A by -log(1 - score_i)). u_i = v_i; the weight
    w_i = a_i^2 (1 - a_i)^2 * scale^2 * k_i' diag(Lambda_Q) k_i carries the softmax sensitivity a(1 - a) of an
    attention prior a and the query variance along the key. Per query head, mean over the GQA group; the first
    ``n_sink`` tokens are always kept.

    Inferred (the paper's formulas were read through a summary): the prior a = softmax(tau * cos(k_i, mu_q)) with
    mu_q the mean of the last ``window`` (post-RoPE) prompt queries, as CapKV's kvpress code builds its anchor;
    Lambda_Q = their per-dimension variance; w is divided by its maximum per head (the scale of the channel
    noise is not given), as CapKV's kvpress code shifts its weights to a maximum of 1."""

    tau: float = 10.0
    window: int = 512
    n_sink: int = 4

    def __post_init__(self):
        if self.tau <= 0 or self.window < 1 or self.n_sink < 0:
            raise ValueError(f"need tau > 0, window >= 1, n_sink >= 0; got {self.tau}, {self.window}, {self.n_sink}")

    @property
    def observation_window(self) -> int:
        return self.window

    def _capacity(self, obs: Observation):
        """[B, Hq, S] weighted leverage per query head."""
        q = obs.queries.double()  # [B, Hq, W, D]
        use = (obs.query_positions >= self.n_sink)[:, None, :, None].double()
        n = use.sum(2).clamp_min(1)
        mu = (q * use).sum(2) / n  # [B, Hq, D]
        var = (((q - mu[:, :, None]) * use) ** 2).sum(2) / n  # diagonal Lambda_Q
        G = q.shape[1] // obs.keys.shape[1]
        keys = obs.keys.double().repeat_interleave(G, 1)  # [B, Hq, S, D]
        values = obs.values.double().repeat_interleave(G, 1)
        held = (obs.valid & (obs.positions >= self.n_sink)).repeat_interleave(G, 1)
        cos = torch.einsum("bhsd,bhd->bhs", F.normalize(keys, dim=-1), F.normalize(mu, dim=-1))
        prior = torch.softmax((self.tau * cos).masked_fill(~held, float("-inf")), -1).nan_to_num(0.0)
        w = prior**2 * (1 - prior) ** 2 * obs.scale**2 * torch.einsum("bhsd,bhd->bhs", keys**2, var)
        w = w / w.amax(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        return weighted_leverage(w, values).float()

    def _protect(self, scores, obs: Observation):
        G = scores.shape[1] // obs.keys.shape[1]
        return protect(scores, (obs.positions < self.n_sink).repeat_interleave(G, 1))

    def score_per_query_head(self, obs: Observation):
        return self._protect(self._capacity(obs), obs)

    def score(self, obs: Observation):
        return self._protect(pool_groups(self._capacity(obs), obs.keys.shape[1]), obs)


def weighted_leverage(w, u):
    """score_i = w_i u_i' A^-1 u_i with A = I + sum_j w_j u_j u_j'. w: [..., S] >= 0; u: [..., S, D] -> [..., S].

    By the matrix-determinant lemma, removing token i multiplies det A by (1 - score_i)."""
    eye = torch.eye(u.shape[-1], dtype=u.dtype, device=u.device)
    A = eye + (w[..., None] * u).transpose(-1, -2) @ u
    z = torch.linalg.solve_triangular(torch.linalg.cholesky(A), u.transpose(-1, -2), upper=False)  # L^-1 u_i
    return w * z.pow(2).sum(-2)  # u_i' A^-1 u_i = ||L^-1 u_i||^2
