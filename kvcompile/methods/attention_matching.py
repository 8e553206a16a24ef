"""Attention Matching ("Fast KV Compaction via Attention Matching", Zweiger, Fu, Guo and Kim, arXiv 2602.16284):
each KV head's tokens replaced by fewer entries whose attention reproduces, for a set of reference queries, both the
attention mass those tokens drew and the output they gave. Weighted entries (``cache.weights``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import PROTOTYPES, Allocator, Observation, is_pinned, register_allocator, register_scorer
from .kvzip import KVzip

_TINY = 1e-30


@register_scorer("reconstruction-queries")
@dataclass
class ReconstructionQueries(KVzip):
    """KVzip's reconstruction of the context for a method that reads the reconstruction's queries itself
    (``attention-matching``): no probe scores (every context token scores 0), the reconstruction's own tokens never
    kept, the first ``n_sink`` pinned."""

    def score(self, obs: Observation):
        return self.context_frame(obs, obs.keys.new_zeros(obs.positions.shape, dtype=torch.float32))


@register_allocator("attention-matching")
@dataclass
class AttentionMatching(Allocator):
    """Per KV head, with every head given the same number of entries (the row's pages shared evenly; a head
    that holds no more keeps its tokens as they are):

    1. Reference queries: ``references`` of the observed window queries, evenly spaced, each with the head's GQA
       group (with KVzip's scorer, the queries of its reconstruction of the context: the paper's "repeat-prefill").
       A_ij is query i's attention to held token j (its full softmax over everything the head holds).
    2. The tokens J to compact: every candidate the head does not keep as it is (pinned tokens are kept first).
       Query i's mass over them is M_i = sum_{j in J} A_ij and their output O_i = sum_{j in J} A_ij v_j / M_i.
    3. Keys: the t tokens of J with the largest root-mean-square attention over the queries (the paper's
       highest-attention subset of the original keys).
    4. Mass: weights w >= 0 with sum_k w_k A_ik ~ M_i, by non-negative least squares (projected gradient,
       accelerated, ``iterations`` steps); each entry's log-weight is log w_k, so it draws w_k times its key's
       attention.
    5. Values: with p_ik = w_k A_ik / sum_k' w_k' A_ik', the values C minimising sum_i |p_i C - O_i|^2 (ridge
       ``ridge`` times the mean diagonal of p^T p).

    The entries keep their keys' positions. Provenance: the abstract and third-party summaries of the method
    (inferred: the solver, the ridge, an even share per head, one reconstruction pass of the uncompressed model for
    every layer where the paper builds the queries layer by layer on the compacted cache)."""

    references: int = 512
    iterations: int = 300
    ridge: float = 1e-4

    strategy = PROTOTYPES

    def __post_init__(self):
        if self.references < 1 or self.iterations < 1 or self.ridge <= 0:
            raise ValueError(f"need references, iterations >= 1 and ridge > 0; got {self.references}, "
                             f"{self.iterations}, {self.ridge}")

    def prototypes(self, observations: list[Observation], scores: Tensor, max_pages: Tensor, page_size: int):
        """(kept [L, B, Hkv, S], keys, values [L, B, Hkv, E, D], positions, log-weights [L, B, Hkv, E], counts
        [L, B, Hkv]) within ``max_pages`` [B] pages of ``page_size`` entries per row."""
        L, B, Hkv, S = scores.shape
        per_head = (max_pages.long() // (L * Hkv)) * page_size  # [B] entries each head may hold
        layers = [self._select(obs, scores[i], per_head) for i, obs in enumerate(observations)]
        E = max(max(int(layer["counts"].max()) for layer in layers), 1)
        gram = torch.stack([_pad(_pad(layer["gram"], E, 2), E, 3) for layer in layers])
        rhs, live = (torch.stack([_pad(layer[k], E, 2) for layer in layers]) for k in ("rhs", "live"))
        weights = _nnls(gram, rhs, live, self.iterations)  # every layer's mass fit in one solve
        entries = [self._entries(obs, layer, w[..., : layer["live"].shape[-1]])
                   for obs, layer, w in zip(observations, layers, weights)]
        kept = torch.stack([_pad(layer["kept"], S, 2) for layer in layers])
        keys, values, positions, log_w = (torch.stack([_pad(e[j], E, 2) for e in entries]) for j in range(4))
        return kept, keys, values, positions, log_w, torch.stack([layer["counts"] for layer in layers])

    def _select(self, obs: Observation, scores: Tensor, per_head: Tensor) -> dict:
        """One layer's kept tokens, entries to write per head and their keys (steps 1 to 3), and the normal
        equations of the mass fit (step 4)."""
        B, Hkv, S, D = obs.keys.shape
        scores = F.pad(scores, (0, max(S - scores.shape[-1], 0)), value=float("-inf"))[..., :S]
        candidate = obs.valid  # the engine's candidates: no scorer's -inf (KVzip's reconstruction tokens) among them
        cap = per_head[:, None].expand(B, Hkv)
        fits = candidate.sum(-1) <= cap
        pinned = candidate & is_pinned(scores)
        pinned &= pinned.long().cumsum(-1) <= cap[..., None]  # the first pins, as many as a head holds
        kept = torch.where(fits[..., None], candidate, pinned)
        compact = candidate & ~kept
        counts = torch.where(fits, 0, cap - pinned.sum(-1)).minimum(compact.sum(-1))  # [B, Hkv] entries to write
        t = int(counts.max())
        live = torch.arange(t, device=counts.device) < counts[..., None]
        layer = {"kept": kept, "counts": counts, "live": live}
        if t == 0:
            none = obs.keys.new_zeros(B, Hkv, 0, 0, dtype=torch.float64)
            return layer | {"gram": none, "rhs": none.sum(-1)}
        attn = self._reference_attention(obs) * compact[:, :, None]  # [B, Hkv, R, S] over J only
        mass = attn.sum(-1)  # [B, Hkv, R]
        target = torch.matmul(attn, obs.values.float()) / mass.clamp_min(_TINY)[..., None]
        chosen = attn.square().mean(2).masked_fill(~compact, -1.0).topk(t, -1).indices  # the RMS's order
        a = attn.gather(-1, chosen[:, :, None].expand(-1, -1, attn.shape[2], -1)) * live[:, :, None]
        gram = a.double().transpose(-1, -2) @ a.double()
        rhs = (a.double().transpose(-1, -2) @ mass.double()[..., None])[..., 0]
        return layer | {"a": a, "target": target, "chosen": chosen, "gram": gram, "rhs": rhs}

    def _entries(self, obs: Observation, layer: dict, w: Tensor):
        """The entries of one layer (step 5): keys, values [B, Hkv, t, D], positions and log-weights [B, Hkv, t]."""
        B, Hkv, _, D = obs.keys.shape
        if "chosen" not in layer:
            empty = obs.keys.new_zeros(B, Hkv, 0, D)
            return empty, empty, obs.positions.new_zeros(B, Hkv, 0), obs.keys.new_zeros(B, Hkv, 0)
        chosen, live = layer["chosen"], layer["live"]
        mix = layer["a"] * w[:, :, None]
        values = _ridge(mix / mix.sum(-1, keepdim=True).clamp_min(_TINY), layer["target"], self.ridge)
        pick = lambda x: x.gather(2, chosen if x.dim() == 3 else chosen[..., None].expand(-1, -1, -1, D))  # noqa: E731
        log_w = w.clamp_min(_TINY).log()
        if obs.log_weights is not None:
            log_w = log_w + pick(obs.log_weights)
        return pick(obs.keys), values.to(obs.values.dtype), pick(obs.positions), log_w * live

    def _reference_attention(self, obs: Observation) -> Tensor:
        """[B, Hkv, R, S] the attention of ``references`` evenly spaced window queries (each with its KV head's GQA
        group: R = G x their number) over every held slot (0 where a query does not see it)."""
        B, Hkv, S, _ = obs.keys.shape
        W = obs.queries.shape[2]
        return obs.window_attention(slice(0, W, -(-W // self.references))).reshape(B, Hkv, -1, S)


def _nnls(gram: Tensor, rhs: Tensor, live: Tensor, iterations: int) -> Tensor:
    """w >= 0 [..., t] minimising |a w - m|^2 from its normal equations (``gram`` = a^T a [..., t, t], ``rhs`` = a^T m
    [..., t]), 0 where not ``live``: accelerated projected gradient, step 1 / the largest eigenvalue of a^T a."""
    v = torch.ones_like(rhs)
    for _ in range(30):  # power iteration: the largest eigenvalue
        v = (gram @ v[..., None])[..., 0]
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(_TINY)
    step = 1.0 / ((gram @ v[..., None])[..., 0] * v).sum(-1, keepdim=True).clamp_min(_TINY)
    w = prev = live.double()
    for k in range(iterations):
        y = w + (k / (k + 3)) * (w - prev)
        prev, w = w, (y - step * ((gram @ y[..., None])[..., 0] - rhs)).clamp_min(0) * live
    return w.float()


def _pad(x: Tensor, n: int, dim: int) -> Tensor:
    """``x`` cut or padded (zeros, False) to n along ``dim``."""
    extra = n - x.shape[dim]
    if extra <= 0:
        return x.narrow(dim, 0, n)
    return torch.cat([x, x.new_zeros(*x.shape[:dim], extra, *x.shape[dim + 1:])], dim)


def _ridge(p: Tensor, target: Tensor, ridge: float) -> Tensor:
    """Values [B, Hkv, t, D] minimising |p C - target|^2 + lambda |C|^2 (p [B, Hkv, R, t], target [B, Hkv, R, D]),
    lambda = ``ridge`` times the mean diagonal of p^T p; a column of p that is all 0 gets 0."""
    p, target = p.double(), target.double()
    gram = p.transpose(-1, -2) @ p
    diag = gram.diagonal(dim1=-2, dim2=-1)
    lam = ridge * diag.mean(-1, keepdim=True).clamp_min(_TINY)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + lam[..., None] * eye, p.transpose(-1, -2) @ target).float()
