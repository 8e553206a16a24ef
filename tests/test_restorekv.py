"""RestoreKV (issue 17): restore entries written by one adapted pass over the whole cache are ordinary entries, kept
first and charged to the budget; the paged path equals the dense masked pass training runs, on fresh random
weights; with the adapter at zero and token embeddings, the entries are those tokens' own; training lowers the loss
and its weights round-trip and run by path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_plain_at_full_budget, byte_llama, byte_tokenizer, tiny_model
from safetensors.torch import load_file

import kvcompile
from kvcompile.eval.analysis.masked import kept, masking
from kvcompile.methods import learned
from kvcompile.train.loop import Schedule
from kvcompile.train.restorekv import Restorer, finetune, recipe_with


def random_weights(model, path, seed: int, tokens: int = 8, zero_adapter: bool = False):
    """A restorekv weights file of random embeddings and (unless ``zero_adapter``) a random non-zero adapter; the
    Restorer that holds them."""
    restorer = Restorer(model, tokens=tokens, rank=4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        restorer.embeddings.normal_(0, 1.0, generator=g)
        for b in restorer.adapter.b.values():
            b.normal_(0, 0.0 if zero_adapter else 0.1, generator=g)
    learned.save(path, restorer.state_dict(), {"method": "restorekv"})
    return restorer


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", ["byte-llama", "gemma3"])  # gemma3: a sliding-window layer
def test_the_paged_path_is_the_masked_pass_training_runs(tmp_path, seed, family):
    model = byte_llama() if family == "byte-llama" else tiny_model("gemma3")
    restorer = random_weights(model, tmp_path / "w.safetensors", seed)
    g = torch.Generator().manual_seed(100 + seed)
    n, m = int(torch.randint(80, 160, (1,), generator=g)), 20
    ids = torch.randint(2, model.config.vocab_size - 1, (1, n + m), generator=g)
    cm = kvcompile.apply(model, budget=0.3, recipe=recipe_with(tmp_path / "w.safetensors"), page_size=4)
    cm.prefill(ids[:, :n])
    held = cm.held_positions()
    restored = (held >= n) & (held < n + 8)
    assert bool((restored.sum(-1) == 8).all()), f"seed {seed}: every (layer, KV head) holds the 8 restore entries"
    assert int(cm.seen) == n + 8  # the question reads at n + 8
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"], f"seed {seed}: {stats['bytes_held']} > {stats['budget_bytes']}"
    paged = cm.prefill(ids[:, n:], compress=False)[0]
    keep = kept(held, n)
    assert not keep.all()
    with torch.no_grad():
        dense = restorer(model, ids, keep)
    torch.testing.assert_close(dense, paged, atol=1e-4, rtol=1e-4, msg=f"seed {seed}")
    with torch.no_grad():  # the adapter matters: without it the restore entries differ
        restorer.adapter.b.requires_grad_(False)
        for b in restorer.adapter.b.values():
            b.zero_()
        assert (restorer(model, ids, keep) - paged).abs().max() > 1e-3


def test_with_the_adapter_at_zero_restore_entries_are_the_tokens_own(tmp_path):
    """Embeddings of real tokens and no adapter: the cache then reads as if those tokens were prefilled after the
    context (compared with the full cache at a budget that keeps everything)."""
    model = byte_llama()
    restorer = random_weights(model, tmp_path / "w.safetensors", 3, zero_adapter=True)
    g = torch.Generator().manual_seed(7)
    n, m = 60, 12
    ids = torch.randint(2, 257, (1, n + m), generator=g)
    tokens = torch.randint(2, 257, (8,), generator=g)
    with torch.no_grad():
        restorer.embeddings.copy_(model.get_input_embeddings()(tokens))
    learned.save(tmp_path / "w.safetensors", restorer.state_dict(), {"method": "restorekv"})
    cm = kvcompile.apply(model, budget=0.999, recipe=recipe_with(tmp_path / "w.safetensors"), page_size=1)
    cm.prefill(ids[:, :n])
    assert cm.cache_stats()["tokens_held"] == int(0.999 * n * 2 * 2)  # the budget, restore entries (8 a head) in it
    full = kvcompile.apply(model, budget=1.0, recipe="full")
    plain = full.prefill(torch.cat([ids[:, :n], tokens[None], ids[:, n:]], 1))[:, n + 8 :]
    keep = kept(cm.held_positions(), n)
    with torch.no_grad(), masking(model):
        masked = model(torch.cat([ids[:, :n], tokens[None], ids[:, n:]], 1),
                       kvc_keep=torch.cat([keep, keep.new_ones(2, 2, 8)], -1)).logits[:, n + 8 :]
    torch.testing.assert_close(cm.prefill(ids[:, n:], compress=False), masked, atol=1e-4, rtol=1e-4)
    assert (masked - plain).abs().max() > 0  # something was evicted, and the reference saw it


def test_budget_one_is_the_model_and_a_budget_without_room_is_refused(tmp_path):
    model = byte_llama()
    random_weights(model, tmp_path / "w.safetensors", 4)
    recipe = recipe_with(tmp_path / "w.safetensors")
    assert_plain_at_full_budget(model, kvcompile.apply(model, budget=1.0, recipe="full"), recipe)
    cm = kvcompile.apply(model, budget=0.05, recipe=recipe, page_size=16)
    ids = torch.randint(2, 257, (1, 100), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="restore entries in every"):
        cm.prefill(ids)
    assert cm.seen is None  # nothing was read
    with pytest.raises(ValueError, match="restore entries in every"):
        cm.generate(ids[:, :8], context_ids=ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="not with prefill_chunk"):
        kvcompile.apply(model, budget=0.5, recipe=recipe, prefill_chunk=32)
    with pytest.raises(FileNotFoundError, match="kvcompile train restorekv"):
        kvcompile.apply(model, budget=0.5, recipe=recipe_with(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="trained for 2 layers, hidden size 64"):  # another model's shape
        kvcompile.apply(tiny_model("llama", layers=3), budget=0.5, recipe=recipe)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_near_the_smallest_budget_page_rounding_never_cuts_a_restore_entry(tmp_path, seed):
    """A page in each of the 4 (layer, KV head) pairs is the least a budget must hold; just above it, KVzip's counts
    overflow the pages and are fitted again, the restore entries kept whole."""
    model = byte_llama()
    random_weights(model, tmp_path / "w.safetensors", seed)
    g = torch.Generator().manual_seed(20 + seed)
    n = int(torch.randint(380, 420, (1,), generator=g))
    tokens = int(torch.randint(64, 100, (1,), generator=g))  # of the n * 4 the context fills
    cm = kvcompile.apply(model, budget=tokens / (n * 4), recipe=recipe_with(tmp_path / "w.safetensors"))
    cm.prefill(torch.randint(2, 257, (1, n), generator=g))
    held, stats = cm.held_positions(), cm.cache_stats()
    assert bool((((held >= n) & (held < n + 8)).sum(-1) == 8).all()), f"seed {seed}, {tokens} tokens"
    assert stats["bytes_held"] <= stats["budget_bytes"], f"seed {seed}"


def test_a_floor_refits_the_counts_instead_of_emptying_a_head():
    """One head scores every token above the others: KVzip's counts then leave page rounding nothing to cut but the
    other heads' restore pages; with the floor, the allocator is asked again for fewer tokens instead."""
    from kvcompile.cache import PagedKVCache
    from kvcompile.compress import token_counts
    from kvcompile.methods.kvzip import GlobalTopK

    cache = PagedKVCache(1, 4, 4, 8, page_size=16)
    scores = torch.zeros(1, 1, 4, 64)
    scores[0, 0, 0] = 1.0 + torch.rand(64, generator=torch.Generator().manual_seed(0))
    scores[..., 56:] = torch.finfo(torch.float32).max  # the restore entries, as compress ranks them
    lengths, floor = torch.full((1, 1, 4), 64), torch.full((1, 1, 4), 8)
    budget = torch.tensor([70 * cache.token_bytes])  # 4 pages
    counts = token_counts(cache, GlobalTopK(), scores, (), budget, lengths, floor)
    assert counts.flatten().tolist() == [16, 8, 8, 8]
    assert token_counts(cache, GlobalTopK(), scores, (), budget, lengths).flatten().min() == 0  # without: emptied


