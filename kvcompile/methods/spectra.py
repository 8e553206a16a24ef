"""SPECTRA (arXiv 2608.07915 as a detailed full-text summary reports it; no code found): keys and
values stored in a per-head latent basis whose channels are decorrelated and sorted by energy, at bits spent per
group of channels by energy.

The basis. SPECTRA factors a projection ``k = h W`` through its inputs' second moment ``G = E[hᵀh]``: with
``M = G^½ W = U Σ Vᵀ``, the latent ``c = h G^-½ U Σ^½`` has diagonal second moments ``Σ`` and ``k = c Σ^½ Vᵀ``.
Since ``MᵀM = Wᵀ G W = E[kᵀk]``, ``V`` and ``Σ`` are the eigenvectors and the square roots of the eigenvalues of
the projection's own uncentered output moment, and at full rank a stored vector's latent is ``c = k V Σ^-½``: the
cache needs ``E[kᵀk]`` (keys before RoPE), not the hidden states. A projection with a bias is the same
construction over ``[h, 1]``, whose output moment is again ``E[kᵀk]`` of the vectors as they are.

The bits. SPECTRA spends ``b_j = b̄ + ½ log2(v_j / GM(v))`` bits on latent channel j of variance ``v_j = Σ_j`` (reverse
water-filling; below 0: dropped) and lets channels that share a width share a group. Here the groups come first:
``group`` consecutive latent channels (of similar variance, since the basis is sorted) share one width, and the
widths are the integer optimum of the same rate-distortion objective, ``sum_j v_j 4^-b_j`` at ``b̄ x D`` bits in
all: one bit at a time to the group whose distortion it lowers most (a greedy that is exact for this separable
convex objective), at most 8 per channel. Every head of a model spends the same bits, so rows have one width.
A row stores, per group, its codes at the group's width with an fp16 scale and minimum of the token's values
(per-token asymmetric min/max, as SPECTRA); a group at 0 bits stores the mean of its values in the minimum's slot.

Inferred (not in the paper's summary): the fixed group size, the integer greedy and the 0-bit groups' mean. Pure tensor
math, per head: ``calibration.latent`` measures a model's moments, ``kernels.latent`` stores rows in the basis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_BITS = 8
FLOOR = 1e-8  # eigenvalues below FLOOR x the largest are raised to it before Σ^-½ (a latent channel of no energy)


@dataclass(frozen=True)
class Spectral:
    """One projection's latent basis for H heads: ``down`` [H, D, D] maps a stored vector to its latent, ``up``
    [H, D, D] back (``down @ up = I``), ``energy`` [H, D] the latent second moments (descending), ``widths``
    [H, D / group] the bits of each channel group (int64)."""

    down: Tensor
    up: Tensor
    energy: Tensor
    widths: Tensor
    group: int

    @property
    def bits(self) -> float:
        """Mean bits per channel (the same for every head)."""
        return float(self.widths[0].sum()) * self.group / self.down.shape[-1]

    def row_bytes(self) -> int:
        """Bytes of one stored row: its codes and an fp16 scale and minimum per group."""
        D = self.down.shape[-1]
        return int(self.widths[0].sum()) * self.group // 8 + 4 * (D // self.group)


def basis(second_moment: Tensor, bits: float, group: int = 16) -> Spectral:
    """SPECTRA's basis and widths from each head's uncentered second moment ``E[xᵀx]`` [H, D, D] of the vectors to
    store, at a mean of ``bits`` per channel."""
    H, D, _ = second_moment.shape
    if D % group or group % 8:
        raise ValueError(f"spectra groups latent channels in groups of a multiple of 8 that divide the head dim; "
                         f"group {group} and head dim {D} do not")
    total = bits * D / group
    if total != int(total) or not 0 < bits <= MAX_BITS:
        raise ValueError(f"spectra spends a whole number of bits per group: bits x head dim / group = {total} "
                         f"(bits {bits}, head dim {D}, group {group}); bits must be in (0, {MAX_BITS}]")
    values, vectors = torch.linalg.eigh(second_moment.double())  # ascending
    values, vectors = values.flip(-1), vectors.flip(-1)
    values = values.clamp_min(FLOOR * values[..., :1].clamp_min(torch.finfo(values.dtype).tiny))
    sigma = values.sqrt()  # the singular values of G^½ W: the latent's second moments
    down = vectors * sigma.rsqrt()[..., None, :]  # V Σ^-½
    up = sigma.sqrt()[..., :, None] * vectors.transpose(-1, -2)  # Σ^½ Vᵀ
    widths = torch.stack([allocate(s, int(total), group) for s in sigma])
    return Spectral(down.float(), up.float(), sigma.float(), widths, group)


def allocate(energy: Tensor, steps: int, group: int) -> Tensor:
    """[D / group] widths: ``steps`` bits per channel handed out one group at a time, each to the group where it
    lowers ``sum_j v_j 4^-b`` the most (ties: the earlier group), none past ``MAX_BITS``."""
    per_group = energy.double().unflatten(-1, (-1, group)).sum(-1)
    widths = torch.zeros(per_group.shape[-1], dtype=torch.long)
    for _ in range(steps):
        gain = torch.where(widths < MAX_BITS, per_group * 0.25 ** widths.double(), -1.0)
        widths[int(gain.argmax())] += 1
    return widths
