"""SAKI (arXiv 2608.03228 v1 as a detailed reading reports it): a rank-r index of one head's keys
that preserves attention *scores*, not the keys themselves.

With pre-RoPE query second moment ``Σq`` (uncentered), centered key second moment ``Σk`` and key mean ``μ``, the
score error of a rank-r map ``M`` on keys, ``qᵀ(I − M)(k − μ)``, has mean square ``‖Σq^½ (I − M) Σk^½‖²_F`` over
independent queries and keys. With ``C = Σq^½ Σk^½`` and its truncated SVD ``C_r = U_r Λ_r V_rᵀ``, the optimum is
``M_r = Σq^-½ C_r Σk^-½`` (residual ``Σ_{i>r} λ_i²``), factored as ``B_q B_kᵀ`` with ``B_q = Σq^-½ U_r Λ_r^½``,
``B_k = Σk^-½ V_r Λ_r^½``: a key is stored as its code ``c = B_kᵀ(k − μ)`` (r numbers) and scored as
``(B_qᵀ q)ᵀ c + qᵀ μ``. Key PCA at the same rank (``M = V Vᵀ``, V the top eigenvectors of ``Σk``) is the baseline
it provably beats on that mean square. The paper's v2 "random-matrix noise correction" was seen only in its title:
not implemented. Inferred here: the small-eigenvalue floor of the inverse square roots (``EPS`` of the largest).
Pure tensor math (methods know nothing of the runtime); ``calibration.saki`` measures a model's moments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EPS = 1e-6  # eigenvalues below EPS x the largest are floored there before an inverse square root (inferred)


@dataclass(frozen=True)
class LowRankKeys:
    """A rank-r map of one head's pre-RoPE keys: ``codes`` stores a key in r numbers, ``reconstruct`` gives back
    ``μ + M (k − μ)`` (what RoPE then rotates), and ``scores`` reads codes with a query directly."""

    mean: Tensor  # [D]
    key_map: Tensor  # [D, r]: B_k
    query_map: Tensor  # [D, r]: B_q (for PCA, the same basis as B_k)

    @property
    def rank(self) -> int:
        return self.key_map.shape[1]

    def codes(self, keys: Tensor) -> Tensor:
        """[..., r] the stored form of ``keys`` [..., D]."""
        return (keys - self.mean) @ self.key_map

    def reconstruct(self, keys: Tensor) -> Tensor:
        """[..., D] ``μ + M (k − μ)``: the key the index scores against (for a query q, ``q · reconstruct(k)`` equals
        ``scores``)."""
        return self.mean + self.codes(keys) @ self.query_map.T

    def scores(self, queries: Tensor, codes: Tensor) -> Tensor:
        """[..., Q, S] approximate ``q · k`` from queries [..., Q, D] and codes [..., S, r]."""
        return (queries @ self.query_map) @ codes.transpose(-1, -2) + (queries @ self.mean)[..., None]


def moments(queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(Σq uncentered [D, D], Σk centered [D, D], μ [D]) of query rows [N, D] and key rows [M, D], in float64."""
    q, k = queries.double(), keys.double()
    mean = k.mean(0)
    centered = k - mean
    return q.T @ q / q.shape[0], centered.T @ centered / k.shape[0], mean


def _sqrt_and_inverse(sigma: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ^½, Σ^-½) of a symmetric positive semi-definite matrix, its eigenvalues floored at EPS x the largest."""
    values, vectors = torch.linalg.eigh(sigma)
    values = values.clamp_min(EPS * values.max().clamp_min(torch.finfo(values.dtype).tiny))
    return (vectors * values.sqrt()) @ vectors.T, (vectors * values.rsqrt()) @ vectors.T


def saki(sigma_q: Tensor, sigma_k: Tensor, mean: Tensor, rank: int) -> tuple[LowRankKeys, Tensor]:
    """SAKI's rank-``rank`` map from ``moments`` and its predicted mean-square score error ``Σ_{i>r} λ_i(C)²``."""
    root_q, inv_q = _sqrt_and_inverse(sigma_q)
    root_k, inv_k = _sqrt_and_inverse(sigma_k)
    u, s, vh = torch.linalg.svd(root_q @ root_k)
    half = s[:rank].sqrt()
    maps = LowRankKeys(mean, inv_k @ vh[:rank].T * half, inv_q @ u[:, :rank] * half)
    return maps, (s[rank:] ** 2).sum()


def score_energies(sigma_q: Tensor, sigma_k: Tensor) -> Tensor:
    """[D] the singular values λ of ``C = Σq^½ Σk^½``, descending: SAKI's code channel i has second moment λ_i, and
    an error δ in it moves a score by a mean square of λ_i δ² (what a bit spent on it is worth)."""
    root_q, _ = _sqrt_and_inverse(sigma_q)
    root_k, _ = _sqrt_and_inverse(sigma_k)
    return torch.linalg.svdvals(root_q @ root_k)


def key_pca(sigma_k: Tensor, mean: Tensor, rank: int) -> LowRankKeys:
    """The baseline at the same rank: the top-``rank`` principal directions of the centered keys."""
    _, vectors = torch.linalg.eigh(sigma_k)
    basis = vectors[:, -rank:] if rank else vectors[:, :0]
    return LowRankKeys(mean, basis, basis)


def score_error(maps: LowRankKeys, sigma_q: Tensor, sigma_k: Tensor) -> Tensor:
    """The mean-square score error ``‖Σq^½ (I − M) Σk^½‖²_F`` of any map, from the same moments."""
    root_q, _ = _sqrt_and_inverse(sigma_q)
    root_k, _ = _sqrt_and_inverse(sigma_k)
    eye = torch.eye(sigma_q.shape[0], dtype=sigma_q.dtype)
    return (root_q @ (eye - maps.query_map @ maps.key_map.T) @ root_k).square().sum()


def topk_recall(exact: Tensor, approximate: Tensor, k: int, valid: Tensor | None = None) -> Tensor:
    """Mean over rows of |top-k(exact) ∩ top-k(approximate)| / k, for score rows [..., S] (``valid``: the entries
    each row may pick; rows with fewer than k valid entries are left out)."""
    if valid is not None:
        exact, approximate = (x.masked_fill(~valid, float("-inf")) for x in (exact, approximate))
        keep = valid.sum(-1) >= k
        exact, approximate = exact[keep], approximate[keep]
    top = exact.topk(k, -1).indices
    hit = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, top, True)
    return hit.gather(-1, approximate.topk(k, -1).indices).float().mean()
