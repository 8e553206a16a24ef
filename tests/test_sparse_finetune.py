"""Training under compression (issue 17): the dense masked forward equals the paged path on fresh random inputs, LoRA
adapters are exact (hooked = merged, zero-initialised = the model), sparse-finetune trains and reproduces itself,
and a recipe that names an adapter serves the merged model, leaving the given one untouched."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_plain_at_full_budget, byte_llama, byte_tokenizer, tiny_model
from safetensors.torch import load_file

import kvcompile
import kvcompile.models
from kvcompile.adapters import Adapter
from kvcompile.eval.analysis.masked import kept, masking
from kvcompile.train.loop import Schedule
from kvcompile.train.sparse_finetune import finetune


@pytest.fixture(scope="module")
def model():
    return byte_llama()


@pytest.mark.parametrize(("recipe", "seed"), [("h2o", 0), ("snapkv", 1), ("adakv-snapkv", 2), ("streamingllm", 3)])
@pytest.mark.parametrize("family", ["byte-llama", "gemma3"])  # gemma3: a sliding-window layer
def test_the_masked_forward_is_the_paged_path(model, recipe, seed, family):
    model = model if family == "byte-llama" else tiny_model("gemma3")
    g = torch.Generator().manual_seed(seed)
    n, m = int(torch.randint(60, 140, (1,), generator=g)), 24
    ids = torch.randint(2, model.config.vocab_size - 1, (1, n + m), generator=g)
    cm = kvcompile.apply(model, budget=0.3, recipe=recipe, page_size=4)
    cm.prefill(ids[:, :n])
    keep = kept(cm.held_positions(), n)
    paged = cm.prefill(ids[:, n:], compress=False)
    assert keep.shape[-1] == n and not keep.all()
    with torch.no_grad():
        plain = model(ids).logits
        with masking(model):
            dense = model(ids, kvc_keep=keep).logits[:, n:]  # one pass: the document's queries read it whole
        torch.testing.assert_close(model(ids).logits, plain)  # plain attention again after the block
    torch.testing.assert_close(dense, paged, atol=1e-4, rtol=1e-4, msg=f"seed {seed}, {recipe}")


def test_an_adapter_hooked_equals_it_merged_and_starts_as_the_model(model):
    ids = torch.randint(2, 250, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(ids).logits
        adapter = Adapter(model, rank=4, seed=1)
        with adapter.installed(model):
            torch.testing.assert_close(model(ids).logits, plain)  # B = 0
        for b in adapter.b.values():
            b.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        with adapter.installed(model):
            hooked = model(ids).logits
        merged = adapter.merged(model)
        torch.testing.assert_close(merged(ids).logits, hooked, atol=1e-5, rtol=1e-5)
        assert (hooked - plain).abs().max() > 1e-3
        torch.testing.assert_close(model(ids).logits, plain)  # hooks removed, weights untouched
    again = Adapter.from_tensors(model, adapter.state_dict())
    assert all(torch.equal(again.state_dict()[k], v) for k, v in adapter.state_dict().items())
    with pytest.raises(ValueError, match="do not fit this model"):
        Adapter.from_tensors(tiny_model("llama", layers=3), adapter.state_dict())
    with pytest.raises(ValueError, match="rank must be >= 1"):
        Adapter(model, rank=0)


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    return out, _finetune(model, out)


def _finetune(model, out, seed: int = 0):
    schedule = Schedule(steps=12, batch=2, lr=1e-3, seed=seed, checkpoint_every=6)
    return finetune(model, byte_tokenizer(), name="tiny", recipe="h2o", budget=0.3, schedule=schedule, rank=4,
                    lengths=(192,), per_length=3, held_out=1, continuation=24, out=out, progress=False)


def test_sparse_finetune_lowers_its_loss_and_reproduces_itself(model, trained, tmp_path):
    out, card = trained
    assert card["method"] == "sparse-finetune-h2o" and card["recipe"].startswith("h2o@")
    assert card["final_loss"] < card["initial_loss"]
    assert set(card["held_out_kl"]) == {"trained", "random_init"} and card["tokens_seen"] == 12 * 2 * 24
    first = load_file(str(out / "sparse-finetune-h2o-tiny.safetensors"))
    _finetune(model, tmp_path)
    again = load_file(str(tmp_path / "sparse-finetune-h2o-tiny.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(v.abs().max() > 0 for k, v in first.items() if k.startswith("b."))


def test_a_recipe_with_an_adapter_serves_the_merged_model(model, trained):
    out, card = trained
    path = str(out / "sparse-finetune-h2o-tiny.safetensors")
    h2o = kvcompile.recipes()["h2o"]
    recipe = kvcompile.Recipe("h2o-tuned", "h2o", h2o.allocator, h2o.scorer_args,
                              adapter={"method": "sparse-finetune-h2o", "weights": path, "sha256": card["sha256"]})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = Adapter.from_tensors(model, load_file(path)).merged(model)
    assert_plain_at_full_budget(merged, model, recipe)  # budget 1.0: the adapted model, exactly
    cm = kvcompile.apply(model, budget=0.3, recipe=recipe, page_size=4)
    cm.prefill(torch.randint(2, 250, (1, 120), generator=torch.Generator().manual_seed(3)))
    assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="serves the model with another adapter"):
        kvcompile.apply(cm, budget=0.3, recipe="h2o")
    with pytest.raises(ValueError, match="serves the model with another adapter"):
        cm.fork("h2o")  # the sweep's path: its cell records the error
    with pytest.raises(FileNotFoundError, match="SHA-256"):
        kvcompile.apply(model, budget=0.3, recipe=kvcompile.Recipe("x", "h2o", adapter={**recipe.adapter,
                                                                                         "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="adapter needs 'method' and 'weights'"):
        kvcompile.Recipe("x", "h2o", adapter={"weights": path})


def test_the_train_command_runs_sparse_finetune_with_its_own_defaults(model, tmp_path, monkeypatch, capsys):
    from kvcompile.cli import main as cli

    monkeypatch.setattr(kvcompile, "load_model", lambda name: (model, byte_tokenizer()))
    monkeypatch.setitem(kvcompile.models.REGISTRY, "tiny", None)  # a name the command knows (load_model is patched)
    argv = ["train", "sparse-finetune", "--model", "tiny", "--steps", "2", "--lengths", "128", "--per-length", "2",
            "--held-out", "1", "--continuation", "16", "--rank", "2", "--budget", "0.4", "--out", str(tmp_path)]
    assert cli(argv) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["schedule"]["batch"] == 2 and card["schedule"]["lr"] == 2e-3  # sparse-finetune's, not the scorers'
    assert card["budget"] == 0.4 and card["form"].startswith("lora-rank2")
    assert (tmp_path / "sparse-finetune-h2o-tiny.safetensors").is_file()


@pytest.mark.slow
def test_the_shipped_adapter_runs_by_name_on_smollm2_and_beats_no_adapter():
    from kvcompile.eval.fidelity import prose_windows
    from kvcompile.methods import learned

    adapter = kvcompile.recipes()["sparse-finetune-h2o"].adapter
    _, card = learned.load(adapter["method"], adapter["weights"], adapter["sha256"])
    assert card["model"] == "smollm2-135m" and card["held_out_kl"]["trained"] < card["held_out_kl"]["random_init"]
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=0.25, recipe="sparse-finetune-h2o")
    cm.prefill(torch.tensor([prose_windows(tok, 1, 400)[0]]))
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == "sparse-finetune-h2o@1"
