"""The risk ledger (issue 20 item 6, inferred): fields land in their tiers, the certified ones are the
cache's own accounting, the dropped mass is 0 when nothing was dropped and matches the window queries' attention
recomputed by hand; every sweep row carries a ledger, in the store too."""

from __future__ import annotations

import json
import random

import torch
from conftest import byte_tokenizer, eager_attentions

from kvcompile.eval import ledger, sweep
from kvcompile.eval.store import Store
from kvcompile.eval.sweep import grid, shared_base


def compressed(byte_full, recipe: str, budget, seed: int):
    """(before, after): a fork of a shared prefill of a random document, uncompressed and then compressed."""
    doc = torch.randint(2, 258, (1, 160), generator=torch.Generator().manual_seed(seed))
    base = shared_base(byte_full, grid([recipe], [budget]))
    base.prefill(doc, compress=False)
    after = base.fork(recipe, budget)
    before = after.fork()
    after.compress()
    return before, after


def test_fields_land_in_their_tiers():
    stats = {"budget_bytes": 4096, "bytes_held": 4000, "bytes_allocated": 8192, "tokens_held": 40}
    entry = ledger.ledger(stats, 0.25, {"dropped_mass_max": 0.3, "dropped_mass_mean": 0.1, "window": 8})
    assert set(entry) == set(ledger.TIERS)
    assert entry["certified"] == {"budget": "0.25", "budget_bytes": 4096, "bytes_held": 4000, "bytes_allocated": 8192,
                                  "within_budget": True, "tokens_held": 40}
    assert entry["bounded"]["dropped_mass_max"] == 0.3 and "score" not in entry["bounded"]
    assert set(entry["empirical"]) == {"score", "kl_mean", "kl_p99", "top1", "uor"}
    assert not set(entry["empirical"]) & set(entry["certified"])
    over = ledger.ledger({**stats, "bytes_held": 5000}, 0.25, None)
    assert over["certified"]["within_budget"] is False and over["bounded"] == {}
    assert ledger.ledger({**stats, "budget_bytes": None}, 1.0, None)["certified"]["within_budget"] is None
    assert json.loads(ledger.dumps(entry)) == entry


def test_dropped_mass_is_zero_when_nothing_is_dropped(byte_full):
    before, after = compressed(byte_full, "snapkv", 1.0, random.SystemRandom().randrange(2**31))
    mass = ledger.dropped_mass(before, after)
    assert abs(mass["dropped_mass_max"]) < 1e-6 and mass["window"] > 0


def test_a_recipe_that_observes_no_queries_bounds_nothing(byte_full):
    before, after = compressed(byte_full, "streamingllm", 0.25, random.SystemRandom().randrange(2**31))
    assert ledger.dropped_mass(before, after) == {"dropped_mass_max": None, "dropped_mass_mean": None, "window": 0}


def test_dropped_mass_is_the_window_attention_on_evicted_entries(byte_full):
    """Recomputed from the plain model's own attention weights (eager attention, every query) at the observed
    queries, summed over the positions the compressed cache no longer holds."""
    seed = random.SystemRandom().randrange(2**31)
    before, after = compressed(byte_full, "tova", 0.25, seed)
    mass = ledger.dropped_mass(before, after)
    assert 0 < mass["dropped_mass_mean"] <= mass["dropped_mass_max"] <= 1, f"seed={seed}"
    doc = torch.randint(2, 258, (1, 160), generator=torch.Generator().manual_seed(seed))
    attn = eager_attentions(byte_full.source, doc)  # L x [1, Hq, T, T]
    held = after.held_positions()[:, 0]  # [L, Hkv, S]
    W, lost = mass["window"], []
    for layer, a in enumerate(attn):
        G = a.shape[1] // held.shape[1]
        for h in range(a.shape[1]):
            pos = held[layer, h // G]
            kept = a[0, h, -W:][:, pos[pos >= 0]].sum(-1)
            lost.append(1 - kept)
    lost = torch.cat(lost)
    assert abs(float(lost.max()) - mass["dropped_mass_max"]) < 1e-4, f"seed={seed}"
    assert abs(float(lost.mean()) - mass["dropped_mass_mean"]) < 1e-4, f"seed={seed}"


def test_every_sweep_row_carries_its_ledger_in_the_store(byte_full, tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        sweep.run(byte_full, byte_tokenizer(), ["snapkv"], [0.25], ["passkey"], n_samples=1, length=400,
                  progress=False, store=store, model="byte-llama")
        rows = store.rows()
    assert len(rows) == 2
    for row in rows:
        entry = json.loads(row["ledger"])
        assert entry["certified"]["bytes_held"] == row["bytes_held"]
        assert entry["certified"]["budget"] == row["budget"]
    full, snap = (json.loads(r["ledger"]) for r in rows)
    assert full["bounded"] == {} and full["certified"]["within_budget"] is None
    assert snap["certified"]["within_budget"] is True and 0 < snap["bounded"]["dropped_mass_max"] <= 1


def test_a_sweep_without_the_mass_gives_the_same_cells_and_bounds_nothing(byte_full):
    args = (byte_full, byte_tokenizer(), ["snapkv"], [0.25], ["passkey"])
    kwargs = {"n_samples": 1, "length": 400, "progress": False, "kl": True}
    with_mass = sweep.run(*args, **kwargs)["samples"]
    without = sweep.run(*args, **kwargs, ledger_mass=False)["samples"]
    for a, b in zip(with_mass, without):
        assert {k: a[k] for k in ("score", "bytes_held", "kl_mean", "top1")} == \
               {k: b[k] for k in ("score", "bytes_held", "kl_mean", "top1")}
    assert json.loads(with_mass[1]["ledger"])["bounded"]["dropped_mass_max"] > 0
    assert json.loads(without[1]["ledger"])["bounded"] == {}
