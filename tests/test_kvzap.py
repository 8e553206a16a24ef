"""KVzap and its training (``kvcompile.train``) on tiny random models: targets are KVzip's attention, training
lowers the loss, weights round-trip through safetensors, the same seed reproduces them and a resumed run ends where
an unbroken one does, the recipe runs within its budget, refuses without weights or with another model's, and
budget 1.0 reproduces the model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import TINY_DATA, TINY_SCHEDULE, assert_plain_at_full_budget, left_padded_batch, train_tiny
from safetensors.torch import load_file

import kvcompile
from kvcompile.methods import learned
from kvcompile.train import train
from kvcompile.train.kvzap import kvzip_examples
from kvcompile.train.loop import Schedule, fit

SCHEDULE = Schedule(**TINY_SCHEDULE)


@pytest.fixture(scope="module")
def trained(tiny_lm, tmp_path_factory):
    return train_tiny("kvzap", *tiny_lm, tmp_path_factory.mktemp("weights"))


def _recipe(path, name="kvzap", **extra) -> kvcompile.Recipe:
    if name == "dms":
        return kvcompile.Recipe("dms-tiny", "dms", "threshold", {"base": "kvzap", "base_args": {"weights": str(path)},
                                                                 "window": 16}, {"tau": -4.0})
    return kvcompile.Recipe("kvzap-tiny", "kvzap", "global-topk", {"weights": str(path), **extra})


def test_targets_are_kvzip_attention_computed_densely(llama, llama_cm):
    """log max over the reconstruction queries and the GQA group of the attention paid to each context token."""
    n = 40
    ids = torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    x, y = kvzip_examples(llama_cm, [ids], per_context=n, seed=0, progress=False)
    eager = copy.deepcopy(llama)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attn = eager(torch.tensor([ids + ids]), output_attentions=True).attentions  # L x [1, Hq, 2n, 2n]
    Hkv = llama.config.num_key_value_heads
    dense = torch.stack([a[0, :, n:, :n].amax(1).reshape(Hkv, -1, n).amax(1) for a in attn])  # [L, Hkv, n]
    assert y.shape == (len(attn), Hkv, n - 4) and x.shape[:3] == y.shape  # the 4 pinned sinks carry no target
    torch.testing.assert_close(y, dense[..., 4:].log(), rtol=1e-4, atol=1e-4)


def test_training_lowers_the_loss_and_beats_nothing_it_does_not_measure(trained):
    path, card = trained
    assert card["final_loss"] < 0.8 * card["initial_loss"]
    assert card["tokens_seen"] == SCHEDULE.steps * SCHEDULE.batch and card["data"]["examples"] == 3 * 64
    assert set(card["held_out_spearman"]) == {"trained", "random_init"}
    assert json.loads(path.with_suffix(".json").read_text()) == card
    assert (path.parent / "runs" / "kvzap-tiny-seed3" / "loss.png").is_file()


def test_weights_round_trip_through_safetensors(trained):
    path, card = trained
    scorer, _ = _recipe(path, sha256=card["sha256"]).build()
    saved = load_file(str(path))
    state = scorer.net.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    with pytest.raises(FileNotFoundError, match="SHA-256"):
        _recipe(path, sha256="0" * 64).build()


def test_the_same_seed_reproduces_the_weights_bitwise(tiny_lm, trained, tmp_path):
    path, _ = trained
    train("kvzap", *tiny_lm, name="tiny", schedule=SCHEDULE, out=tmp_path, **TINY_DATA)
    again, first = load_file(str(tmp_path / "kvzap-tiny.safetensors")), load_file(str(path))
    assert all(torch.equal(again[k], first[k]) for k in first)
    other = Schedule(**{**SCHEDULE.__dict__, "seed": 4})
    train("kvzap", *tiny_lm, name="tiny", schedule=other, out=tmp_path / "other", **{**TINY_DATA, "per_length": 1})
    assert not torch.equal(load_file(str(tmp_path / "other" / "kvzap-tiny.safetensors"))["w"], first["w"])


def test_a_resumed_run_ends_where_an_unbroken_one_does(tmp_path):
    x, y = torch.randn(2, 1, 50, 3), torch.randn(2, 1, 50)

    def loss_until(stop):
        def loss(net, idx):
            if stop is not None and len(calls) == stop:
                raise KeyboardInterrupt
            calls.append(1)
            return (net(x[:, :, idx]) - y[:, :, idx]).square().mean()
        calls = []
        return loss

    from kvcompile.methods.kvzap import Surrogate

    schedule = Schedule(steps=10, batch=8, seed=1, checkpoint_every=4)
    whole = Surrogate(2, 1, 3, hidden=4, seed=1)
    losses = fit(whole, loss_until(None), 50, schedule, tmp_path / "whole", progress=False)
    broken = Surrogate(2, 1, 3, hidden=4, seed=1)
    with pytest.raises(KeyboardInterrupt):
        fit(broken, loss_until(6), 50, schedule, tmp_path / "broken", progress=False)
    resumed = Surrogate(2, 1, 3, hidden=4, seed=1)
    assert fit(resumed, loss_until(None), 50, schedule, tmp_path / "broken", progress=False) == losses
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), whole.state_dict().values()))


@pytest.mark.parametrize("name", ["kvzap", "dms"])
@pytest.mark.parametrize("budget", [0.5, 0.2])
def test_the_recipes_hold_their_budget(tiny_lm, trained, name, budget):
    model, tok = tiny_lm
    cm = kvcompile.apply(model, budget=budget, recipe=_recipe(trained[0], name), page_size=4)
    ids, mask = left_padded_batch([200, 150], total=200)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["bytes_held"] < stats["bytes_full"]


def test_missing_weights_are_refused_before_anything_runs(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_WEIGHTS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="kvcompile train kvzap --model nobody"):
        kvcompile.apply(tiny_lm[0], budget=0.5, recipe=kvcompile.Recipe("k", "kvzap", "global-topk",
                                                                     {"weights": "nobody"}))


def test_weights_of_another_model_are_refused(llama_cm, trained):
    with pytest.raises(ValueError, match="trained for 2 layers x 2 KV heads"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=_recipe(trained[0]))


def test_budget_one_reproduces_the_model(tiny_lm, trained):
    model, _ = tiny_lm
    assert_plain_at_full_budget(model, model, _recipe(trained[0]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kvzap", "dms", "dms-decode"])
def test_the_shipped_recipes_run_by_name_on_smollm2(name):
    from kvcompile.eval.fidelity import prose_windows

    model, tok = kvcompile.load_model("smollm2-135m")
    pinned = kvcompile.recipes()["kvzap"].scorer_args  # both recipes read these weights
    _, card = learned.load("kvzap", pinned["weights"], pinned["sha256"])
    assert card["model"] == "smollm2-135m"
    assert card["held_out_spearman"]["trained"] > card["held_out_spearman"]["random_init"]
    cm = kvcompile.apply(model, budget=0.25, recipe=name)
    prompt = torch.tensor([prose_windows(tok, 1, 600)[0]])
    if cm.recipe.decode:  # past the window of 128, so generated tokens are decided too
        cm.generate(prompt, max_new_tokens=150, eos_token_id=[])
    else:
        cm.prefill(prompt)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == kvcompile.recipes()[name].tag


@pytest.fixture(scope="module")
def trained_hidden(tiny_lm, tmp_path_factory):
    return train_tiny("kvzap-hidden", *tiny_lm, tmp_path_factory.mktemp("weights"))


def test_the_hidden_state_form_reads_each_layers_attention_input(llama, llama_cm):
    """Its features are the plain model's input norm of the residual stream, at the tokens the targets are for."""
    n = 40
    ids = torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    x, y = kvzip_examples(llama_cm, [ids], per_context=n, seed=0, progress=False, inputs="hidden")
    with torch.no_grad():
        states = llama(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer, block in enumerate(llama.model.layers):
        want = block.input_layernorm(states[layer])[0, 4:]  # the 4 pinned sinks carry no target
        for head in range(x.shape[1]):
            torch.testing.assert_close(x[layer, head], want, atol=1e-5, rtol=1e-5)
    assert x.shape[:3] == y.shape


def test_the_hidden_state_form_trains_and_runs_within_its_budget(tiny_lm, trained, trained_hidden):
    model, _ = tiny_lm
    path, card = trained_hidden
    assert card["method"] == "kvzap-hidden" and card["final_loss"] < card["initial_loss"]
    assert load_file(str(path))["w"].shape[-1] == model.config.hidden_size
    recipe = kvcompile.Recipe("kvzap-hidden-tiny", "kvzap", "global-topk",
                              {"weights": str(path), "inputs": "hidden"})
    cm = kvcompile.apply(model, budget=0.3, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([200, 150], total=200)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] < stats["bytes_full"]
    assert_plain_at_full_budget(model, model, recipe)
    with pytest.raises(ValueError, match="dense pass of the source model"):
        kvcompile.apply(model, budget=0.3, recipe=recipe, prefill_chunk=64)
    with pytest.raises(FileNotFoundError, match="kvcompile train kvzap-hidden --model"):
        kvcompile.apply(model, budget=0.3, recipe=_recipe("none", inputs="hidden"))
    with pytest.raises(ValueError, match="train kvzap-hidden"):  # weights of the cache-feature form
        kvcompile.apply(model, budget=0.3, recipe=_recipe(trained[0], inputs="hidden"))


def test_the_ridge_form_solves_its_normal_equations(tiny_lm, tmp_path):
    """``ridge`` > 0: the weights solve X^T (X w - (y - b)) + lambda w = 0 on the normalised training features, per
    (layer, KV head); ridge is refused where the targets are not real values (kvpop's labels) or with an MLP."""
    path, card = train_tiny("kvzap", *tiny_lm, tmp_path, ridge=10.0)
    assert card["form"] == "ridge10" and card["final_loss"] < card["initial_loss"]
    net = learned.load("kvzap", str(path))[0]
    data = load_file(str(tmp_path / "runs" / "kvzap-tiny-seed3" / "data.safetensors"))
    xn = (data["x"] - net["mean"][:, :, None]) / net["std"][:, :, None]
    residual = (xn * net["w"][:, :, None]).sum(-1) - (data["y"] - net["b"][..., None])
    gradient = (xn * residual[..., None]).sum(2) + 10.0 * net["w"]
    assert gradient.abs().max() < 1e-3 * (xn * (data["y"] - net["b"][..., None])[..., None]).sum(2).abs().max()
    for method, extra in (("kvpop", {}), ("kvzap", {"hidden": 8})):
        with pytest.raises(ValueError, match="ridge fits the linear form"):
            train(method, *tiny_lm, name="tiny", ridge=1.0, out=tmp_path, **extra)


@pytest.mark.slow
def test_the_shipped_hidden_state_weights_beat_the_cache_features_and_run_by_name_on_smollm2():
    from kvcompile.eval.fidelity import prose_windows

    def spearman(recipe: str, trained_as: str) -> dict:
        args = kvcompile.recipes()[recipe].scorer_args
        return learned.load(trained_as, args["weights"], args["sha256"])[1]["held_out_spearman"]

    hidden = spearman("kvzap-hidden", "kvzap-hidden")
    assert hidden["trained"] > spearman("kvzap", "kvzap")["trained"] > hidden["random_init"] + 0.5
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=0.25, recipe="kvzap-hidden")
    cm.prefill(torch.tensor([prose_windows(tok, 1, 600)[0]]))
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == "kvzap-hidden@1"
