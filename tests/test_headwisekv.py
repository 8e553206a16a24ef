"""HeadWiseKV / SeqCalib (docs/methods_allocators.md#headwisekv) and the hybrid-model allocation: a sliding-window
layer's tokens that no later query can see are evicted first, losslessly, and the budget they leave goes to the global
layers."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_plain_at_full_budget, tiny_model

import kvcompile
from kvcompile.calibration.headwisekv import calibrate, costs
from kvcompile.methods import ALLOCATORS
from kvcompile.recipes import Recipe, get_recipe

WINDOW, N = 6, 40  # the tiny Gemma-3's sliding window (layer 0 slides, layer 1 is global); prompt length


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3")


@pytest.fixture(scope="module")
def gemma_cm(gemma):
    return kvcompile.apply(gemma, budget=1.0, recipe="full")


def prompt(n: int, seed: int = 0):
    return torch.randint(2, 90, (1, n), generator=torch.Generator().manual_seed(seed))


def held(cm, layer: int) -> list[set[int]]:
    pos = cm.held_positions()[layer, 0]
    return [set(p[p >= 0].tolist()) for p in pos]


@pytest.mark.parametrize("recipe", ["snapkv", "streamingllm", "random"])
def test_out_of_window_tokens_go_first_and_losslessly(gemma_cm, recipe):
    """At 24 tokens per head (96 in all), the sliding layer keeps only what the next query can see (5 tokens per
    head) and the global layer all 40; what is read next is exactly what the full cache gives."""
    ids, more = prompt(N), prompt(8, seed=1)
    cm = kvcompile.apply(gemma_cm, budget=24, recipe=recipe, page_size=4)
    full = kvcompile.apply(gemma_cm, budget=1.0, recipe="full", page_size=4)
    cm.prefill(ids), full.prefill(ids)
    assert held(cm, 0) == [set(range(N - WINDOW + 1, N))] * 2 and held(cm, 1) == [set(range(N))] * 2
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert torch.allclose(cm.prefill(more, compress=False), full.prefill(more, compress=False), atol=1e-5)


def test_uniform_gives_what_capped_heads_leave_to_the_others():
    uniform = ALLOCATORS["uniform"]()
    free = uniform.allocate(None, torch.full((2, 1, 2), 40), torch.tensor([48]))
    assert free.flatten().tolist() == [12, 12, 12, 12]  # none capped: exactly the share, as before
    capped = uniform.allocate(None, torch.tensor([[[5, 5]], [[40, 40]]]), torch.tensor([48]))
    assert capped.flatten().tolist() == [5, 5, 19, 19]


@pytest.fixture(scope="module")
def windows(gemma_cm, tmp_path_factory):
    import os

    os.environ["KVCOMPILE_CALIBRATION"] = str(tmp_path_factory.mktemp("calibration"))
    samples = [prompt(64, seed=i) for i in range(2)]
    return calibrate(gemma_cm, samples, [0.5, 0.1, 0.25], probe=8), samples


def test_seqcalib_windows_fit_the_aggregate_budget_and_grow_with_it(gemma_cm, windows):
    chosen, samples = windows
    assert list(chosen) == [0.1, 0.25, 0.5]
    context = samples[0].shape[1] - 8
    for budget, table in chosen.items():
        cost = sum(float(costs(context, w, 4, [level])[0]) for w, row in zip(gemma_cm.spec.windows, table)
                   for level in row)
        assert cost <= budget * context * 2 * 2 + 1e-6  # 2 layers x 2 KV heads
    tables = [torch.tensor(t) for t in chosen.values()]
    assert all(bool((a <= b).all()) for a, b in zip(tables, tables[1:])) and not torch.equal(tables[0], tables[-1])
    assert max(tables[0][0]) <= 1 / 8  # the sliding layer never pays for more than its window of 6 (of 56)


def test_calibrated_heads_hold_their_windows_within_the_budget(gemma_cm, windows):
    chosen, _ = windows
    base = get_recipe("headwisekv")
    table = chosen[0.25]
    recipe = Recipe("hw", base.scorer, base.allocator, {**base.scorer_args, "windows": [list(r) for r in table]})
    cm = kvcompile.apply(gemma_cm, budget=0.25, recipe=recipe, page_size=1)
    cm.prefill(prompt(56, seed=3))
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    for h, level in enumerate(table[1]):  # the global layer: exactly its sinks and newest round(level * 56)
        r = round(level * 56)
        assert held(cm, 1)[h] == set(range(4)) | set(range(56 - r, 56))


@pytest.mark.parametrize("recipe", ["headwisekv", Recipe("hw", "headwisekv", "fill-eligible",
                                                        {"windows": [[0.0, 0.5], [0.25, 1.0]]})])
def test_full_budget_reproduces_the_model(gemma, gemma_cm, recipe):
    assert_plain_at_full_budget(gemma, gemma_cm, recipe)


def test_bad_windows_and_budgets_are_refused(gemma_cm):
    with pytest.raises(ValueError, match="fractions in \\[0, 1\\]"):
        kvcompile.apply(gemma_cm, budget=0.5, recipe=Recipe("hw", "headwisekv", "fill-eligible", {"windows": [[2.0]]}))
    with pytest.raises(ValueError, match="the model has 2 layers"):  # at apply, before any prompt is read
        kvcompile.apply(gemma_cm, budget=0.5, recipe=Recipe("hw", "headwisekv", "fill-eligible",
                                                            {"windows": [[0.5, 0.5]]}))
    with pytest.raises(ValueError, match="budgets must be fractions"):
        calibrate(gemma_cm, [prompt(64)], [1.5])
