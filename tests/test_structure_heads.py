"""DuoAttention and SimLayerKV (docs/methods_allocators.md#heads-that-stream): heads and layers judged local by their
structure keep exactly their sinks and recent tokens, and the budget they leave goes to the others. The statistics
against plain loops on random inputs; the kept positions end to end on a tiny llama."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_plain_at_full_budget, left_padded_batch
from test_scorers import make_obs

import kvcompile
from kvcompile.calibration.duoattention import calibrate
from kvcompile.methods import ALLOCATORS
from kvcompile.methods.duoattention import streaming_error
from kvcompile.methods.simlayerkv import lazy_mass
from kvcompile.methods.streaming_heads import RULED_OUT
from kvcompile.recipes import Recipe

SINKS, RECENT = 4, 8


def held(cm, layer: int, row: int, head: int) -> set[int]:
    _, _, pos, valid = cm.cache.dense(layer)
    return set(pos[row, head][valid[row, head]].tolist())


def window(n: int) -> set[int]:
    return set(range(SINKS)) | set(range(n - RECENT, n))


def reference_outputs(obs, sinks, recent):
    """Per query head and observed query: (full output, streaming output), written out one query at a time."""
    G = obs.queries.shape[1] // obs.keys.shape[1]
    out = {}
    for h in range(obs.queries.shape[1]):
        k, v = obs.keys[0, h // G], obs.values[0, h // G]
        for w, qp in enumerate(obs.query_positions[0].tolist()):
            seen = [s for s in range(k.shape[0]) if obs.positions[0, h // G, s] <= qp]
            pos = obs.positions[0, h // G]
            local = [s for s in seen if pos[s] < sinks or qp - pos[s] < recent]
            outputs = []
            for keep in (seen, local):
                attn = torch.softmax(k[keep] @ obs.queries[0, h, w] * obs.scale, 0)
                outputs.append(attn @ v[keep])
            out[h, w] = outputs
    return out


def test_streaming_error_is_the_relative_output_change_of_the_streaming_mask():
    seed = random.randrange(1 << 30)
    obs = make_obs(S=24, W=10, seed=seed)
    ref = reference_outputs(obs, 2, 5)
    for kv in range(2):
        num = sum((f - s).square().sum() for (h, _), (f, s) in ref.items() if h // 2 == kv)
        den = sum(f.square().sum() for (h, _), (f, s) in ref.items() if h // 2 == kv)
        assert torch.allclose(streaming_error(obs, 2, 5)[0, kv], num / den, rtol=1e-4), f"seed {seed}"
    assert torch.equal(streaming_error(obs, 2, 24), torch.zeros(1, 2)), "a window covering everything loses nothing"


def test_lazy_mass_is_the_last_queries_attention_on_sinks_and_recent():
    seed = random.randrange(1 << 30)
    obs = make_obs(S=30, W=6, seed=seed)
    G, S = 2, 30
    total = 0.0
    for h in range(4):
        for w in (4, 5):  # the last two queries: positions 28, 29
            qp = int(obs.query_positions[0, w])
            keys = obs.keys[0, h // G, : qp + 1]
            attn = torch.softmax(keys @ obs.queries[0, h, w] * obs.scale, 0)
            total += sum(attn[p] for p in range(qp + 1) if p < 3 or p > S - 1 - 7)
    assert torch.allclose(lazy_mass(obs, 2, 3, 7)[0], total / 8, rtol=1e-5), f"seed {seed}"


def test_a_layer_whose_last_query_looks_at_its_sinks_and_recent_is_lazy():
    obs = make_obs(S=40, W=1, D=16, seed=1)
    obs.keys = torch.nn.functional.normalize(obs.keys, dim=-1)
    sinks_and_recent = obs.keys[:, :, [0, 38]].sum(2).repeat_interleave(2, 1)  # [B, Hq, D]
    obs.queries = 40 * sinks_and_recent[:, :, None]
    assert lazy_mass(obs, 1, SINKS, RECENT) > 0.9
    obs.queries = 40 * obs.keys[:, :, 20].repeat_interleave(2, 1)[:, :, None]  # the middle of the context
    assert lazy_mass(obs, 1, SINKS, RECENT) < 0.5


def test_fill_eligible_gives_equal_shares_up_to_each_heads_eligible_tokens():
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 2, 4, 20, generator=gen)
    scores[torch.rand(scores.shape, generator=gen) < 0.5] = RULED_OUT
    lengths = torch.randint(5, 21, (3, 2, 4), generator=gen)
    scores[torch.arange(20).expand_as(scores) >= lengths[..., None]] = float("-inf")
    budget = torch.randint(1, 200, (2,), generator=gen)
    counts = ALLOCATORS["fill-eligible"]().allocate(scores, lengths, budget)
    caps = (scores > RULED_OUT).sum(-1)
    for b in range(2):
        c, cap = counts[:, b].flatten(), caps[:, b].flatten()
        assert (c <= cap).all() and int(c.sum()) == min(int(budget[b]), int(cap.sum())), f"seed {seed}"
        free = c < cap  # a head below its cap is at the common level: no other head holds more than one above it
        assert not free.any() or int(c.max()) <= int(c[free].min()) + 1, f"seed {seed}: {c.tolist()} {cap.tolist()}"


def simlayer(tau: float) -> Recipe:
    return Recipe("simlayer-test", "simlayerkv", "fill-eligible", {"tau": tau, "sinks": SINKS, "recent": RECENT})


def test_lazy_layers_hold_exactly_sinks_and_recent_and_no_laziness_is_the_base(llama_cm):
    ids, mask = left_padded_batch([60, 45], total=60, seed=4)
    lazy = kvcompile.apply(llama_cm, budget=0.5, recipe=simlayer(-1.0), page_size=4)  # every layer lazy
    lazy.prefill(ids, mask)
    for layer in range(3):
        for row, n in enumerate((60, 45)):
            for head in range(2):
                assert held(lazy, layer, row, head) == window(n), (layer, row, head)
    never = kvcompile.apply(llama_cm, budget=16, recipe=simlayer(2.0), page_size=4)
    snap = kvcompile.apply(llama_cm, budget=16, recipe="snapkv", page_size=4)
    never.prefill(ids, mask), snap.prefill(ids, mask)
    for layer in range(3):
        assert torch.equal(never.cache.dense(layer)[2], snap.cache.dense(layer)[2]), layer


def test_streaming_heads_hold_exactly_sinks_and_recent_and_retrieval_heads_get_the_rest(llama_cm):
    scores = [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]  # (0, 0) and (1, 1) stream
    recipe = Recipe("duo-test", "duoattention", "fill-eligible",
                    {"head_scores": scores, "streaming": 1 / 3, "sinks": SINKS, "recent": RECENT})
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([60, 45], total=60, seed=5)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    for row, n in enumerate((60, 45)):
        for layer, head in ((0, 0), (1, 1)):
            assert held(cm, layer, row, head) == window(n), (layer, row, head)
            assert stats["lengths"][layer][row][head] == len(window(n))
        retrieval = [stats["lengths"][layer][row][head] for layer, head in ((0, 1), (1, 0), (2, 0), (2, 1))]
        assert min(retrieval) > n // 2, "the budget streaming heads leave goes to the retrieval heads"


def test_uncalibrated_each_layer_streams_its_most_local_half(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.4, recipe=Recipe("duo-prompt", "duoattention", "fill-eligible",
                                                             {"sinks": SINKS, "recent": RECENT}), page_size=4)
    ids, mask = left_padded_batch([60], total=60, seed=6)
    cm.prefill(ids, mask)
    for layer in range(3):
        assert [held(cm, layer, 0, h) == window(60) for h in range(2)].count(True) == 1, layer
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]


def test_calibration_is_cached_and_a_window_over_the_whole_sample_loses_nothing(llama_cm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path))
    samples = [torch.randint(2, 90, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    first = calibrate(llama_cm, samples, sinks=SINKS, recent=RECENT)
    assert len(first) == 3 and all(len(layer) == 2 and min(layer) > 0 for layer in first)
    assert len(list(tmp_path.iterdir())) == 1 and calibrate(llama_cm, samples, sinks=SINKS, recent=RECENT) == first
    assert calibrate(llama_cm, samples, sinks=0, recent=48) == ((0.0, 0.0),) * 3
    with pytest.raises(ValueError, match="recent >= 1"):
        calibrate(llama_cm, samples, recent=0)


@pytest.mark.parametrize("recipe", ["duoattention", "simlayerkv"])
def test_full_budget_reproduces_the_model(llama, llama_cm, recipe):
    assert_plain_at_full_budget(llama, llama_cm, recipe)


def test_bad_parameters_are_refused_before_anything_runs(llama_cm):
    with pytest.raises(ValueError, match="L x Hkv numbers"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=Recipe("d", "duoattention", "fill-eligible",
                                                            {"head_scores": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="the model has 3 layers of 2 KV heads"):  # another model's scores
        kvcompile.apply(llama_cm, budget=0.5, recipe=Recipe("d", "duoattention", "fill-eligible",
                                                            {"head_scores": [[1.0, 2.0]]}))
    with pytest.raises(ValueError, match="0 <= streaming <= 1"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=Recipe("d", "duoattention", "fill-eligible", {"streaming": 2}))
    with pytest.raises(ValueError, match="recent >= 1"):
        kvcompile.apply(llama_cm, budget=0.5, recipe=Recipe("s", "simlayerkv", "fill-eligible", {"recent": 0}))
