"""The ceiling analysis against definitions: brute-force enumeration, hand-built rows, and a tiny
model's own attention probabilities."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
import transformers as tf
from test_eval import byte_tokenizer

import kvcompile
from kvcompile.eval.analysis import ceiling, ceiling_report
from kvcompile.eval.analysis.rows import attention_rows
from kvcompile.eval.fidelity import prose_windows


def random_rows(seed: int, R: int, n: int, D: int, peak: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    a = torch.softmax(torch.randn(R, n, generator=g, dtype=torch.float64) * peak, 1)
    return a, torch.randn(R, n, D, generator=g, dtype=torch.float64)


def brute_force(a, V, s):
    """min over every s-subset of |o - o_S|^2, straight from the definition of o_S (no Gram matrix)."""
    idx = torch.tensor(list(itertools.combinations(range(a.shape[1]), s)))  # [N, s]
    w = a[:, idx]  # [R, N, s]
    o_S = (w[..., None] * V[:, idx]).sum(2) / w.sum(2)[..., None]
    return (o_S - (a[..., None] * V).sum(1)[:, None]).pow(2).sum(-1).min(1).values


def solve(a, V, s):
    o, W = ceiling.centred(a, V)
    keep = ceiling.best_subset(W @ W.mT, a, a.argsort(dim=1, descending=True), s)
    assert (keep.sum(1) == s).all()
    return ceiling.energy(W, a, keep)


def test_best_subset_equals_brute_force_for_every_s():
    seed = random.SystemRandom().randrange(2**31)
    a, V = random_rows(seed, 2, 20, 3)
    n = random.Random(seed).randint(14, 20)
    a, V = a[:, :n] / a[:, :n].sum(1, keepdim=True), V[:, :n]
    for s in range(1, n + 1):
        ours, ref = solve(a, V, s), brute_force(a, V, s)
        assert torch.allclose(ours, ref, rtol=1e-9, atol=1e-14), f"seed={seed} n={n} s={s}: {ours} vs {ref}"


def test_best_subset_strictly_beats_top_mass_where_top_mass_is_suboptimal():
    """Three keys: the heaviest value is far from o, the second one *is* o; so for s = 1 the best subset is {1}
    with E = 0 while top-mass keeps key 0."""
    a = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    V = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [-1.5, 0.0]]], dtype=torch.float64)
    V[0, 1] = (a[0, 0] * V[0, 0] + a[0, 2] * V[0, 2]) / (1 - a[0, 1])  # v_1 = o
    o, W = ceiling.centred(a, V)
    keep = ceiling.best_subset(W @ W.mT, a, torch.tensor([[0, 1, 2]]), 1)
    assert keep[0].tolist() == [False, True, False]
    assert float(ceiling.energy(W, a, keep)) < 1e-24 < float(ceiling.energy(W, a, ceiling.top_mass(a, 1)))


def reference_balancing(a, V, s, max_swaps):
    """The balancing selector spelled out with one E evaluation per candidate set."""
    E = lambda S: float(solve_set(a, V, sorted(S)))  # noqa: E731
    k = max(1, s // 4)
    S = set(a.topk(s - k).indices.tolist())
    for _ in range(k):
        S.add(min((j for j in range(len(a)) if j not in S), key=lambda j: E(S | {j})))
    for _ in range(max_swaps):
        e, i, j = min((E(S - {i} | {j}), i, j) for i in S for j in range(len(a)) if j not in S)
        if e >= E(S) * (1 - 1e-9):
            break
        S = S - {i} | {j}
    return S


def solve_set(a, V, S):
    o = a @ V
    return ((a[S] @ V[S]) / a[S].sum() - o).pow(2).sum()


@pytest.mark.parametrize("s", [4, 8])
def test_balancing_follows_its_definition(s):
    seed = random.SystemRandom().randrange(2**31)
    a, V = random_rows(seed, 3, 14, 4)
    o, W = ceiling.centred(a, V)
    keep, _ = ceiling.balancing(W @ W.mT, a, s, a > 0, max_swaps=5)
    for r in range(3):
        ours = set(keep[r].nonzero().squeeze(1).tolist())
        assert ours == reference_balancing(a[r], V[r], s, 5), f"seed={seed} row={r}"


def test_balancing_adds_the_key_that_balances_the_residual():
    """1-D: the three heaviest keys sit at +1; the fourth heaviest at +1 too, a light key at -1. With s = 4
    (k = 1) balancing keeps the top three and adds the light key, which brings o_S closest to o (= 0.6); top-mass
    would add the fourth heaviest."""
    a = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]], dtype=torch.float64)
    V = torch.tensor([[[1.0], [1.0], [1.0], [1.0], [-3.0]]], dtype=torch.float64)
    o, W = ceiling.centred(a, V)
    keep, _ = ceiling.balancing(W @ W.mT, a, 4, a > 0, max_swaps=0)
    assert keep[0].tolist() == [True, True, True, False, True]


def test_certificate_is_tight_when_every_candidate_subset_misses_o_on_one_side():
    """1-D: candidates at 3, 1, 2 (heaviest first), the rest far below, so every o_S of the candidates lies above
    o and |o_S - o| = o_S - o: the bound is the best subset's E exactly ({1, 2}, not top-mass's {0, 1}), so
    kappa = E(top) / bound gives the exact closure share, rho = 1 - 1/kappa."""
    a = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]], dtype=torch.float64)
    V = torch.tensor([[[3.0], [1.0], [2.0], [-5.0], [-5.0]]], dtype=torch.float64)
    o, W = ceiling.centred(a, V)
    cand, s = torch.tensor([[0, 1, 2]]), 2
    bound = ceiling.hyperplane_bound(V - o[:, None], a, cand, s, [torch.ones(1, 1, dtype=torch.float64)])
    best = ceiling.energy(W, a, ceiling.best_subset(W @ W.mT, a, cand, s))
    top = ceiling.energy(W, a, ceiling.top_mass(a, s))
    assert torch.allclose(bound, best) and torch.allclose(best, solve_set(a[0], V[0], [1, 2])[None])
    assert torch.allclose(1 - bound / top, 1 - best / top) and float(top / bound) > 2


def test_certificate_counts_the_distance_from_o_to_the_candidates_span():
    """3-D: the three candidates' values span the plane z = 0, the other keys sit at z = -1, so every o_S of the
    candidates is at distance d = 1 - m_C from o along z: with a direction off the plane (which adds nothing)
    the bound is exactly d^2, and it never exceeds the best subset's E."""
    a = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]], dtype=torch.float64)
    V = torch.tensor([[[1.0, 0.0, 0.0], [-1.0, 0.5, 0.0], [0.2, -1.0, 0.0], [0.0, 0.0, -1.0], [0.3, 0.1, -1.0]]],
                     dtype=torch.float64)
    o, cand = a @ V[0], torch.tensor([[0, 1, 2]])
    bound = ceiling.hyperplane_bound(V - o, a, cand, 2, [torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)])
    assert torch.allclose(bound, (1 - a[0, :3].sum())[None] ** 2)
    assert bound <= min(solve_set(a[0], V[0], list(S)) for S in itertools.combinations(range(3), 2))