def test_a_left_padded_batch_restores_each_row_as_alone(tmp_path):
    model = byte_llama()
    random_weights(model, tmp_path / "w.safetensors", 5)
    cm = kvcompile.apply(model, budget=0.4, recipe=recipe_with(tmp_path / "w.safetensors"), page_size=4)
    g = torch.Generator().manual_seed(9)
    rows = [torch.randint(2, 257, (n,), generator=g) for n in (90, 64)]
    ids = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros(2, 90, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 90 - len(r):], mask[i, 90 - len(r):] = r, 1
    q = torch.randint(2, 257, (2, 6), generator=g)
    out = cm.generate(q, context_ids=ids, context_mask=mask, max_new_tokens=5)
    for i, r in enumerate(rows):
        alone = cm.generate(q[i : i + 1], context_ids=r[None], max_new_tokens=5)
        assert torch.equal(out[i : i + 1], alone), f"row {i}"


def test_a_fork_restores_as_a_separate_run_does(tmp_path):
    """What a sweep cell does (fork a shared prefill, then compress) equals applying the recipe alone."""
    model = byte_llama()
    random_weights(model, tmp_path / "w.safetensors", 6)
    recipe = recipe_with(tmp_path / "w.safetensors")
    ids = torch.randint(2, 257, (1, 130), generator=torch.Generator().manual_seed(11))
    base = kvcompile.apply(model, budget=1.0, recipe=recipe, page_size=4)  # a window for the reconstruction
    base.prefill(ids, compress=False, logits="last")
    fork = base.fork(recipe, 0.3)
    fork.compress()
    alone = kvcompile.apply(model, budget=0.3, recipe=recipe, page_size=4)
    alone.prefill(ids, logits="last")
    assert torch.equal(fork.held_positions(), alone.held_positions())
    q = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(fork.prefill(q, compress=False), alone.prefill(q, compress=False))
    assert int(base.cache.lengths.min()) == 130 and int(base.seen) == 130  # the shared prefill is untouched


