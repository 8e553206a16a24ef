"""KVpop's stateless scorer (docs/methods_learned.md#kvpop) and its training on tiny random models: the future-attention
target equals dense attention's column sums, labels keep the top share with weights highest at the cut, training lowers
the loss, the recipe keeps its window and holds its budget, and budget 1.0 reproduces the model."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import assert_plain_at_full_budget, eager_attentions, left_padded_batch, train_tiny
from safetensors.torch import load_file

import kvcompile
from kvcompile.calibration import calibration_runner
from kvcompile.methods.decoding import LayerState
from kvcompile.methods.kvpop import DELAY, KVpopDelayed, delayed_features, lookahead_mass
from kvcompile.observation import observe
from kvcompile.train.kvpop import auc, future_mass, labels


@pytest.fixture(scope="module")
def trained(tiny_lm, tmp_path_factory):
    return train_tiny("kvpop", *tiny_lm, tmp_path_factory.mktemp("weights"))


def _recipe(path, window: int = 8) -> kvcompile.Recipe:
    return kvcompile.Recipe("kvpop-tiny", "kvpop", "uniform", {"weights": str(path), "window": window})


@pytest.mark.parametrize("window", [0, 5])
def test_the_target_is_the_column_sum_of_dense_attention_after_the_window(llama, llama_cm, window):
    """Against the plain model's own attention weights (eager, every query): for each key j, the attention of the
    queries at positions >= j + window, summed over them and the GQA group; blocks of 7 queries change nothing."""
    seed = random.SystemRandom().randrange(2**31)
    n = 40
    ids = torch.randint(2, 90, (1, n), generator=torch.Generator().manual_seed(seed))
    runner = calibration_runner(llama_cm, window=n)
    runner.prefill(ids, compress=False, logits="last")
    attn = eager_attentions(llama, ids)  # L x [1, Hq, T, T]
    for layer, a in zip(runner.programs.layers, attn):
        obs = observe(runner.cache, layer)
        got = future_mass(obs, window, block=7)[0]  # [Hkv, S]
        t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        dense = (a[0] * (t >= j + window)).sum(1)  # [Hq, T]
        want = dense.reshape(got.shape[0], -1, n).sum(1)
        order = obs.positions[0].masked_fill(~obs.valid[0], n).argsort(-1)[:, :n]  # held entries, by position
        torch.testing.assert_close(got.gather(-1, order), want, atol=1e-5, rtol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def test_labels_keep_the_top_share_and_weigh_the_cut_most():
    mass = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0, 9.0, 0.5, 7.0]])
    candidates = torch.tensor([[True, True, True, True, True, True, True, False]])
    label, weight = labels(mass, candidates, keep=0.5)
    assert label.tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]]  # top 3 of 7 candidates (floor 3.5)
    assert weight[0, 7] == 0 and float(weight[0, 3]) == float(weight[0].max())  # rank 3: the first dropped
    assert float(auc(torch.tensor([[[0.1, 0.9, 0.4, 0.8]]]), torch.tensor([[[0.0, 1.0, 0.0, 1.0]]]))) == 1.0
    assert float(auc(torch.tensor([[[0.9, 0.1, 0.8, 0.4]]]), torch.tensor([[[0.0, 1.0, 0.0, 1.0]]]))) == 0.0


def test_training_lowers_the_loss_and_reports_held_out_auc(trained):
    """On the tiny random model the loss falls; whether the scorer beats its initialisation is measured where it
    means something, on SmolLM2 (``bench/kvpop.py``, the shipped card)."""
    _, card = trained
    assert card["method"] == "kvpop" and card["final_loss"] < card["initial_loss"]
    assert set(card["held_out_auc"]) == {"trained", "random_init"}
    assert all(0 <= v <= 1 for v in card["held_out_auc"].values())


def test_weights_round_trip_through_safetensors_and_the_same_seed_reproduces_them(tiny_lm, trained, tmp_path):
    """The recipe loads exactly the saved tensors; a second run with the same seed writes the same bits."""
    path, _ = trained
    scorer, _ = _recipe(path).build()
    saved, state = load_file(str(path)), scorer.net.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    again, _ = train_tiny("kvpop", *tiny_lm, tmp_path)
    assert all(torch.equal(load_file(str(again))[k], saved[k]) for k in saved)


def test_the_recipe_keeps_its_window_and_holds_its_budget(tiny_lm, trained):
    model, _ = tiny_lm
    cm = kvcompile.apply(model, budget=0.3, recipe=_recipe(trained[0]), page_size=4)
    ids, mask = left_padded_batch([200, 150], total=200)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["bytes_held"] < stats["bytes_full"]
    held = cm.held_positions()
    for row, n in enumerate((200, 150)):
        for p in range(n - 8, n):  # the protected window, in every layer and head
            assert bool((held[:, row] == p).any(-1).all()), (row, p)
    with pytest.raises(FileNotFoundError, match="kvcompile train kvpop --model"):
        kvcompile.apply(model, budget=0.3, recipe=_recipe(trained[0].with_name("none.safetensors")))


def test_budget_one_reproduces_the_model(tiny_lm, trained):
    model, _ = tiny_lm
    assert_plain_at_full_budget(model, model, _recipe(trained[0]))


@pytest.mark.slow
def test_the_shipped_weights_beat_their_initialisation_and_run_by_name_on_smollm2():
    from kvcompile.eval.fidelity import prose_windows
    from kvcompile.methods import learned

    pinned = kvcompile.recipes()["kvpop"].scorer_args
    _, card = learned.load("kvpop", pinned["weights"], pinned["sha256"])
    assert card["model"] == "smollm2-135m"
    assert card["held_out_auc"]["trained"] > card["held_out_auc"]["random_init"] + 0.2
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=0.25, recipe="kvpop")
    cm.prefill(torch.tensor([prose_windows(tok, 1, 600)[0]]))
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == kvcompile.recipes()["kvpop"].tag


@pytest.fixture(scope="module")
def delayed(tiny_lm, tmp_path_factory):
    return train_tiny("kvpop-delayed", *tiny_lm, tmp_path_factory.mktemp("weights"))


def _delayed_recipe(path, stateless, every: int = 4) -> kvcompile.Recipe:
    """The prompt ranked by the stateless scorer at prefill, the generated tokens by the delayed one."""
    return kvcompile.Recipe("kvpop-delayed-tiny", "kvpop", "uniform", {"weights": str(stateless), "window": 8},
                            decode={"policy": "kvpop-delayed", "every": every, "recent": 8, "sinks": 2, "prompt": True,
                                    "args": {"weights": str(path)}})


@pytest.mark.parametrize("delay", [1, 4])
def test_the_lookahead_is_the_attention_of_the_next_queries(llama, llama_cm, delay):
    """For each key j, the attention of the queries at positions j+1 .. j+delay, summed over them and the GQA
    group, against the plain model's own attention weights; blocks of 7 queries change nothing."""
    seed = random.SystemRandom().randrange(2**31)
    n = 40
    ids = torch.randint(2, 90, (1, n), generator=torch.Generator().manual_seed(seed))
    runner = calibration_runner(llama_cm, window=n)
    runner.prefill(ids, compress=False, logits="last")
    for layer, a in zip(runner.programs.layers, eager_attentions(llama, ids)):
        obs = observe(runner.cache, layer)
        got = lookahead_mass(obs, delay, block=7)[0]
        t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        want = (a[0] * ((t > j) & (t <= j + delay))).sum(1).reshape(got.shape[0], -1, n).sum(1)
        order = obs.positions[0].masked_fill(~obs.valid[0], n).argsort(-1)[:, :n]
        torch.testing.assert_close(got.gather(-1, order), want, atol=1e-5, rtol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def test_the_delayed_scorer_trains_on_one_more_feature(trained, delayed):
    (path, card), (stateless, _) = delayed, trained
    assert card["method"] == "kvpop-delayed" and card["final_loss"] < card["initial_loss"]
    assert load_file(str(path))["w"].shape[-1] == load_file(str(stateless))["w"].shape[-1] + 1


def test_a_token_is_scored_once_when_due_and_never_before(llama_cm, tiny_lm, delayed):
    """The policy on an observation of 40 tokens: the newest DELAY score +inf (pending), the rest the net's score
    of their entries and lookahead; a later run with other queries leaves a fixed score where it was."""
    model, _ = tiny_lm
    runner = calibration_runner(kvcompile.apply(model, budget=1.0, recipe="full"), window=40)
    runner.prefill(torch.randint(2, 200, (1, 40), generator=torch.Generator().manual_seed(0)), compress=False)
    policy = KVpopDelayed(weights=str(delayed[0]))
    layer = runner.programs.layers[1]
    obs = observe(runner.cache, layer)
    state = LayerState(torch.full(obs.valid.shape, float("nan")))
    scores = policy.score(state, obs, obs.query_positions >= 0)
    pending = obs.valid & (obs.positions > 39 - DELAY)
    assert bool(scores[pending].isinf().all()) and bool(scores[obs.valid & ~pending].isfinite().all())
    want = policy.net(delayed_features(obs.keys, obs.values, lookahead_mass(obs, DELAY)), obs.layer)
    torch.testing.assert_close(scores[obs.valid & ~pending], want[obs.valid & ~pending])
    fixed = scores.clone()
    other = dataclasses.replace(obs, queries=obs.queries.flip(2))
    assert torch.equal(policy.score(state, other, obs.query_positions >= 0)[obs.valid & ~pending],
                       fixed[obs.valid & ~pending])


def test_while_decoding_the_cache_holds_its_budget_and_budget_one_is_the_model(tiny_lm, trained, delayed):
    model, _ = tiny_lm
    recipe = _delayed_recipe(delayed[0], trained[0])
    cm = kvcompile.apply(model, budget=48, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([30, 24], total=30)
    cm.generate(ids, mask, max_new_tokens=60, eos_token_id=[])
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] < stats["bytes_full"]
    held = cm.held_positions()
    for row, n in enumerate((30 + 59, 24 + 59)):
        for p in range(n - 8, n):  # the recent window and the pending tokens, everywhere
            assert bool((held[:, row] == p).any(-1).all()), (row, p)
    with pytest.raises(FileNotFoundError, match="kvcompile train kvpop-delayed --model"):
        kvcompile.apply(model, budget=48, recipe=_delayed_recipe(delayed[0].with_name("none.safetensors"), trained[0]))
    assert_plain_at_full_budget(model, model, recipe)


@pytest.mark.slow
def test_the_shipped_delayed_weights_beat_their_initialisation_and_decode_by_name_on_smollm2():
    from kvcompile.eval.fidelity import prose_windows
    from kvcompile.methods import learned

    pinned = kvcompile.recipes()["kvpop-delayed"].decode["args"]
    _, card = learned.load("kvpop-delayed", pinned["weights"], pinned["sha256"])
    assert card["model"] == "smollm2-135m"
    assert card["held_out_auc"]["trained"] > card["held_out_auc"]["random_init"] + 0.2
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=96, recipe="kvpop-delayed")
    cm.generate(torch.tensor([prose_windows(tok, 1, 64)[0]]), max_new_tokens=80, eos_token_id=[])
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] < stats["bytes_full"]