def test_certificate_bounds_the_exact_optimum_and_vanishes_over_all_keys():
    seed = random.SystemRandom().randrange(2**31)
    a, V = random_rows(seed, 4, 16, 3, peak=3.0)
    o, W = ceiling.centred(a, V)
    G, order = W @ W.mT, a.argsort(dim=1, descending=True)
    for s in (2, 3, 5):
        for c in (8, 16):
            cand = order[:, :c]
            best = ceiling.energy(W, a, ceiling.best_subset(G, a, cand, s))
            directions = [torch.randn(4, 3, dtype=torch.float64), W.gather(1, cand[..., None].expand(-1, -1, 3)).sum(1)]
            bound = ceiling.hyperplane_bound(V - o[:, None], a, cand, s, directions)
            assert (bound <= best * (1 + 1e-9)).all(), f"seed={seed} s={s} c={c}"
            if c == 16:  # every key is a candidate: o is inside the hull of the o_S, so no hyperplane separates it
                assert (bound <= 1e-12 * best).all(), f"seed={seed} s={s}"


def test_o_is_the_mass_weighted_mean_of_the_subset_outputs():
    """Why the relaxation bound over all keys is 0 (``hyperplane_bound``'s docstring)."""
    a, V = random_rows(random.SystemRandom().randrange(2**31), 1, 9, 2)
    idx = torch.tensor(list(itertools.combinations(range(9), 4)))
    m = a[0, idx].sum(1)
    o_S = (a[0, idx][..., None] * V[0, idx]).sum(1) / m[:, None]
    assert torch.allclose((m[:, None] * o_S).sum(0) / m.sum(), a[0] @ V[0])


def test_analyse_on_rows_whose_candidates_are_all_keys():
    """n = 40 keys, s = 4: the candidates are all of them, so balancing (a local search) never beats the exact
    optimum, the bound is 0, and shares and masses stay in range."""
    a, V = random_rows(random.SystemRandom().randrange(2**31), 6, 40, 8, peak=3.0)
    d = ceiling.analyse(a, V, budgets=(4,))[4]
    assert d["candidates"] == 40
    assert (d["balancing"] >= d["exact"] * (1 - 1e-9)).all() and (d["exact"] <= d["top"] * (1 + 1e-12)).all()
    assert (d["bound"] <= 1e-12 * d["exact"]).all()
    for key in ("drop_top", "drop_exact", "drop_balancing"):
        assert ((0 <= d[key]) & (d[key] <= 1)).all()


def test_rows_are_the_models_attention_and_the_report_is_written(tmp_path):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=1)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    eager = tf.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()  # attentions
    eager.load_state_dict(model.state_dict())
    tok = byte_tokenizer()
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    parts = list(attention_rows(cm, tok, rows=8, contexts=1, length=80, window=8, min_keys=32))
    ids = torch.tensor([prose_windows(tok, 1, 80)[0]])
    with torch.no_grad():
        ref = eager(ids, output_attentions=True).attentions  # [1, H, T, T] per layer
    for part in parts:
        for head, pos, row in zip(part["head"], part["position"], part["a"]):
            assert torch.allclose(row[: pos + 1], ref[part["layer"]][0, head, pos, : pos + 1], atol=1e-5)
    result = ceiling_report.run(cm, tok, rows=8, contexts=1, length=80, window=8, budgets=(4, 8, 16), progress=False)
    assert result["config"]["rows"] == 8 and [r["s"] for r in result["summary"]] == [4, 8, 16]
    paths = ceiling_report.write(result, tmp_path / "ceiling", "tiny", "kvcompile analyze ceiling ...")
    assert all(p.exists() for p in paths) and "| 16 |" in paths[1].read_text()
