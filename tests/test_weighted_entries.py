"""Weighted entries (``kvcompile.cache.weights``): an entry of log-weight log n attends exactly as n tokens with its
key and value, in prefill and decode attention; CertKV's summary is one; the weight channel is counted in the bytes,
moves with its entries, is absent from every other recipe's cache, and survives ``torch.compile``."""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import assert_decode_agrees, left_padded_batch, merged_and_repeated
from torch._dynamo.testing import CompileCounterWithBackend

import kvcompile
from kvcompile.kernels import reference
from kvcompile.methods import Observation


@pytest.fixture
def seed():
    seed = int(os.environ.get("KVC_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    return seed


@pytest.mark.parametrize("T, window", [(1, 0), (1, 16), (3, 0), (3, 16)],
                         ids=["decode", "decode-window", "prefill", "prefill-window"])
def test_an_entry_of_log_weight_log_n_attends_as_n_tokens(seed, T, window):
    """Reference attention (the decode step's paths and the prefill's blocked one, causal and sliding-window) over
    entries of weights 1..4 equals attention over the same entries repeated, as plain tokens; with every weight 1
    the weighted path gives the unweighted one's output. Three cases a run: on some, a sliding window leaves each
    head one visible entry (or only weight-1 ones), where weights cannot matter; on at least one they must."""
    matter = []
    for case in range(seed, seed + 3):
        torch.manual_seed(case)
        merged, repeated = merged_and_repeated(B=2, Hkv=2, D=16, P=4, seed=case)
        q = torch.randn(2, 4, T, 16)
        decode_at = torch.full((2, 1), 45 if window == 0 else 35)
        q_pos = torch.randint(20, 50, (2, T)).sort(-1).values if T > 1 else decode_at
        (k, v, pos, lw, table, lengths), plain = merged, repeated
        got = reference.paged_attention(q, q_pos, k, v, pos, table, lengths, 0.3, window, log_weights=lw)
        want = reference.paged_attention(q, q_pos, *plain[:3], *plain[4:], 0.3, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{m}\nseed={case}")
        unweighted = reference.paged_attention(q, q_pos, k, v, pos, table, lengths, 0.3, window)
        matter.append(not torch.allclose(unweighted, want, atol=1e-3))
        ones = reference.paged_attention(q, q_pos, k, v, pos, table, lengths, 0.3, window, log_weights=lw * 0)
        torch.testing.assert_close(ones, unweighted, atol=1e-6, rtol=1e-6, msg=lambda m: f"weight 1: {m}\nseed={case}")
    assert any(matter), f"the weights matter in none of seeds {seed}..{seed + 2}"


@pytest.mark.parametrize("T", [1, 3], ids=["decode", "prefill"])
def test_log_weights_stay_fp32_in_a_bf16_model(seed, T):
    """Over bf16 pages, reference attention adds the log-weights in fp32: large ones are not rounded to bf16's
    spacing (1/16 at 8), which would misstate an entry's mass by several percent."""
    (k, v, pos, lw, table, lengths), _ = merged_and_repeated(seed=seed)
    lw = lw + torch.rand_like(lw) * 8
    q, q_pos = torch.randn(2, 4, T, 16).bfloat16(), torch.full((2, T), 45)
    k, v = k.bfloat16(), v.bfloat16()
    got = reference.paged_attention(q, q_pos, k, v, pos, table, lengths, 0.3, log_weights=lw)
    want = reference.paged_attention(q.float(), q_pos, k.float(), v.float(), pos, table, lengths, 0.3, log_weights=lw)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2, msg=lambda m: f"{m}\nseed={seed}")


def test_scorers_see_an_entry_of_weight_n_draw_the_attention_of_n_tokens(seed):
    """``Observation.window_attention`` (what the scorers read) over a weighted entry equals the attention its
    repeated tokens draw together, and leaves the other entries' attention as it was."""
    B, Hkv, G, S, W, D = 1, 2, 2, 6, 3, 8
    keys, values, n = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D), torch.randint(1, 5, (S,))
    # after every key even when repeated (up to 4 * S positions), so both sides see every key
    queries, q_pos = torch.randn(B, Hkv * G, W, D), torch.arange(4 * S, 4 * S + W)[None]

    def observation(k, v, log_weights=None):
        S = k.shape[2]
        positions, valid = torch.arange(S).expand(B, Hkv, S), torch.ones(B, Hkv, S, dtype=torch.bool)
        return Observation(k, v, positions, valid, queries, q_pos, D**-0.5, 0, 0, 1, log_weights=log_weights)

    merged = observation(keys, values, n.float().log().expand(B, Hkv, S)).window_attention()
    repeated = observation(keys.repeat_interleave(n, 2), values.repeat_interleave(n, 2)).window_attention()
    summed = torch.zeros_like(merged).index_add_(-1, torch.arange(S).repeat_interleave(n), repeated)
    torch.testing.assert_close(merged, summed, atol=1e-6, rtol=1e-5, msg=lambda m: f"{m}\nseed={seed}")


def _certkv(llama_cm, **kwargs):
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="certkv", page_size=4, **kwargs)
    ids, mask = left_padded_batch([64, 50], total=64)
    return cm, cm.prefill(ids, mask)


def test_certkv_pays_for_its_weight_channel_within_the_budget_and_other_recipes_have_none(llama_cm):
    cm, _ = _certkv(llama_cm)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    pool = stats["formats"]["float32"]
    assert pool["weights"] == stats["pages_held"] * 4 * 4 > 0, "4 bytes of log-weight per held row"
    assert stats["bytes_held"] == pool["codes"] + pool["weights"]
    summaries = sum(int((cm.cache.log_weights(layer) != 0).sum()) for layer in range(3))
    assert 0 < summaries <= 3 * 2 * 2, "one weighted entry per head that evicts, at most"
    for _ in range(4):  # decoded tokens are plain ones: weight 1
        cm.decode(torch.full((2, 1), 5))
    assert sum(int((cm.cache.log_weights(layer) != 0).sum()) for layer in range(3)) == summaries
    snapkv = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv", page_size=4)
    snapkv.prefill(*left_padded_batch([64, 50], total=64))
    assert snapkv.cache_stats()["formats"]["float32"]["weights"] == 0 and snapkv.cache.page_lw.numel() == 0


def test_a_fork_keeps_weighted_entries_only_for_a_recipe_that_writes_them(llama_cm):
    cm, _ = _certkv(llama_cm)
    with pytest.raises(ValueError, match="holds weighted entries; a recipe without them must prefill on its own"):
        cm.fork("snapkv")
    assert cm.fork("certkv", budget=0.2).cache.weights_used
    shared = kvcompile.apply(llama_cm, budget=1.0, recipe="snapkv", page_size=4)
    shared.prefill(*left_padded_batch([64, 50], total=64), compress=False)
    child = shared.fork("certkv", budget=0.25)
    child.compress()
    assert child.cache.weights_used and not shared.cache.weighted


def test_weighted_entries_survive_compile(llama_cm):
    """CertKV compiled (prefill, compression, decode) gives the eager logits; the weight channel's size is dynamic,
    so the decode compiles once over growing pools."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled, a = _certkv(llama_cm, compile=counter)
    eager, b = _certkv(llama_cm)
    assert_decode_agrees(compiled, eager, a, b, steps=6)
    assert compiled.cache.weights_used
    assert counter.frame_count == 2, "one prefill and one decode compilation"
