"""LU-KV: the curve allocator spends the budget as its curve says, and its calibration makes a valid curve."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, left_padded_batch

import kvcompile
from kvcompile.calibration import lukv as lukv_calibration
from kvcompile.methods.lukv import LUKV

EA = {"window": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.02}


def _curve(L: int, Hkv: int, seed: int = 0) -> tuple:
    """A random curve whose every row's mean prune ratio is that row's ratio (as calibration makes them)."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.arange(1, 100, dtype=torch.float64)[:, None, None] / 100
    spread = torch.rand(1, L, Hkv, generator=g, dtype=torch.float64) - 0.5
    spread = spread - spread.mean()
    return (ratio + spread * torch.minimum(ratio, 1 - ratio)).tolist()


def test_counts_follow_the_curve_and_spend_the_budget():
    L, B, Hkv, n = 3, 2, 4, 200
    curve = _curve(L, Hkv)
    lengths = torch.full((L, B, Hkv), n)
    budget = torch.tensor([600, 1440])  # ratios 0.75 and 0.4 of 2400 tokens
    counts = LUKV(curve=curve).allocate(torch.zeros(L, B, Hkv, n), lengths, budget)
    assert counts.sum((0, 2)).tolist() == budget.tolist(), "the budget is spent exactly"
    assert ((counts >= 1) & (counts <= lengths)).all()
    for b, row in ((0, 74), (1, 39)):
        want = (1 - torch.tensor(curve[row])) * n
        assert (counts[:, b] - want).abs().max() <= 1, "a curve whose mean is the ratio is followed to the token"


def test_rescaling_and_floor_hold_the_budget_on_ragged_heads():
    g = torch.Generator().manual_seed(1)
    L, B, Hkv = 2, 3, 3
    lengths = torch.randint(0, 60, (L, B, Hkv), generator=g)
    for budget in ([5, 40, 300], [0, 17, 1000]):
        budget = torch.tensor(budget)
        counts = LUKV(curve=_curve(L, Hkv, seed=2)).allocate(torch.zeros(L, B, Hkv, 60), lengths, budget)
        assert (counts.sum((0, 2)) <= budget).all() and (counts <= lengths).all() and (counts >= 0).all()
        enough = budget >= (lengths > 0).sum((0, 2))
        assert ((counts >= 1) | (lengths == 0) | ~enough[None, :, None]).all(), "each head keeps one when it can"


def test_uniform_curve_is_the_base_scorer_at_equal_per_head_budgets(llama_cm):
    ids, mask = left_padded_batch([96, 96], total=96)
    flat = [[[r / 100] * 2 for _ in range(3)] for r in range(1, 100)]  # 3 layers, 2 KV heads
    runs = []
    for allocator, args in (("lukv", {"curve": flat}), ("uniform", {})):
        recipe = kvcompile.Recipe(f"ea-{allocator}", "expected-attention", allocator, EA, args)
        cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
        runs.append((cm.prefill(ids, mask), cm.held_positions()))
    torch.testing.assert_close(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_bad_curves_are_refused_before_the_model_runs(llama_cm):
    with pytest.raises(ValueError, match=r"curve must be \[99\]"):
        kvcompile.Recipe("bad", "expected-attention", "lukv", EA, {"curve": [[[0.5]]]}).build()
    other = _curve(5, 2)  # a 5-layer model's curve on a 3-layer model
    recipe = kvcompile.Recipe("other", "expected-attention", "lukv", EA, {"curve": other})
    with pytest.raises(ValueError, match="the curve has 5 layers, the model 3"):
        kvcompile.apply(llama_cm, budget=0.25, recipe=recipe)


def test_antitonic_gains_are_the_concave_majorant():
    g = torch.Generator().manual_seed(3)
    gains = torch.rand(5, 30, generator=g, dtype=torch.float64)
    out = lukv_calibration.antitonic(gains)
    assert (out[:, 1:] <= out[:, :-1] + 1e-12).all(), "non-increasing"
    torch.testing.assert_close(out.sum(-1), gains.sum(-1))
    assert (out.cumsum(-1) >= gains.cumsum(-1) - 1e-12).all(), "the majorant lies above the curve"
    done = gains.sort(-1, descending=True).values
    torch.testing.assert_close(lukv_calibration.antitonic(done), done)


def test_prune_curve_is_the_greedy_allocation():
    gains = torch.tensor([[[4.0, 3.0, 0.5, 0.1], [2.0, 1.0, 0.9, 0.8]]])  # 1 layer, 2 heads, n = 4
    curve = lukv_calibration.prune_curve(gains)
    # keep 4 of 8 at ratio 0.5: gains 4, 3, 2, 1 -> two tokens each
    assert curve[49, 0].tolist() == [0.5, 0.5]
    # keep 6 at ratio 0.25: add 0.9 and 0.8 -> head 0 keeps 2, head 1 keeps 4
    assert curve[24, 0].tolist() == [0.5, 0.0]


def test_calibration_makes_a_monotone_curve_that_runs_and_is_cached(llama_cm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path))
    samples = [torch.randint(2, VOCAB - 1, (1, 160), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    curve = lukv_calibration.calibrate(llama_cm, samples, scorer_args=EA, future=32)
    table = torch.tensor(curve)
    assert table.shape == (99, 3, 2)
    assert (table[1:] >= table[:-1] - 1e-12).all(), "a smaller budget never gives a head more tokens"
    mean = table.mean((1, 2))
    assert (mean - torch.arange(1, 100) / 100).abs().max() <= 1 / 128, "each row prunes its ratio overall"
    assert table.std((1, 2)).max() > 0, "heads differ"
    monkeypatch.setattr(lukv_calibration, "_measure", lambda *a, **k: pytest.fail("measured twice"))
    assert lukv_calibration.calibrate(llama_cm, samples, scorer_args=EA, future=32) == curve
    recipe = kvcompile.Recipe("lukv-cal", "expected-attention", "lukv", EA, {"curve": curve})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    cm.prefill(left_padded_batch([160], total=160)[0])
    assert 0 < cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]
