"""MetaKV (docs/methods.md#metakv): predictors fitted on per-prompt results, and the selection rule under latency and
memory limits."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvcompile
from kvcompile.metakv import FEATURES, MetaKV, configuration, prompt_features


def rows(n: int = 40) -> list[dict]:
    """Three configurations on n prompts: latency and memory linear in length; snapkv/0.2 is right only on prompts
    with many digits, snapkv/0.5 and full always."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        k, digits = 0.2 + float(torch.rand((), generator=g)), float(torch.rand((), generator=g))
        x = [1.0, k, 10 * digits, 0.5]
        for config, ms, mib in (("full/1", 100, 10), ("snapkv/0.5", 60, 5), ("snapkv/0.2", 40, 2)):
            correct = digits > 0.5 if config == "snapkv/0.2" else True
            out.append({"config": config, "features": x, "latency_ms": ms * k, "memory": mib * k,
                        "correct": float(correct)})
    return out


def test_predictors_recover_linear_costs_and_correctness():
    meta = MetaKV.fit(rows())
    pred = meta.predict([1.0, 1.0, 9.0, 0.5])
    assert pred["full/1"]["latency_ms"] == pytest.approx(100, rel=1e-3)
    assert pred["snapkv/0.2"]["memory"] == pytest.approx(2, rel=1e-3)
    assert pred["snapkv/0.2"]["p_correct"] > 0.9 > 0.1 > meta.predict([1.0, 1.0, 1.0, 0.5])["snapkv/0.2"]["p_correct"]


def test_selection_follows_the_rule():
    meta = MetaKV.fit(rows())
    x = [1.0, 1.0, 9.0, 0.5]
    assert meta.choose(x, 200, 20) == "full/1"  # the uncompressed configuration when it fits
    assert meta.choose(x, 70, 20) == "snapkv/0.5"  # else a recipe's weakest feasible compression
    assert meta.choose(x, 45, 3) == "snapkv/0.2"
    assert meta.choose(x, 1, 1) == "snapkv/0.2"  # nothing fits: the least over both limits
    with pytest.raises(ValueError, match="must be positive"):
        meta.choose(x, 0, 1)


def test_predictors_round_trip_as_json_and_refuse_other_features(tmp_path):
    meta = MetaKV.fit(rows())
    meta.save(tmp_path / "p.json")
    assert MetaKV.load(tmp_path / "p.json").weights == meta.weights
    (tmp_path / "q.json").write_text('{"features": ["bias"], "weights": {}}')
    with pytest.raises(ValueError, match="features"):
        MetaKV.load(tmp_path / "q.json")


def test_the_chosen_configuration_runs_within_its_budget():
    meta = MetaKV.fit(rows())
    cm = kvcompile.apply(tiny_model("llama"), budget=1.0, recipe="full")
    ids = torch.randint(2, 90, (1, 48), generator=torch.Generator().manual_seed(1))
    x = prompt_features("a 1234", 48, ids[0].tolist())
    assert len(x) == len(FEATURES) and configuration("snapkv/0.2") == ("snapkv", 0.2)
    chosen = meta.apply(cm, [1.0, 1.0, 9.0, 0.5], max_latency_ms=45, max_memory=3)
    assert chosen.recipe.name == "snapkv" and chosen.budget.value == 0.2
    chosen.prefill(ids)
    stats = chosen.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
