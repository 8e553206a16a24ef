"""The "Trust the Mass" ceiling (docs/eval.md#ceiling-analysis-kvcompileevalanalysis-kvcompile-analyze-ceiling): how
much closer to full attention can *any* s kept keys get than the s keys with the largest attention weights?

ABSTRACT-ONLY / INFERRED. arXiv 2608.25230's abstract gives the claims (the exact best subset closes a median
2–5% of top-mass's remaining gap; a "balancing" selector sits at the floor); the rest is our inferred
specification, and these choices are ours: the candidate sets (``candidates``: exact enumeration only for
s <= 8 within the heaviest keys, bounds above), the balancing selector's k and swap limit, and the certificate
(``hyperplane_bound``), which replaces the mass-interval bound because that one is 0 on every row.

One attention row (batched over R rows here, float64): weights ``a`` [R, n] (softmax over all keys; 0 for keys
the query cannot see), values ``V`` [R, n, D], ``o = a @ V``. Keep-and-renormalise over S:
``o_S = sum_S a_j v_j / m_S``, ``m_S = sum_S a_j``, dropped mass ``1 - m_S``; with ``w_j = a_j (v_j - o)``,
``E(S) = |o - o_S|^2 = |sum_S w_j|^2 / m_S^2``, a ratio of quadratic forms in the Gram matrix ``G = W W^T``
[R, n, n], which every search below reads instead of W. A kept set is a mask ``keep`` [R, n] of s keys.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

_INF = float("inf")
BUDGETS = (4, 8, 16, 32, 64, 128, 256)


def centred(a: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
    """(o [R, D], W [R, n, D]) with ``W[:, j] = a_j (v_j - o)``."""
    o = torch.einsum("rn,rnd->rd", a, V)
    return o, a[..., None] * (V - o[:, None])


def energy(W: Tensor, a: Tensor, keep: Tensor) -> Tensor:
    """E(S) [R] for kept masks ``keep`` [R, n], straight from the definition (what every result reports)."""
    k = keep.to(W.dtype)
    r = torch.einsum("rn,rnd->rd", k, W)
    return (r * r).sum(-1) / (k * a).sum(-1) ** 2


def top_mass(a: Tensor, s: int) -> Tensor:
    """The s largest weights of each row, as a mask [R, n]."""
    return torch.zeros_like(a, dtype=torch.bool).scatter_(1, a.topk(s, dim=1).indices, True)


@functools.lru_cache(maxsize=8)
def _tree(c: int, s: int) -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
    """The s-subsets of range(c) in lexicographic order, grown one key at a time: level t lists every prefix of
    t + 1 keys that can still be completed as (its parent at level t - 1, its new largest key, parent * c + key)."""
    last, levels = torch.tensor([-1]), []
    for t in range(s):
        counts = c - s + t - last  # the new key runs from last + 1 to c - s + t
        parent = torch.repeat_interleave(torch.arange(len(last)), counts)
        start = torch.cumsum(counts, 0) - counts
        last = last[parent] + 1 + torch.arange(len(parent)) - start[parent]
        levels.append((parent, last, parent * c + last))
    return tuple(levels)


def best_subset(G: Tensor, a: Tensor, cand: Tensor, s: int, chunk: int = 8) -> Tensor:
    """Exact ``argmin E(S)`` over the s-subsets of each row's candidates ``cand`` [R, c] (key indices), by
    enumerating all C(c, s) of them, ``chunk`` rows at a time. Returns keep [R, n].

    Over ``_tree``: a prefix carries its numerator ``|sum_P w|^2`` and its Gram row sums ``g = sum_{i in P} G_i``
    [c], so a child costs O(1) (``num + 2 g_j + G_jj``) and only the prefixes pay O(c). Rows run along the last
    axis, so every gather copies contiguous runs."""
    R, c = cand.shape
    levels, picks = _tree(c, s), []
    for rows in torch.arange(R).split(chunk):
        b, cr = len(rows), cand[rows]
        Gc = G[rows].gather(1, cr[..., None].expand(-1, -1, G.shape[-1])).gather(2, cr[:, None].expand(-1, c, -1))
        Gt, diag, am = Gc.permute(1, 2, 0).reshape(c, c * b), Gc.diagonal(0, 1, 2).T, a[rows].gather(1, cr).T
        g, num, mass = (torch.zeros(k, b, dtype=G.dtype) for k in (c, 1, 1))
        for t, (parent, key, flat) in enumerate(levels):
            num = num.index_select(0, parent) + 2 * g.index_select(0, flat) + diag.index_select(0, key)
            mass = mass.index_select(0, parent) + am.index_select(0, key)
            if t < s - 1:
                g = (g.view(-1, c * b).index_select(0, parent) + Gt.index_select(0, key)).view(-1, b)
        leaf, chosen = (num / mass**2).argmin(0), []
        for parent, key, _ in reversed(levels):
            chosen.append(key[leaf])
            leaf = parent[leaf]
        picks.append(cr.gather(1, torch.stack(chosen, 1)))
    return torch.zeros_like(a, dtype=torch.bool).scatter_(1, torch.cat(picks), True)


def swap_search(G: Tensor, a: Tensor, keep: Tensor, eligible: Tensor, max_swaps: int) -> tuple[Tensor, Tensor]:
    """Best-improvement 1-swap local search from ``keep``: swap one kept key for one ``eligible`` [R, n] key while
    the best swap lowers E by more than a relative 1e-9, at most ``max_swaps`` swaps per row.

    Every swap of every row is scored at once (in float32) from ``B = G[S]`` [R, s, n]: with ``q_j = r.w_j``
    (``r = sum_S w``), ``|r - w_i + w_j|^2 = |r|^2 + G_ii - 2 q_i + G_jj + 2 q_j - 2 G_ij``; the chosen swap is
    rechecked in float64. Rows that settle leave the batch. Returns (keep, converged [R] bool)."""
    keep, R, n = keep.clone(), *a.shape
    s = int(keep[0].sum())
    idx = keep.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :s]  # [R, s] kept keys
    converged, act, rows = torch.zeros(R, dtype=torch.bool), torch.arange(R), torch.arange(R)
    aa, ea, ka, diag = a, eligible, keep.clone(), G.diagonal(0, 1, 2)
    B = G.gather(1, idx[..., None].expand(-1, -1, n))  # [R, s, n]
    for _ in range(max_swaps):
        q, m, ai = B.sum(1), aa.gather(1, idx).sum(1), aa.gather(1, idx)
        qi, K, Gi = q.gather(1, idx), q.gather(1, idx).sum(1), diag.gather(1, idx)
        left, right = K[:, None] + Gi - 2 * qi, diag + 2 * q  # [R, s], [R, n]
        cost = B.float().mul_(-2).add_(left.float()[..., None]).add_(right.float()[:, None])
        cost.div_(((m[:, None] - ai).float()[..., None] + aa.float()[:, None]).square_())
        flat = cost.masked_fill_((ka | ~ea)[:, None], _INF).flatten(1).argmin(1)
        slot, j = flat // n, flat % n
        num = left[rows, slot] + right[rows, j] - 2 * B[rows, slot, j]
        better = num / (m - ai[rows, slot] + aa[rows, j]) ** 2 < K / m**2 * (1 - 1e-9)
        converged[act[~better]] = True
        if not better.any():
            break
        live = better.nonzero().squeeze(1)
        act, aa, ea, ka, diag, idx, B, slot, j = (x[live] for x in (act, aa, ea, ka, diag, idx, B, slot, j))
        rows = torch.arange(len(act))
        ka[rows, idx[rows, slot]], ka[rows, j] = False, True
        idx[rows, slot], B[rows, slot] = j, G[act, j]  # G itself never leaves the batch: it is the big one
        keep[act] = ka
    return keep, converged


def balancing(G: Tensor, a: Tensor, s: int, eligible: Tensor, max_swaps: int) -> tuple[Tensor, Tensor]:
    """The balancing selector *(inferred reading of the name; k = max(1, s // 4) is our choice)*: the top
    s - k by mass, then k keys added one at a time, each the one that brings o_S closest to o, then
    ``swap_search`` over every ``eligible`` key. An upper bound on the best subset of all keys."""
    keep, k = top_mass(a, s - max(1, s // 4)), max(1, s // 4)
    q, diag = torch.einsum("rn,rnm->rm", keep.to(G.dtype), G), G.diagonal(0, 1, 2)
    for _ in range(k):
        K, m = (q * keep).sum(1), (a * keep).sum(1)
        cost = (K[:, None] + 2 * q + diag) / (m[:, None] + a) ** 2
        j = cost.masked_fill(keep | ~eligible, _INF).argmin(1)
        keep[torch.arange(len(j)), j] = True
        q = q + G[torch.arange(len(j)), j]
    return swap_search(G, a, keep, eligible, max_swaps)


def hyperplane_bound(U: Tensor, a: Tensor, cand: Tensor, s: int, directions: list[Tensor]) -> Tensor:
    """A provable lower bound [R] on ``min E(S)`` over the s-subsets of ``cand`` [R, c]; ``U = V - o``.

    Every o_S of the candidates lies in their values' affine span; with P the projector onto its directions,
    ``E(S) = |P (o_S - o)|^2 + d^2``, d the distance from o to the span (the same for every S; 0 once c > D).
    For the first term, a direction e [R, D] (projected by P) gives ``|P (o_S - o)| >= <e, o_S - o> / |e|``, and
    ``min_S <e, o_S - o>`` is the ratio ``sum_S a_j x_j / sum_S a_j`` (``x_j = <e, u_j>``) over s-subsets, which
    Dinkelbach with sorting solves exactly; an unsettled theta is corrected by ``min(F(theta), 0) / m_min``, so
    the bound stays valid. Max over ``directions``.

    Departure from the inferred specification *(ours)*: its mass-interval QP bound is 0 on every row (``z = s/n`` is
    feasible with residual 0), and any bound from linear functionals over all keys is 0 too, because o is the
    ``m_S``-weighted mean of the ``o_S`` over all s-subsets; over candidates o can lie off their span or hull."""
    Uc = U.gather(1, cand[..., None].expand(-1, -1, U.shape[-1]))
    ac = a.gather(1, cand)
    Q = torch.linalg.qr((Uc[:, 1:] - Uc[:, :1]).mT).Q  # [R, D, min(D, c - 1)]: spans (at least) the directions
    inside = lambda x: (Q @ (Q.mT @ x[..., None]))[..., 0]  # noqa: E731  P x
    off = (Uc[:, 0] - inside(Uc[:, 0])).pow(2).sum(-1) if Q.shape[-1] < U.shape[-1] else 0.0  # d^2 (0 once c > D)
    m_min = ac.topk(s, 1, largest=False).values.sum(1)
    bound = torch.zeros(cand.shape[0], dtype=U.dtype)
    for e in map(inside, directions):
        x = torch.einsum("rcd,rd->rc", Uc, e)
        theta = (ac[:, :s] * x[:, :s]).sum(1) / ac[:, :s].sum(1)
        for _ in range(50):
            sel = (ac * (x - theta[:, None])).topk(s, 1, largest=False).indices
            new = (ac.gather(1, sel) * x.gather(1, sel)).sum(1) / ac.gather(1, sel).sum(1)
            if bool((new >= theta).all()):
                break
            theta = torch.minimum(theta, new)
        F = (ac * (x - theta[:, None])).topk(s, 1, largest=False).values.sum(1)
        low = (theta + F.clamp(max=0) / m_min).clamp(min=0)
        bound = torch.maximum(bound, (low / e.norm(dim=-1).clamp_min(1e-300)) ** 2)
    return off + bound


def candidates(s: int, n: int, exact_max: int = 8, max_subsets: int = 2**17) -> int:
    """Candidate-set size for budget s: for s <= ``exact_max`` the largest c <= 64 with C(c, s) <=
    ``max_subsets`` (the best subset within them is enumerated), else max(64, 2 s); at most n."""
    if s <= exact_max:
        return max(c for c in range(s, min(64, n) + 1) if math.comb(c, s) <= max_subsets)
    return min(n, max(64, 2 * s))


def analyse(a: Tensor, V: Tensor, budgets=BUDGETS, *, exact_max: int = 8, max_swaps: int = 16) -> dict:
    """Every quantity of the analysis for rows ``a`` [R, n], ``V`` [R, n, D] (computed in float64).

    Returns ``{"o2": |o|^2 [R], s: {...}}`` for each budget s below the fewest visible keys, each entry [R]:
    ``top``, ``exact``, ``bound``, ``balancing`` (E of top-mass; of the best subset of the candidates, NaN above
    ``exact_max``; a lower bound on that; of the balancing selector over all keys), ``drop_top``,
    ``drop_exact``, ``drop_balancing`` (dropped masses), ``converged`` (the balancing search settled within
    ``max_swaps``), and ``candidates`` (c)."""
    a = a.double() / a.double().sum(1, keepdim=True)
    V = V.double()
    o, W = centred(a, V)
    G, U, eligible = W @ W.mT, V - o[:, None], a > 0
    n = int(eligible.sum(1).min())
    out: dict = {"o2": (o * o).sum(-1)}
    drop = lambda keep: 1 - (keep * a).sum(1)  # noqa: E731
    for s in (s for s in budgets if s < n):
        c = candidates(s, n, exact_max)
        cand = a.topk(c, 1).indices
        top = torch.zeros_like(eligible).scatter_(1, cand[:, :s], True)
        best = best_subset(G, a, cand, s) if s <= exact_max else top
        bal, converged = balancing(G, a, s, eligible, max_swaps)
        toward = lambda keep: torch.einsum("rn,rnd->rd", keep.double(), W)  # noqa: E731  o_S - o, times m_S
        directions = [toward(best), toward(bal), toward(torch.zeros_like(eligible).scatter_(1, cand, True))]
        nan = torch.full_like(a[:, 0], float("nan"))
        out[s] = {
            "top": energy(W, a, top), "exact": energy(W, a, best) if s <= exact_max else nan,
            "bound": hyperplane_bound(U, a, cand, s, directions), "balancing": energy(W, a, bal),
            "drop_top": drop(top), "drop_exact": drop(best) if s <= exact_max else nan,
            "drop_balancing": drop(bal), "converged": converged, "candidates": c,
        }
    return out