def _train(model, out):
    return finetune(model, byte_tokenizer(), name="tiny", budgets=(0.3,), schedule=Schedule(steps=6, batch=3, lr=2e-2),
                    rank=4, lengths=(160,), per_length=3, held_out=1, continuation=16, out=out, progress=False)


@pytest.mark.slow
def test_training_lowers_the_loss_reproduces_itself_and_its_weights_run_by_path(tmp_path):
    model = byte_llama()
    card = _train(model, tmp_path)
    losses = json.loads((tmp_path / "runs" / "restorekv-tiny-seed0" / "checkpoint.json").read_text())["losses"]
    assert losses[-1] < losses[0], losses  # full batches: the same loss, step after step
    assert set(card["held_out_kl"]["0.3"]) == {"trained", "random_init", "kvzip"}
    assert card["form"].startswith("restore8-lora-rank4")
    first = load_file(str(tmp_path / "restorekv-tiny.safetensors"))
    _train(model, tmp_path / "again")  # the same seed, from scratch: the same weights, bitwise
    again = load_file(str(tmp_path / "again" / "restorekv-tiny.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["embeddings"], Restorer(model, rank=4).state_dict()["embeddings"])  # it moved
    cm = kvcompile.apply(model, budget=0.3, recipe=recipe_with(tmp_path / "restorekv-tiny.safetensors"), page_size=4)
    ids = torch.randint(2, 257, (1, 120), generator=torch.Generator().manual_seed(1))
    assert cm.generate(ids[:, :4], context_ids=ids, max_new_tokens=3).shape == (1, 7)


@pytest.mark.slow
def test_the_shipped_weights_beat_their_initial_state_and_run_by_name_on_smollm2():
    from kvcompile.eval.fidelity import prose_windows

    args = kvcompile.recipes()["restorekv"].scorer_args
    card = learned.load("restorekv", args["weights"], args["sha256"])[1]
    for kl in card["held_out_kl"].values():
        assert kl["trained"] < kl["random_init"]
    model, tok = kvcompile.load_model("smollm2-135m")
    cm = kvcompile.apply(model, budget=0.1, recipe="restorekv")
    ids = torch.tensor([prose_windows(tok, 1, 600)[0]])
    cm.prefill(ids)
    stats, held = cm.cache_stats(), cm.held_positions()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == "restorekv@1"
    assert bool((((held >= ids.shape[1]) & (held < ids.shape[1] + 8)).sum(-1) == 8).all())
