"""kvpress's wrapper presses as recipe parts: each against a direct restatement of kvpress's procedure, then composed
by name end to end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import assert_plain_at_full_budget, left_padded_batch
from test_scorers import make_obs

import kvcompile
from kvcompile.methods import ALLOCATORS, SCORERS
from kvcompile.recipes import compose, prefill_decoding


def top(scores, k):
    """Indices a head keeps at k tokens: the engine's stable ranking (ties: earlier entries first)."""
    return set(scores.argsort(descending=True, stable=True)[:k].tolist())


def head_summed(base, obs):
    return SCORERS[base[0]](**base[1]).score(obs).float().sum(1)[0]  # [S] (positions 0..S-1)


def kvpress_chunkkv(s, pinned, chunk, k):
    """ChunkKVPress's chunks by mean score, best first, taken whole; the base's pinned tokens before them (their
    scores left out of the means) and the budget's last chunk cut to its first tokens."""
    means = torch.stack([c.mean() for c in s.masked_fill(pinned, 0).split(chunk)])
    order = pinned.nonzero().flatten().tolist()
    for c in means.argsort(descending=True, stable=True).tolist():
        order += [i for i in range(c * chunk, min((c + 1) * chunk, len(s))) if not pinned[i]]
    return set(order[:k])


def kvpress_entropy_gated(s, chunk, low, budget):
    """EntropyGatedChunkKVPress.compress, restated from the kvpress 0.5.5 source."""
    n = len(s)
    means, ents = [], []
    for c in s.split(chunk):
        means.append(c.mean())
        if len(c) == 1:
            ents.append(torch.tensor(0.0))
            continue
        c = c - c.min().clamp(max=0)
        p = c / (c.sum() + 1e-8)
        ents.append((-(p * (p + 1e-8).log()).sum() / math.log(len(c))).clamp(0, 1))
    means, ents = torch.stack(means), torch.stack(ents)
    high, spiky = means >= means.median(), ents < ents.median()
    keep = set()
    for j in means.argsort(descending=True, stable=True).tolist():
        if budget <= 0:
            break
        start, end = j * chunk, min(n, (j + 1) * chunk)
        take = min(end - start, budget)
        if high[j] and spiky[j]:
            take = min(take, low)
        order = s[start:end].argsort(descending=True, stable=True)[:take]
        keep |= {start + i for i in order.tolist()}
        budget -= take
    rest = [i for i in s.argsort(descending=True, stable=True).tolist() if i not in keep]
    return keep | set(rest[:budget])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("base", [("snapkv", {"window": 8, "kernel": 3}), ("knorm", {})])
def test_chunkkv_keeps_the_best_chunks_whole_in_every_head(seed, base):
    obs = make_obs(S=47, W=8, seed=seed)
    scores = SCORERS["chunkkv"](base=base[0], base_args=base[1], chunk=5).score(obs)[0]
    assert torch.equal(scores[0], scores[1]), "one ranking shared by the heads"
    s = head_summed(base, obs)
    pinned = scores[0] >= torch.finfo(torch.bfloat16).max
    for k in (1, 5, 12, 20, 47):
        assert top(scores[0], k) == kvpress_chunkkv(s, pinned, 5, k), f"seed {seed}, k {k}"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("base", ["knorm", "keydiff"])  # signed scores: the entropy's shift is exercised
def test_entropy_gated_chunkkv_is_kvpress_at_every_budget(seed, base):
    obs = make_obs(S=53, seed=seed)
    scores = SCORERS["entropy-gated-chunkkv"](base=base).score(obs)[0]
    s = head_summed((base, {}), obs)
    for budget in (1, 4, 10, 17, 30, 52, 53):
        assert top(scores[1], budget) == kvpress_entropy_gated(s, 10, 4, budget), f"seed {seed}, budget {budget}"


def test_entropy_gated_on_chunk_constant_scores_picks_chunkkvs_chunks_and_tops_up():
    """Constant scores inside chunks: every chunk has the maximal entropy, none is gated, so the selection is
    ChunkKV's chunks in order and the exact budget."""
    obs = make_obs(S=40, seed=1)
    values = torch.tensor([3.0, 9.0, 1.0, 5.0]).repeat_interleave(10)
    obs = dataclasses.replace(obs, keys=obs.keys[..., :1].abs() * 0 + values[None, None, :, None])
    gated = SCORERS["entropy-gated-chunkkv"](base="knorm").score(obs)[0, 0]
    chunked = SCORERS["chunkkv"](base="knorm", chunk=10).score(obs)[0, 0]
    for k in (10, 15, 20, 33):
        assert top(gated, k) == top(chunked, k)


