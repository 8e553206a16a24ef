"""FastKVzip (``methods.fastkvzip``): the gate computes its formula (docs/methods_learned.md#fastkvzip), trains on KVzip
targets like KVzap, keeps its sinks and newest tokens within the budget, reproduces the model at budget 1.0, and is
never trained by ``apply`` (refused, naming ``kvcompile train``)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import assert_plain_at_full_budget, left_padded_batch, train_tiny
from safetensors.torch import load_file

import kvcompile
from kvcompile.methods.fastkvzip import Gate


def _gate_by_formula(net: Gate, x: torch.Tensor, layer: int) -> torch.Tensor:
    """score_{j,h} = mean_r 1 / (1 + sum_s exp(z_{h,r,s} - l_{h,r})), one token, head and query projection at a time."""
    p = {k: v[layer] for k, v in net.state_dict().items()}
    H, S, _ = x.shape
    rank, group = p["wk"].shape[-1], p["b"].shape[-1]

    def rms(v, gain):
        return v / (v.square().mean() + 1e-6).sqrt() * gain.flatten()

    out = torch.empty(H, S)
    for h in range(H):
        for j in range(S):
            k = rms(x[h, j] @ p["wk"][h], p["k_norm"])
            q_all = x[h, j] @ p["wq"][h] + p["bq"][h]
            gates = []
            for r in range(group):
                q = rms(q_all[r * rank:(r + 1) * rank], p["q_norm"])
                own = k @ q / math.sqrt(rank) + p["b"][h, r]
                sinks = p["sinks"][h] @ q / math.sqrt(rank)
                gates.append(1 / (1 + torch.exp(sinks - own).sum()))
            out[h, j] = torch.stack(gates).mean()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_gate_is_the_formula(seed):
    g = torch.Generator().manual_seed(seed)
    net = Gate(layers=2, heads=2, group=3, features=8, rank=4, sinks=5, seed=seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(2, 2, 6, 8, generator=g)
    batched = net(x).exp()
    for layer in range(2):
        want = _gate_by_formula(net, x[layer], layer)
        torch.testing.assert_close(net(x[layer], layer).exp(), want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
        torch.testing.assert_close(batched[layer], want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
    assert ((batched > 0) & (batched < 1)).all()


def test_zero_sinks_and_bias_give_the_closed_form():
    """With zero sinks and zero bias, gate = 1 / (1 + n_sinks e^(-k.q / sqrt(rank)))."""
    net = Gate(layers=1, heads=1, group=1, features=8, rank=4, sinks=16, seed=3)
    x = torch.randn(1, 1, 5, 8, generator=torch.Generator().manual_seed(3))
    q = x[0] @ net.wq[0] + net.bq[0]
    k = x[0] @ net.wk[0]
    q, k = (v / (v.square().mean(-1, keepdim=True) + 1e-6).sqrt() for v in (q, k))
    want = 1 / (1 + 16 * torch.exp(-(q * k).sum(-1) / 2))
    torch.testing.assert_close(net(x)[0].exp(), want)


@pytest.fixture(scope="module")
def trained(tiny_lm, tmp_path_factory):
    return train_tiny("fastkvzip", *tiny_lm, tmp_path_factory.mktemp("weights"))


def _recipe(weights, **extra) -> kvcompile.Recipe:
    return kvcompile.Recipe("fastkvzip-tiny", "fastkvzip", "global-topk", {"weights": str(weights), **extra})


def test_training_lowers_the_loss_and_round_trips(tiny_lm, trained):
    path, card = trained
    assert card["method"] == "fastkvzip" and card["form"] == "gate-rank16-sinks16"
    assert card["final_loss"] < 0.5 * card["initial_loss"]
    scorer, _ = _recipe(path, sha256=card["sha256"]).build()
    saved, state = load_file(str(path)), scorer.net.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    model = tiny_lm[0]
    assert saved["wk"].shape[:3] == (model.config.num_hidden_layers, model.config.num_key_value_heads,
                                     model.config.hidden_size)
    with pytest.raises(ValueError, match="hidden must be 0"):
        train_tiny("fastkvzip", *tiny_lm, path.parent / "mlp", hidden=8)


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_it_keeps_its_sinks_and_newest_tokens_within_the_budget(tiny_lm, trained, budget):
    model, _ = tiny_lm
    cm = kvcompile.apply(model, budget=budget, recipe=_recipe(trained[0]), page_size=4)
    lengths = [200, 150]
    ids, mask = left_padded_batch(lengths, total=200)
    cm.prefill(ids, mask)
    stats, held = cm.cache_stats(), cm.held_positions()
    assert stats["bytes_held"] <= stats["budget_bytes"] < stats["bytes_full"]
    for row, n in enumerate(lengths):
        must = set(range(4)) | set(range(n - max(1, int(0.02 * n)), n))
        for layer in range(held.shape[0]):
            for head in range(held.shape[2]):
                assert must <= set(held[layer, row, head].tolist()), (row, layer, head)


def test_budget_one_reproduces_the_model_and_bad_arguments_are_named(tiny_lm, trained):
    model, _ = tiny_lm
    assert_plain_at_full_budget(model, model, _recipe(trained[0]))
    with pytest.raises(ValueError, match="hidden states only"):
        _recipe(trained[0], inputs="cache").build()
    with pytest.raises(ValueError, match="recent must be in"):
        _recipe(trained[0], recent=1.5).build()


def test_apply_never_trains_missing_weights_it_names_the_command(tiny_lm, tmp_path, monkeypatch):
    """Missing gates are refused by ``apply`` with the command that makes them, and nothing is written; once
    trained (``kvcompile train``), ``apply`` reads them."""
    model, tok = tiny_lm
    monkeypatch.setenv("KVCOMPILE_WEIGHTS", str(tmp_path))
    recipe = kvcompile.Recipe("fk", "fastkvzip", "global-topk", {"weights": "tiny"})
    with pytest.raises(FileNotFoundError, match="kvcompile train fastkvzip --model tiny"):
        kvcompile.apply(model, budget=0.5, recipe=recipe)
    assert not list(tmp_path.iterdir()), "apply wrote weights"

    train_tiny("fastkvzip", model, tok, tmp_path)
    cm = kvcompile.apply(model, budget=0.5, recipe=recipe, page_size=4)
    cm.prefill(*left_padded_batch([120], total=120))
    assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]


@pytest.mark.slow
@pytest.mark.skipif("KVCOMPILE_LONG" not in os.environ, reason="trains the SmolLM2 gates: 8 minutes on 2 cores")
def test_the_train_command_makes_the_smollm2_gates_and_it_runs_by_name(tmp_path, monkeypatch):
    from kvcompile.cli import main as cli
    from kvcompile.eval.fidelity import prose_windows
    from kvcompile.methods import learned

    monkeypatch.setenv("KVCOMPILE_WEIGHTS", str(tmp_path))
    model, tok = kvcompile.load_model("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="kvcompile train fastkvzip --model smollm2-135m"):
        kvcompile.apply(model, budget=0.25, recipe="fastkvzip")
    cli(["train", "fastkvzip", "--model", "smollm2-135m"])
    cm = kvcompile.apply(model, budget=0.25, recipe="fastkvzip")
    _, card = learned.load("fastkvzip", "smollm2-135m")
    assert card["held_out_spearman"]["trained"] > card["held_out_spearman"]["random_init"] + 0.3
    cm.prefill(torch.tensor([prose_windows(tok, 1, 600)[0]]))
    assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]
