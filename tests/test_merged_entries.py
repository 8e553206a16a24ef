"""Entries that stand for many tokens (issue 15): GraceKV's prototypes, CORE's memory entries, CaM's merged values,
each against its specification, within the budget, through compile, decode-time schedules and export; and the
fidelity metric of what the merge step recovers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_decode_agrees, assert_plain_at_full_budget, fresh_seed, left_padded_batch
from torch._dynamo.testing import CompileCounterWithBackend

import kvcompile
from kvcompile.eval.fidelity import output_errors
from kvcompile.methods import Observation
from kvcompile.methods.cam import CaM
from kvcompile.methods.core import Core
from kvcompile.methods.decoding import LayerState
from kvcompile.methods.gracekv import GraceKV
from kvcompile.recipes import compose

NEW = ["gracekv", "gracekv-unmerged", "core", "core-unmerged", "cam"]
WEIGHTED = ["gracekv", "core"]


def observation(keys, values, queries, q_pos, log_weights=None, positions=None):
    B, Hkv, S, D = keys.shape
    positions = torch.arange(S).expand(B, Hkv, S) if positions is None else positions
    return Observation(keys, values, positions, torch.ones(B, Hkv, S, dtype=torch.bool), queries, q_pos, D**-0.5, 0,
                       0, 1, log_weights=log_weights)


def test_a_gracekv_prototype_of_n_identical_tokens_attends_exactly_as_they_do():
    """Two slots of 8 tokens, a budget of two entries: each slot keeps its root (the singleton floor). The slot of
    8 identical tokens becomes one entry with their key and value and log-weight log 8, so every query gives it the
    attention of the 8 tokens (the other slot's root is an approximation, not tested here)."""
    torch.manual_seed(0)
    D = 16
    k, v = torch.randn(D), torch.randn(D)
    keys = torch.cat([k.expand(8, D), torch.randn(8, D)])[None, None]
    values = torch.cat([v.expand(8, D), torch.randn(8, D)])[None, None]
    queries, q_pos = torch.randn(1, 2, 4, D), torch.tensor([[16, 17, 18, 19]])
    obs = observation(keys, values, queries, q_pos)
    scores = torch.rand(1, 1, 1, 16)
    kept, pk, pv, pos, lw, counts = GraceKV(slot=8).prototypes([obs], scores, torch.tensor([2]), 1)
    assert not kept.any() and counts.tolist() == [[[2]]]
    torch.testing.assert_close(pk[0, 0, 0, 0], k)
    torch.testing.assert_close(pv[0, 0, 0, 0], v)
    assert lw[0, 0, 0, 0].item() == pytest.approx(math.log(8), abs=1e-6) and pos[0, 0, 0, 0].item() in (3, 4)
    merged = torch.cat([pk[0, :, :, :1], keys[:, :, 8:]], 2)
    weights = torch.cat([lw[0, :, :, :1], torch.zeros(1, 1, 8)], 2)
    got = observation(merged, merged, queries, q_pos, weights, torch.arange(1, 10).expand(1, 1, 9))
    want = observation(keys, values, queries, q_pos).window_attention()
    torch.testing.assert_close(got.window_attention()[..., 0], want[..., :8].sum(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.window_attention()[..., 1:], want[..., 8:], atol=1e-6, rtol=1e-5)


def test_gracekv_spends_more_budget_on_resolution_and_the_control_keeps_its_allocation(llama_cm):
    """More budget, lower output error on the prefill's own window (the greedy lowers the objective it measures);
    ``gracekv-unmerged`` holds exactly as many entries per head as ``gracekv`` (same allocation, no merging)."""
    ids, mask = left_padded_batch([64, 50], total=64)
    lengths = {}
    for recipe in ("gracekv", "gracekv-unmerged"):
        for budget in (0.1, 0.25, 0.5):
            cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
            cm.prefill(ids, mask)
            lengths[recipe, budget] = cm.cache.lengths.clone()
            if recipe == "gracekv-unmerged":
                assert not cm.cache.weights_used
    for budget in (0.1, 0.25, 0.5):
        assert torch.equal(lengths["gracekv", budget], lengths["gracekv-unmerged", budget])
    assert lengths["gracekv", 0.1].sum() < lengths["gracekv", 0.25].sum() < lengths["gracekv", 0.5].sum()


def test_core_memory_is_exact_for_its_reference_query_and_retention_covers_keys():
    """Kept tokens + the memory entries give the reference query (the mean observed query) the full cache's
    attention output exactly; with gamma 0 retention is the top masses, with gamma > 0 a duplicate of a kept key
    loses to a distinct key of a little less mass (the log-det coverage term)."""
    torch.manual_seed(1)
    B, Hkv, S, D = 1, 2, 40, 8
    keys, values = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    q = torch.randn(B, Hkv, 1, D)
    obs = observation(keys, values, q, torch.tensor([[S]]))
    scores = torch.rand(B, Hkv, S)
    core = Core(memory=3)
    kept = core.retain(obs, scores, torch.full((B, Hkv), 10))
    assert kept.sum(-1).tolist() == [[10, 10]]
    mk, mv, mpos, mlw, n = core.memorize(obs, ~kept, scores, torch.full((B, Hkv), 3))
    assert n.tolist() == [[3, 3]] and (mlw != 0).all()
    for h in range(Hkv):
        k_all = torch.cat([keys[0, h][kept[0, h]], mk[0, h]])
        v_all = torch.cat([values[0, h][kept[0, h]], mv[0, h]])
        lw = torch.cat([torch.zeros(10), mlw[0, h]])
        got = torch.softmax(k_all @ q[0, h, 0] * D**-0.5 + lw, 0) @ v_all
        want = torch.softmax(keys[0, h] @ q[0, h, 0] * D**-0.5, 0) @ values[0, h]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unmerged = Core(memory=3, merged=False).memorize(obs, ~kept, scores, torch.full((B, Hkv), 3))
    assert unmerged[-1].sum() == 0

    twin = torch.randn(D)
    keys = torch.stack([twin, twin, torch.randn(D), torch.randn(D)])[None, None]
    obs = observation(keys, keys, q[:, :1], torch.tensor([[4]]))
    mass = torch.tensor([[[0.4, 0.35, 0.2, 0.05]]])
    assert Core(gamma=0.0).retain(obs, mass, torch.tensor([[2]])).tolist() == [[[True, True, False, False]]]
    assert Core(gamma=1.0).retain(obs, mass, torch.tensor([[2]])).tolist() == [[[True, False, True, False]]]


def plain_core_greedy(obs, scores, counts, gamma, delta):
    """CORE's retention greedy written out head by head over every token: the gain of each token not yet kept,
    log pi_j + gamma log(delta (1 + k_j^T (K_S + delta I)^-1 k_j)) with the inverse recomputed, pinned first."""
    from kvcompile.methods.shares import attention_mass

    mass, pinned = attention_mass(scores)
    B, Hkv, S = scores.shape
    unit = torch.nn.functional.normalize(obs.keys.double(), dim=-1)
    kept = torch.zeros(B, Hkv, S, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            chosen = []
            for _ in range(int(counts[b, h])):
                A = delta * torch.eye(unit.shape[-1], dtype=torch.double)
                for j in chosen:
                    A += unit[b, h, j, :, None] * unit[b, h, j]
                x = (unit[b, h] @ torch.linalg.inv(A) * unit[b, h]).sum(-1)
                q = mass[b, h].double().clamp_min(1e-12).log().masked_fill(pinned[b, h], float("inf"))
                gain = (q + gamma * (delta * (1 + x)).log()).masked_fill(scores[b, h] == float("-inf"), -float("inf"))
                gain[chosen] = -float("inf")
                if gain.max() == -float("inf"):
                    break
                chosen.append(int(gain.argmax()))
            kept[b, h, chosen] = True
    return kept


def test_core_retention_picks_what_the_plain_greedy_picks():
    """The greedy over only the tokens whose gain bound can reach the kept set, with Sherman-Morrison updates,
    keeps what the greedy written out keeps (inverse recomputed, every token a candidate): heavy-tailed and flat
    masses, pinned and unheld tokens, heads asked for none or one token."""
    g = torch.Generator().manual_seed(fresh_seed())
    for gamma, delta, spread in ((1.0, 0.1, 3.0), (0.3, 0.5, 0.3), (2.0, 0.05, 1.0), (1.0, 0.1, 0.3)):
        B, Hkv, S, D = 2, 3, 48, 8
        keys = torch.randn(B, Hkv, S, D, generator=g)
        obs = observation(keys, keys, torch.randn(B, Hkv, 1, D, generator=g), torch.full((B, 1), S))
        scores = torch.softmax(spread * torch.randn(B, Hkv, S, generator=g), -1)  # heavy-tailed to flat
        scores[0, 0, :3] = float("inf")  # pinned
        scores[1, 2, 40:] = float("-inf")  # not held
        counts = torch.tensor([[5, 0, 1], [12, 9, 20]])
        got = Core(gamma=gamma, delta=delta).retain(obs, scores, counts)
        assert torch.equal(got, plain_core_greedy(obs, scores, counts, gamma, delta)), (gamma, delta)


def test_cam_merges_into_the_following_kept_tokens_as_specified():
    """merge_budget 1: an evicted token that merges adds its whole value to the next kept token only; its
    probability is A_i / A_next clamped to 1 (here >= 1: always); a zero-attention token never merges; tokens
    past the last kept one have no window."""
    S, D = 6, 4
    values = torch.arange(S * D, dtype=torch.float).reshape(1, 1, S, D)
    kept = torch.tensor([[[True, False, True, False, True, False]]])
    state = LayerState(tokens=torch.tensor([[[1.0, 2.0, 1.0, 0.0, 1.0, 5.0]]]))
    valid = torch.ones(1, 1, S, dtype=torch.bool)
    got = CaM(merge_budget=1).merge(state, values, valid, kept, candidates=3, step=7)
    want = values.clone()
    want[0, 0, 2] += values[0, 0, 1]  # A_1 = 2 >= A_2 = 1: p = 1; token 3 has A = 0: p = 0; token 5: no window
    torch.testing.assert_close(got, want)
    wide = CaM(merge_budget=2).merge(state, values, valid, kept, candidates=3, step=7)
    want = values.clone()
    want[0, 0, 2] += values[0, 0, 1] / 2
    want[0, 0, 4] += values[0, 0, 1] / 2
    torch.testing.assert_close(wide, want)
    assert CaM(merge_budget=1).merge(state, values, valid, kept, candidates=0, step=7) is None


def test_cam_is_seeded_and_keeps_h2o_decode_s_keys(llama_cm):
    """Two CaM runs give the same logits (the draw is seeded); at its first eviction CaM keeps exactly H2O-decode's
    keys and positions (the same schedule and ranking) with merged values, and later stays within the cap."""
    ids, mask = left_padded_batch([64, 50], total=64)
    runs = {}
    for name in ("cam", "cam", "h2o-decode"):
        cm = kvcompile.apply(llama_cm, budget=40, recipe=name, page_size=4)
        cm.prefill(ids, mask)
        cm.decode(torch.full((2, 1), 7))  # the first run comes after the first decode step
        dense = [cm.cache.dense(layer) for layer in range(3)]
        logits = [cm.decode(torch.full((2, 1), 5 + i)) for i in range(20)]
        stats = cm.cache_stats()
        assert stats["bytes_held"] <= stats["budget_bytes"]
        runs.setdefault(name, []).append((dense, torch.stack(logits)))
    (a_dense, a_logits), (b_dense, b_logits) = runs["cam"]
    torch.testing.assert_close(a_logits, b_logits, atol=0, rtol=0)
    h_dense, h_logits = runs["h2o-decode"][0]
    merged = False
    for (ck, cv, cp, cvalid), (hk, hv, hp, hvalid) in zip(a_dense, h_dense):
        assert torch.equal(ck, hk) and torch.equal(cp, hp) and torch.equal(cvalid, hvalid)
        merged |= not torch.equal(cv, hv)
    assert merged, "some values merged at the first run"


@pytest.mark.parametrize("recipe", NEW)
def test_new_recipes_hold_their_budget_with_extra_entries_counted(llama_cm, recipe):
    ids, mask = left_padded_batch([64, 50], total=64)
    for budget in (0.1, 0.25):
        cm = kvcompile.apply(llama_cm, budget=budget if recipe != "cam" else 24, recipe=recipe, page_size=4)
        cm.prefill(ids, mask)
        for _ in range(20 if recipe == "cam" else 0):
            cm.decode(torch.full((2, 1), 5))
        stats = cm.cache_stats()
        assert 0 < stats["bytes_held"] <= stats["budget_bytes"], (recipe, budget)
        pool = stats["formats"]["float32"]
        if recipe in WEIGHTED:
            assert cm.cache.weights_used
            assert pool["weights"] == stats["pages_held"] * 4 * 4 > 0, "the weight channel is counted"
        assert stats["bytes_held"] == pool["codes"] + pool["weights"]


@pytest.mark.parametrize("recipe", WEIGHTED + ["cam"])
def test_full_budget_reproduces_the_model(llama, llama_cm, recipe):
    assert_plain_at_full_budget(llama, llama_cm, recipe)


@pytest.mark.parametrize("recipe", WEIGHTED)
@pytest.mark.slow
def test_weighted_entries_survive_compile_and_a_decode_time_schedule(llama_cm, recipe):
    """Compiled prefill, compression and decode give the eager logits; under a decode-time schedule (the
    ``decoding`` wrapper, every 4 steps) the weighted entries a run keeps keep their log-weights."""
    ids, mask = left_padded_batch([64, 50], total=64)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4, compile=counter)
    eager = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    assert_decode_agrees(compiled, eager, compiled.prefill(ids, mask), eager.prefill(ids, mask), steps=4)
    assert compiled.cache.weights_used

    scheduled = kvcompile.apply(llama_cm, budget=0.25, recipe=compose("decoding", recipe, every=4), page_size=4)
    scheduled.prefill(ids, mask)
    before = {float(x) for layer in range(3) for x in scheduled.cache.log_weights(layer).unique()}
    for _ in range(13):
        scheduled.decode(torch.full((2, 1), 5))
    after = {float(x) for layer in range(3) for x in scheduled.cache.log_weights(layer).unique()}
    assert after <= before and len(after) > 1, "kept weighted entries keep their log-weights"


def test_fidelity_reports_what_the_merge_step_recovers():
    """A constructed cache: 4 identical tokens then 4 others. Evicting the 4 identical ones loses their mass (the
    selection's error > 0); holding them as one entry of log-weight log 4 recovers it all (error 0); eviction
    alone has the same error with and without the merge step."""
    torch.manual_seed(2)
    D = 8
    k, v = torch.randn(D), torch.randn(D)
    keys = torch.cat([k.expand(4, D), torch.randn(4, D)])[None, None]
    values = torch.cat([v.expand(4, D), torch.randn(4, D)])[None, None]
    queries, q_pos = torch.randn(1, 2, 3, D), torch.tensor([[8, 9, 10]])
    full = observation(keys, values, queries, q_pos)
    merged = observation(torch.cat([k[None], keys[0, 0, 4:]])[None, None],
                         torch.cat([v[None], values[0, 0, 4:]])[None, None], None, None,
                         torch.tensor([[[math.log(4)] + [0.0] * 4]]), torch.tensor([[[3, 4, 5, 6, 7]]]))
    mass, selection, compressed = output_errors(full, merged, 8)
    assert mass.item() > 0.01 and selection.item() > 0.01 and compressed.item() < 1e-5
    evicted = observation(keys[:, :, 4:], values[:, :, 4:], None, None, positions=torch.arange(4, 8)[None, None])
    mass, selection, compressed = output_errors(full, evicted, 8)
    assert selection.item() > 0.01
    torch.testing.assert_close(compressed, selection, atol=1e-5, rtol=1e-5)