@pytest.mark.parametrize("seed", range(3))
def test_chunk_press_scores_each_chunk_alone_and_keeps_an_equal_share(seed):
    obs = make_obs(S=48, seed=seed)
    scores = SCORERS["chunk"](base="snapkv", base_args={"window": 4, "kernel": 1}, chunk=16).score(obs)[0]
    for j in range(3):  # the base on the chunk alone: its keys, its last 4 queries
        span = slice(16 * j, 16 * (j + 1))
        alone = make_obs(S=16, W=4, keys=obs.keys[:, :, span], values=obs.values[:, :, span],
                         queries=obs.queries[:, :, 16 * j + 12: 16 * (j + 1)])
        ref = SCORERS["snapkv"](window=4, kernel=1).score(alone)[0]
        for h in range(2):
            for k in (2, 7, 11):
                assert top(scores[h, span], k) == top(ref[h], k), f"seed {seed}, chunk {j}, head {h}, k {k}"
    for k in (6, 18, 30):  # an equal share per chunk (each chunk's own pins, snapkv's window, first in it)
        kept = torch.tensor(sorted(top(scores[0], k)))
        assert (torch.bincount(kept // 16, minlength=3) == k // 3).all(), f"k {k}"
        if k <= 12:
            assert all(int(i) % 16 >= 12 for i in kept), "the pins of each chunk come first in it"


@pytest.mark.parametrize("seed", range(4))
def test_composed_is_the_second_press_on_what_the_first_kept(seed):
    """kvpress's ComposedPress([KnormPress(0.5), SnapKVPress(r)]): SnapKV over KNorm's survivors only."""
    obs = make_obs(S=40, W=8, seed=seed)
    snap = {"window": 4, "kernel": 3}
    scores = SCORERS["composed"](base="snapkv", base_args=snap, first="knorm", keep=0.5).score(obs)[0]
    first = SCORERS["knorm"]().score(obs)[0]
    for h in range(2):
        survivors = top(first[h], 20)
        survive = torch.isin(torch.arange(40), torch.tensor(sorted(survivors)))
        alone = dataclasses.replace(obs, valid=obs.valid & survive)
        then = SCORERS["snapkv"](**snap).score(alone)[0, h].masked_fill(~alone.valid[0, h], float("-inf"))
        for k in (1, 5, 12, 20):
            assert top(scores[h], k) == top(then, k), f"seed {seed}, head {h}, k {k}"
        assert top(scores[h], 30) == survivors | (top(first[h], 30) - survivors), "then the first press's order"


def test_per_layer_spends_the_budget_in_kvpress_proportions():
    alloc = ALLOCATORS["per-layer"](compression_ratios=[0.0, 0.5, 0.75])
    lengths = torch.full((3, 1, 2), 100)
    counts = alloc.allocate(None, lengths, torch.tensor([6 * 100 * 7 // 12]))  # the mean keep fraction, 7/12
    assert counts[:, 0, 0].tolist() == [100, 50, 25] and int(counts.sum()) <= 350
    assert (alloc.allocate(None, lengths, torch.tensor([60])) <= lengths).all()


def test_per_layer_without_ratios_for_every_layer_is_refused_at_apply(llama):
    with pytest.raises(ValueError, match="2 compression_ratios for a model with 3 layers"):
        kvcompile.apply(llama, budget=0.25, recipe=compose("per-layer", "snapkv", compression_ratios=[0.5, 0.5]))
    with pytest.raises(ValueError, match="compose\\('per-layer'"):
        kvcompile.apply(llama, budget=0.25, recipe="per-layer+snapkv")
    cm = kvcompile.apply(llama, budget=0.25, recipe=compose("per-layer", "snapkv", compression_ratios=[0, 0.5, 0.9]))
    cm.prefill(left_padded_batch([64], total=64)[0])
    held = cm.cache.lengths[:, 0, 0].tolist()
    assert held[0] > held[1] > held[2] and cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]


def test_compositions_by_name_version_and_errors():
    r = kvcompile.get_recipe("chunkkv+adakv-snapkv")
    assert (r.scorer, r.allocator, r.scorer_args["base"], r.version) == ("chunkkv", "adakv", "snapkv", 4)
    assert r.tag == "chunkkv+adakv-snapkv@4" and r.fingerprint != kvcompile.get_recipe("adakv-snapkv").fingerprint
    assert kvcompile.get_recipe("decoding+knorm").decode["args"]["scorer"] == "knorm"
    both = prefill_decoding("snapkv", "decoding+knorm")
    assert (both.scorer, both.decode["args"]["scorer"], both.decode["every"]) == ("snapkv", "knorm", 512)
    with pytest.raises(ValueError, match="does not compress while decoding"):
        prefill_decoding("snapkv", "knorm")
    with pytest.raises(ValueError, match="unknown wrapper 'snapkv' \\(a recipe, not a wrapper"):
        kvcompile.get_recipe("snapkv+knorm")
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        kvcompile.get_recipe("chunkkv+nope")
    with pytest.raises(ValueError, match="composed: first must be a registered scorer"):
        kvcompile.get_recipe("composed+snapkv").build()  # what apply calls first
    with pytest.raises(ValueError, match="needs a recipe that evicts"):
        kvcompile.get_recipe("chunkkv+full")
    for recipe in kvcompile.recipes().values():  # a wrapper takes every recipe that evicts, whatever its evidence
        if recipe.scorer is not None:  # the weaker evidence of the two (chunkkv: a peer's code)
            weaker = "peer" if recipe.provenance in ("official-code", "paper") else recipe.provenance
            assert kvcompile.get_recipe(f"chunkkv+{recipe.name}").provenance == weaker, recipe.name


COMPOSED = ["chunkkv+snapkv", "entropy-gated-chunkkv+snapkv", "chunk+snapkv", "block+keydiff", "decoding+knorm",
            "chunkkv+adakv-snapkv", "adakv+knorm", "key-rerotation+knorm", "merging+snapkv",
            compose("composed", "snapkv", first="knorm", keep=0.5)]


@pytest.mark.parametrize("recipe", COMPOSED)
def test_composed_recipe_holds_its_budget_and_generates(llama_cm, recipe):
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    context, mask = left_padded_batch([150, 120], total=150, seed=4)
    question, _ = left_padded_batch([5, 5], total=5, seed=1)
    cm.prefill(context, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["recipe"] == cm.recipe.tag
    out = cm.generate(question, context_ids=context, context_mask=mask, max_new_tokens=4, eos_token_id=[])
    assert out.shape == (2, 9)


@pytest.mark.parametrize("recipe", COMPOSED)
def test_composed_recipe_at_full_budget_is_the_plain_model(llama, llama_cm, recipe):
    assert_plain_at_full_budget(llama, llama_cm, recipe)


def test_block_is_chunked_prefill_of_128_tokens(llama_cm):
    ids, mask = left_padded_batch([300], total=300, seed=5)
    block = kvcompile.apply(llama_cm, budget=0.25, recipe="block+keydiff")
    plain = kvcompile.apply(llama_cm, budget=0.25, recipe="keydiff", prefill_chunk=128)
    assert block.prefill_chunk == 128
    assert torch.equal(block.prefill(ids, mask, logits="last"), plain.prefill(ids, mask, logits="last"))
    assert block.cache_stats()["tokens_held"] == plain.cache_stats()["tokens_held"]
    shared = kvcompile.apply(llama_cm, budget=1.0, recipe="full")
    assert shared.fork("block+keydiff").prefill_chunk == 128, "an empty fork takes the recipe's chunking"
    shared.prefill(ids, mask, compress=False)
    with pytest.raises(ValueError, match="a shared prefill cannot stand in for it"):
        shared.fork("block+keydiff")  # a sweep's shared, unchunked prefill: the cell must not silently reuse it


def test_decoding_keeps_the_cap_and_rescores_from_decode_queries_only(llama_cm):
    cap = 48
    cm = kvcompile.apply(llama_cm, budget=cap, recipe=compose("decoding", "snapkv", every=16))
    ids, mask = left_padded_batch([40], total=40, seed=6)
    token = cm.prefill(ids, mask, logits="last")[:, -1].argmax(-1, keepdim=True)
    assert cm.cache_stats()["tokens_held"] == 40 * 3 * 2, "a prompt under the cap is not compressed"
    for step in range(80):
        token = cm.decode(token)[:, -1].argmax(-1, keepdim=True)
        assert int(cm.cache.lengths.max()) <= cap, f"step {step}"
    assert int(cm.cache.lengths.max()) < 120
