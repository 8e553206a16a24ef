"""CapKV (https://arxiv.org/abs/2604.25975), as kvpress ships it: softmax-weighted leverage of the values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Observation, register_scorer
from .jacap import Jacap, weighted_leverage
from .rope import future_rotation, pre_rope


@register_scorer("cappress")
@dataclass
class CapKV(Jacap):
    """Per query head: weights w_j = exp(tau * c_j - max tau * c), c_j = cos(k_j, mu) with mu the mean observed
    query; A = I + sum_j (w_j + epsilon) v_j v_j'; score_j = w_j * v_j' A^-1 v_j (a token's share of the
    capacity of the attention channel, u = v), mean over each GQA group. Sums and maxima run over the held tokens
    after the first ``n_sink`` positions, which are always kept. Formula and defaults follow kvpress's
    ``CapPress`` (cosine, max shift and u = v are kvpress's departures from the paper). Jacap, the same leverage
    with a softmax-sensitivity weight, supplies the sinks, the GQA mean and the query window.

    The anchor mu is, as in kvpress, the mean of the prompt's queries before RoPE after the sinks, moved by the RoPE
    rotation averaged over the ``n_future_positions`` positions after the prompt.

    Inferred: kvpress averages every prompt query; the observation ring holds the last ``window``, so the mean is
    over those. On a model whose rotary frequencies kvcompile cannot read, mu is the plain mean of the post-RoPE
    window queries (version 2's behaviour on every model)."""

    tau: float = 5.0
    epsilon: float = 1e-6
    n_future_positions: int = 512

    def __post_init__(self):
        super().__post_init__()
        if self.epsilon < 0 or self.n_future_positions < 1:
            raise ValueError(f"need epsilon >= 0 and n_future_positions >= 1, got {self.epsilon}, "
                             f"{self.n_future_positions}")

    def _capacity(self, obs: Observation):
        """[B, Hq, S] w_j * v_j' A^-1 v_j per query head (0 off the scored tokens)."""
        q = pre_rope(obs, obs.queries.float(), obs.query_positions[:, None])  # [B, Hq, W, D]
        after_sinks = (obs.query_positions >= self.n_sink)[:, None, :, None].float()
        mu = (q * after_sinks).sum(2) / after_sinks.sum(2).clamp_min(1)  # [B, Hq, D]
        mu = torch.einsum("bed,bhd->bhe", future_rotation(obs, self.n_future_positions).float(), mu)
        G = q.shape[1] // obs.keys.shape[1]
        keys = obs.keys.float().repeat_interleave(G, 1)  # [B, Hq, S, D]
        values = obs.values.float().repeat_interleave(G, 1)
        held = (obs.valid & (obs.positions >= self.n_sink)).repeat_interleave(G, 1)
        cos = torch.einsum("bhsd,bhd->bhs", F.normalize(keys, dim=-1), F.normalize(mu, dim=-1)).clamp(-1, 1)
        logits = (self.tau * cos).masked_fill(~held, float("-inf"))
        w = (logits - logits.amax(-1, keepdim=True)).exp().nan_to_num(0.0)
        lifted = (w + self.epsilon) * held  # the weights inside A
        return w * weighted_leverage(lifted, values) / lifted.clamp_min(torch.finfo(w.dtype).tiny)
