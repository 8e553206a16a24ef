"""DapQ: the pseudo queries stand at the positions after the context, the score is SnapKV's over them with the
pseudo tokens never kept, and the recipe holds its budget and is the model at budget 1.0."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import assert_plain_at_full_budget, left_padded_batch

import kvcompile
from kvcompile.methods import Observation
from kvcompile.methods.base import register_scorer
from kvcompile.methods.dapq import DapQ
from kvcompile.methods.snapkv import SnapKV

SEEN: dict = {}


@register_scorer("records-pseudo-queries")
@dataclass
class RecordsPseudoQueries(DapQ):
    """DapQ that records the window's query positions and the scores it returned."""

    def score(self, obs):
        scores = super().score(obs)
        SEEN[obs.layer] = (obs.query_positions.clone(), obs.positions.clone(), scores.clone())
        return scores


def test_the_pseudo_queries_stand_after_the_context_and_are_never_kept(llama_cm):
    SEEN.clear()
    recipe = kvcompile.Recipe("records", "records-pseudo-queries", scorer_args={"window": 8, "kernel": 3})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([40, 29], total=40)
    cm.prefill(ids, mask)
    for q_pos, positions, scores in SEEN.values():
        assert q_pos[0].sort().values.tolist() == list(range(40, 48))
        assert q_pos[1].sort().values.tolist() == list(range(29, 37))
        for b, n in enumerate((40, 29)):
            pseudo = positions[b] >= n
            assert pseudo.any() and (scores[b][pseudo] == float("-inf")).all()
    stats = cm.cache_stats()
    assert 0 < stats["bytes_held"] <= stats["budget_bytes"]


def test_score_is_snapkv_over_the_pseudo_window_with_the_pseudo_tokens_dropped():
    seed = int(torch.randint(0, 2**31, ()))
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, S, W, D = 2, 2, 3, 20, 4, 8
    keys, values = torch.randn(B, Hkv, S + W, D, generator=g), torch.randn(B, Hkv, S + W, D, generator=g)
    queries = torch.randn(B, Hkv * G, W, D, generator=g)
    positions = torch.arange(S + W).expand(B, Hkv, S + W)
    q_pos = torch.arange(S, S + W).expand(B, W)  # the pseudo queries, after the context
    obs = Observation(keys, values, positions, torch.ones(B, Hkv, S + W, dtype=torch.bool), queries, q_pos, D**-0.5,
                      0, 0, 1)
    scores = DapQ(window=W, kernel=5).score(obs)
    attn = torch.einsum("bhwd,bhsd->bhws", queries, keys.repeat_interleave(G, 1)) * D**-0.5
    causal = positions[0, 0][None, :] <= q_pos[0][:, None]  # [W, S + W]
    attn = attn.masked_fill(~causal, float("-inf")).softmax(-1).mean(2)  # [B, Hq, S + W]
    pooled = attn.view(B, Hkv, G, -1).mean(2)
    smooth = torch.nn.functional.max_pool1d(pooled, 5, stride=1, padding=2)
    torch.testing.assert_close(scores[..., :S], smooth[..., :S], rtol=1e-5, atol=1e-7)
    assert (scores[..., S:] == float("-inf")).all()
    snap = SnapKV(window=W, kernel=5).score(obs)  # the same window read by SnapKV keeps its own tokens instead
    assert (snap[..., S:] > scores[..., S:]).all()


def test_dapq_runs_by_name_within_budget_and_full_budget_is_the_model(llama, llama_cm):
    assert_plain_at_full_budget(llama, llama_cm, "dapq")
    # and what is read after the compression continues the context: the pseudo tokens left nothing behind
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="dapq", page_size=4)
    ids, _ = left_padded_batch([46], total=46, seed=5)
    cm.prefill(ids[:, :40])
    after = cm.prefill(ids[:, 40:])
    with torch.no_grad():
        ref = llama(input_ids=ids).logits[:, 40:]
    assert (after - ref).abs().max() <= 1e-4
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="dapq", page_size=4)
    cm.prefill(*left_padded_batch([70, 50], total=70))
    stats = cm.cache_stats()
    assert 0 < stats["bytes_held"] <= stats["budget_bytes"]
