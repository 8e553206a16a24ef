"""PyramidKV's allocator against the authors' schedule (window outside the pyramid), computed exactly."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from kvcompile.methods.pyramidkv import Pyramid


def _schedule(L: int, share: int, window: int, beta: float) -> list[Fraction]:
    """Per-layer tokens per head before the floor: window + top - l (top - bottom) / (L - 1), where bottom =
    (share - window) / beta and top = 2 (share - window) - bottom; the uniform share when share <= window."""
    if share <= window:
        return [Fraction(share)] * L
    room = Fraction(share - window)
    bottom = room / Fraction(beta)
    top = 2 * room - bottom
    return [window + top - Fraction(layer, max(L - 1, 1)) * (top - bottom) for layer in range(L)]


@pytest.mark.parametrize("seed", range(40))
def test_pyramid_matches_the_authors_schedule(seed):
    g = torch.Generator().manual_seed(seed)
    L, B, Hkv = int(torch.randint(2, 40, (1,), generator=g)), 2, int(torch.randint(1, 5, (1,), generator=g))
    window = int(torch.randint(0, 65, (1,), generator=g))
    beta = float(torch.randint(1, 41, (1,), generator=g))
    lengths = torch.randint(50, 2000, (L, B, Hkv), generator=g)
    budget = (lengths.sum((0, 2)).double() * torch.rand(B, generator=g, dtype=torch.float64)).long()
    counts = Pyramid(beta=beta, window=window).allocate(torch.zeros(L, B, Hkv, 1), lengths, budget)
    assert (counts.sum((0, 2)) <= budget).all(), f"seed {seed}: over budget"
    for b in range(B):
        share = int(budget[b]) // (L * Hkv)
        for layer, exact in enumerate(_schedule(L, share, window, beta)):
            want = math.floor(exact)
            # float64 may land just under an exact integer: one token fewer there, never more
            ok = {want, want - 1} if exact.denominator == 1 else {want}
            got = counts[layer, b]
            cap = lengths[layer, b]
            assert all(int(c) in {min(w, int(m)) for w in ok} for c, m in zip(got, cap)), (
                f"seed {seed}: layer {layer} row {b}: got {got.tolist()}, schedule {float(exact):.3f}, "
                f"share {share}, window {window}, beta {beta}, L {L}")


def test_pyramid_where_kvpress_falls_back_to_snapkv():
    """A 1k context at budget 0.25 (share 237 < beta x window = 640): kvpress 0.5.5 keeps SnapKV's uniform share in
    every layer; the authors' schedule (and this allocator) still builds the pyramid."""
    L, Hkv, n = 30, 3, 950
    lengths = torch.full((L, 1, Hkv), n)
    budget = torch.tensor([n * L * Hkv // 4])
    counts = Pyramid(beta=20.0, window=32).allocate(torch.zeros(L, 1, Hkv, 1), lengths, budget)[:, 0, 0]
    share = n // 4
    assert counts[0] > 1.8 * share and counts[-1] < 0.2 * share, counts.tolist()
    assert (counts[:-1] >= counts[1:]).all(), counts.tolist()
    assert abs(counts.double().mean() - share) <= 1, counts.tolist()
