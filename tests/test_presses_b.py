"""kvpress presses QFilter, FINCH and KVCompose: each against a direct re-statement of its formula on random shapes
(the seed is in every failure message), the properties its docs section states, and end to end through kvcompile.apply
against the plain model's own attention."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from conftest import assert_plain_at_full_budget, left_padded_batch, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvcompile
from kvcompile.calibration import qfilter as qfilter_calibration
from kvcompile.methods import ALLOCATORS, SCORERS, Observation
from kvcompile.methods.finch import chunk_shares

MAX = torch.finfo(torch.float32).max
FRESH = int(os.environ.get("KVC_SEED", random.SystemRandom().randrange(2**31)))
SEEDS = (0, 1, 2, FRESH)  # and one fresh seed per run: KVC_SEED=<seed> repeats it
NEW = ["qfilter", "finch", "kvcompose"]


def random_obs(seed, S=None, W=None, ragged=False) -> Observation:
    """Rows, KV heads, group size, head dim (and S) drawn from ``seed``. Every head holds positions 0..S-1; the
    window holds the last W queries (all by default); ``ragged``: row b's window starts later, its first slots
    empty, as a shorter row's are."""
    r = random.Random(seed)
    B, Hkv, G, D = r.randint(1, 3), r.randint(1, 3), r.randint(1, 3), r.choice([4, 8, 16])
    S = r.randint(8, 40) if S is None else S
    W = S if W is None else W
    g = torch.Generator().manual_seed(seed)
    first = torch.tensor([r.randint(S - W, S - 1) if ragged else S - W for _ in range(B)])
    qpos = torch.arange(S - W, S).expand(B, W)
    qpos = qpos.masked_fill(qpos < first[:, None], -1)
    return Observation(torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
                       torch.arange(S).expand(B, Hkv, S), torch.ones(B, Hkv, S, dtype=torch.bool),
                       torch.randn(B, Hkv * G, W, D, generator=g), qpos, D**-0.5, 0, 0, 3)


def dense_attention(obs: Observation, b: int, w: int) -> torch.Tensor:
    """[Hq, S] causal softmax attention of row b's window query w over every key, written out (the reference)."""
    G = obs.queries.shape[1] // obs.keys.shape[1]
    p = int(obs.query_positions[b, w])
    logits = torch.einsum("hd,hsd->hs", obs.queries[b, :, w], obs.keys[b].repeat_interleave(G, 0)) * obs.scale
    return torch.softmax(logits.masked_fill(obs.positions[b, 0] > p, float("-inf")), -1)


@pytest.mark.parametrize("recipe", NEW)
def test_recipe_at_full_budget_is_the_plain_model(llama, llama_cm, recipe):
    assert_plain_at_full_budget(llama, llama_cm, recipe)


def eager_attention(ids):
    """[L, Hq, T, T] attention of the test's plain 3-layer llama (the ``llama`` fixture's weights) over ``ids``."""
    eager = tiny_model("llama", layers=3)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        return torch.stack(eager(ids, output_attentions=True).attentions)[:, 0]


def kept_positions(cm, layer, h, b=0):
    _, _, pos, valid = cm.cache.dense(layer)
    return set(pos[b, h][valid[b, h]].tolist())


# ------------------------------------------------------------------------------------------ qfilter
def top_direction(q: torch.Tensor) -> torch.Tensor:
    """The first right-singular vector of q [N, D], signed so that the queries' mean projects positively."""
    u = torch.linalg.svd(q.double(), full_matrices=False).Vh[0]
    return (u if (q.double() @ u).mean() > 0 else -u).float()


@pytest.mark.parametrize("seed", SEEDS)
def test_qfilter_is_the_projection_of_each_key_on_its_heads_filter(seed):
    obs = random_obs(seed)
    B, Hkv, S, D = obs.keys.shape
    filters = torch.randn(3, Hkv, D, generator=torch.Generator().manual_seed(seed + 1))
    obs.layer = 2
    scores = SCORERS["qfilter"](filters=filters.tolist()).score(obs)
    for b in range(B):
        for h in range(Hkv):
            ref = torch.stack([filters[2, h] @ obs.keys[b, h, j] for j in range(S)])
            torch.testing.assert_close(scores[b, h], ref, msg=f"seed {seed}, row {b}, head {h}")


@pytest.mark.parametrize("seed", SEEDS)
def test_qfilter_without_filters_calibrates_on_the_prompts_own_queries(seed):
    """Uncalibrated, u is the top right-singular vector of the group's real observed queries (empty slots left out)."""
    obs = random_obs(seed, W=random.Random(seed).randint(2, 8), ragged=True)
    B, Hkv, _, D = obs.keys.shape
    G = obs.queries.shape[1] // Hkv
    scorer = SCORERS["qfilter"]()
    assert scorer.sources() == (kvcompile.methods.base.QueryWindow(512),)
    u = scorer.directions(obs)
    for b in range(B):
        for h in range(Hkv):
            real = obs.query_positions[b] >= 0
            ref = top_direction(obs.queries[b, G * h : G * (h + 1)][:, real].reshape(-1, D))
            torch.testing.assert_close(u[b, h], ref, atol=1e-5, rtol=1e-4, msg=f"seed {seed}, row {b}, head {h}")


def test_qfilter_ranking_follows_a_planted_direction():
    g = torch.Generator().manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(8, generator=g), dim=0)
    alpha = torch.randperm(40, generator=g).float()
    obs = random_obs(0, S=40)
    B, Hkv = obs.keys.shape[:2]
    obs.keys = (alpha[:, None] * u + 0.1 * torch.randn(B, Hkv, 40, 8, generator=g))
    scores = SCORERS["qfilter"](filters=[[u.tolist()] * Hkv] * 3).score(obs)
    assert torch.equal(scores.argsort(), alpha.argsort().expand(B, Hkv, 40))


def test_qfilter_refuses_filters_of_another_model():
    obs = random_obs(0)
    B, Hkv, _, D = obs.keys.shape
    with pytest.raises(ValueError, match="calibration.qfilter.calibrate"):
        SCORERS["qfilter"](filters=torch.ones(3, Hkv, D + 1).tolist()).score(obs)
    with pytest.raises(ValueError, match="nested"):
        SCORERS["qfilter"](filters=[[1.0, 2.0]])


def test_qfilter_calibration_is_the_models_own_query_direction(llama, llama_cm, tmp_path, monkeypatch):
    """The filters equal the top singular vector of the post-RoPE queries computed from the plain model (hooks on
    its attention), are the same from a fresh cache, and are read back from disk instead of measured again."""
    samples = [left_padded_batch([50], total=50, seed=s)[0] for s in (5, 6)]
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path / "a"))
    filters = qfilter_calibration.calibrate(llama_cm, samples)
    assert len(list((tmp_path / "a").iterdir())) == 1, "one cache file per model and samples"
    queries = [[] for _ in range(3)]

    def grab(module, args, kwargs, out):
        h, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        q = module.q_proj(h).view(*h.shape[:2], -1, 16).transpose(1, 2)
        queries[module.layer_idx].append(apply_rotary_pos_emb(q, q, cos, sin)[0][0])  # [Hq, T, D]

    hooks = [layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in llama.model.layers]
    with torch.no_grad():
        for ids in samples:
            llama(ids)
    for hook in hooks:
        hook.remove()
    for layer in range(3):
        q = torch.cat(queries[layer], 1)  # [Hq, N, D]
        for h in range(2):
            ref = top_direction(q[2 * h : 2 * h + 2].reshape(-1, 16))
            torch.testing.assert_close(torch.tensor(filters[layer][h]), ref, atol=1e-4, rtol=1e-3)

    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path / "b"))
    assert qfilter_calibration.calibrate(llama_cm, samples) == filters, "calibration is reproducible"
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path / "a"))
    monkeypatch.setattr(qfilter_calibration, "_measure", lambda *a: pytest.fail("measured again"))
    assert qfilter_calibration.calibrate(llama_cm, samples) == filters, "read back from the cache"
    path = next((tmp_path / "a").iterdir())
    assert json.loads(path.read_text()) == [[list(h) for h in layer] for layer in filters]


def test_qfilter_end_to_end_calibrated_and_not(llama_cm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path))
    filters = qfilter_calibration.calibrate(llama_cm, [left_padded_batch([40], total=40, seed=7)[0]])
    ids, mask = left_padded_batch([90, 70], total=90, seed=8)
    for recipe in ("qfilter", kvcompile.Recipe("qfilter-tiny", "qfilter", scorer_args={"filters": filters})):
        cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
        cm.prefill(ids, mask)
        stats = cm.cache_stats()
        assert stats["bytes_held"] <= stats["budget_bytes"], recipe
    assert cm.observation_window == 0 and stats["peak_bytes"]["ring"] == 0, "calibrated: no query is read"
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    full.prefill(ids, mask)
    keys, _, pos, valid = full.cache.dense(1)
    scores = torch.einsum("bhsd,hd->bhs", keys, torch.tensor(filters[1])).masked_fill(~valid, float("-inf"))
    for b in range(2):
        for h in range(2):
            best = set(pos[b, h][scores[b, h].topk(int(cm.cache.lengths[1, b, h])).indices].tolist())
            assert kept_positions(cm, 1, h, b) == best, f"row {b}, head {h}: the keys furthest along the filter"


# ------------------------------------------------------------------------------------------ finch
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_finch_scores_are_the_questions_normalised_mean_attention(seed, normalize):
    r = random.Random(seed)
    W = r.randint(1, 7)
    obs = random_obs(seed, W=W, ragged=True)  # the question of row b starts at its first observed query
    B, Hkv = obs.keys.shape[:2]
    scores = SCORERS["finch"](normalize_scores=normalize, block=r.randint(1, W)).score(obs)
    for b in range(B):
        rows = [w for w in range(W) if obs.query_positions[b, w] >= 0]
        weight = [float(obs.query_positions[b, w]) if normalize else 1.0 for w in rows]
        attn = sum(c * dense_attention(obs, b, w) for c, w in zip(weight, rows)) / len(rows)  # [Hq, S]
        ref = attn.reshape(Hkv, -1, attn.shape[-1]).mean(1)
        question = obs.positions[b, 0] >= obs.query_positions[b, rows[0]]
        assert (scores[b][:, question] == MAX).all(), f"seed {seed}: the question is kept"
        torch.testing.assert_close(scores[b][:, ~question], ref[:, ~question], msg=f"seed {seed}, row {b}")


@pytest.mark.parametrize("seed", SEEDS)
def test_finch_chunks_keep_what_kvpress_keeps_per_chunk(seed):
    """With n_kept = (1 - cr) x chunk per chunk, the top sum(n_kept) of the chunked scores is kvpress's union of
    per-chunk top-n_kept (the question pinned inside the last chunk's share)."""
    obs = random_obs(seed, S=48, W=4)
    plain = SCORERS["finch"]().score(obs)
    chunked = SCORERS["finch"](chunk_length=16).score(obs)
    assert torch.equal(chunked == MAX, plain == MAX), "the question stays pinned"
    for keep in (4, 8, 12):
        for b in range(obs.keys.shape[0]):
            for h in range(obs.keys.shape[1]):
                ref = {16 * c + int(j) for c in range(3) for j in plain[b, h, 16 * c : 16 * (c + 1)].topk(keep).indices}
                got = set(chunked[b, h].topk(3 * keep).indices.tolist())
                assert got == ref, f"seed {seed}, keep {keep} per chunk, row {b}, head {h}"


def test_chunk_shares_ignores_what_a_head_does_not_hold():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 9.0, 8.0]]])
    valid = torch.tensor([[[True, True, True, True, True, False]]])
    out = chunk_shares(scores, torch.zeros_like(valid), torch.arange(6).expand(1, 1, 6), valid, 4)
    assert out[0, 0, 5] == float("-inf") and out[0, 0].argsort(descending=True)[:2].tolist() == [0, 4]


def test_finch_end_to_end_ranks_by_the_question_it_was_given(llama_cm):
    """Against the plain model's own attention over context + question: each head keeps the question and its top
    share of the context by FINCH's score; the question's queries alone were observed; compression without the
    question apart is refused before anything changes."""
    n, w = 60, 6
    ids, _ = left_padded_batch([n + w], total=n + w, seed=9)
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="finch", page_size=1)
    cm.generate(ids[:, n:], context_ids=ids[:, :n], max_new_tokens=1, eos_token_id=[])
    stats = cm.cache_stats()
    budget = int(0.25 * (n + w) * 3 * 2)  # tokens: the context and the question count
    assert stats["query_aware"] is True and stats["budget_bytes"] == budget * cm.cache.token_bytes
    assert stats["bytes_held"] <= stats["budget_bytes"]
    spec = cm.spec
    ring = w * (spec.num_layers * spec.num_q_heads * (spec.head_dim + 1) * 4 + 8)  # fp32 queries and their
    # log-sum-exps, int64 positions
    assert stats["peak_bytes"]["ring"] == ring, "the question's queries alone were observed"
    attn = eager_attention(ids)[:, :, n:, :]  # [L, Hq, w, T]
    score = (attn * torch.arange(n, n + w)[:, None]).mean(2).reshape(3, 2, 2, -1).mean(2)  # [L, Hkv, T]
    share = budget // 6 - w
    for layer in range(3):
        for h in range(2):
            best = set(score[layer, h, :n].topk(share).indices.tolist()) | set(range(n, n + w))
            assert kept_positions(cm, layer, h) == best, f"layer {layer}, head {h}"
    lengths = cm.cache.lengths.clone()
    for call in (lambda: cm.prefill(ids), lambda: cm.generate(ids, max_new_tokens=1), cm.compress):
        with pytest.raises(ValueError, match=r"generate\(question_ids, context_ids=context_ids\)"):
            call()
    assert torch.equal(cm.cache.lengths, lengths), "refused before anything changed"
    assert torch.isfinite(cm.decode(ids[:, -1:])).all()


# ------------------------------------------------------------------------------------------ kvcompose
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("task, group, vnorm", [("max", "mean", False), ("mean", "max", True)])
def test_kvcompose_scores_aggregate_the_second_readings_attention(seed, task, group, vnorm):
    r = random.Random(seed)
    n = r.randint(4, 20)
    obs = random_obs(seed, S=2 * n, W=n)  # the context at 0..n-1, its second reading (the window) at n..2n-1
    B, Hkv = obs.keys.shape[:2]
    scores = SCORERS["kvcompose"](agg_task=task, agg_group=group, add_v_norm=vnorm, block=r.randint(1, n)).score(obs)
    for b in range(B):
        attn = torch.stack([dense_attention(obs, b, w) for w in range(n)], 1)  # [Hq, n queries, 2n keys]
        per_head = attn.amax(1) if task == "max" else attn.mean(1)
        grouped = per_head.reshape(Hkv, -1, 2 * n)
        s = grouped.mean(1) if group == "mean" else grouped.amax(1)
        s = s * obs.values[b].norm(dim=-1) if vnorm else s
        s = s + s.mean(0, keepdim=True)
        torch.testing.assert_close(scores[b, :, :n], s[:, :n], msg=f"seed {seed}, row {b}")
        assert (scores[b, :, n:] == float("-inf")).all(), "the second reading's own tokens are never kept"


def top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of x, ties to the earlier index (layer 0's curve ties the best layer's)."""
    return x.sort(descending=True, stable=True).indices[:k]


def kvpress_counts(scores, budget, structured, lower_bound=0):
    """kvpress's KVComposePress.compute_important_per_layer for one row, re-stated with loops: [L, Hkv] counts."""
    L, Hkv, n = scores.shape
    curves = scores.sort(-1, descending=True).values
    if not structured:
        c = curves.clone()
        c[..., :lower_bound] += 1e9
        kept = top(c.reshape(-1), budget) // n
        return torch.bincount(kept, minlength=L * Hkv).reshape(L, Hkv)
    composite = torch.stack([sum(curves[layer, h] for h in range(Hkv)) / Hkv for layer in range(L)])
    composite[:, : max(lower_bound, 1)] += 1e9
    composite[0] = composite.max(0).values
    kept = top(composite.reshape(-1), budget // Hkv) // n
    return torch.bincount(kept, minlength=L)[:, None].expand(L, Hkv)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("lower_bound", [0, 3])
def test_kvcompose_allocation_is_kvpress_per_row(seed, structured, lower_bound):
    """Budgets above the floors (whose boosted scores tie), as many as the heads hold at most."""
    r, g = random.Random(seed), torch.Generator().manual_seed(seed)
    L, B, Hkv, n = r.randint(2, 5), r.randint(1, 3), r.randint(1, 3), r.randint(5, 25)
    scores = torch.rand(L, B, Hkv, n, generator=g) * torch.rand(L, 1, 1, 1, generator=g)
    lengths = torch.full((L, B, Hkv), n)
    floor = max(1, lower_bound) if structured else lower_bound
    budget = torch.tensor([Hkv * r.randint(L * floor, L * n) for _ in range(B)])
    alloc = ALLOCATORS["kvcompose"](structured=structured, keep_token_lower_bound=lower_bound)
    counts = alloc.allocate(scores, lengths, budget)
    for b in range(B):
        ref = kvpress_counts(scores[:, b], int(budget[b]), structured, lower_bound)
        assert torch.equal(counts[:, b], ref), f"seed {seed}, row {b}: {counts[:, b].tolist()} != {ref.tolist()}"
        assert int(counts[:, b].sum()) == int(budget[b]), f"seed {seed}: the budget is spent exactly"
        if structured:
            assert (counts[:, b] == counts[:, b, :1]).all(), f"seed {seed}: one count per layer"
            assert (counts[:, b] >= max(1, lower_bound)).all() and counts[0, b, 0] == counts[:, b, 0].max()


def test_kvcompose_floor_comes_out_of_the_budget():
    scores = torch.zeros(4, 1, 2, 10)
    scores[0] = 1.0  # one layer takes everything unless every layer is floored
    counts = ALLOCATORS["kvcompose"]().allocate(scores, torch.full((4, 1, 2), 10), torch.tensor([14]))
    assert counts[:, 0, 0].tolist() == [4, 1, 1, 1] and int(counts.sum()) == 14


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("structured", [True, False])
def test_kvcompose_whole_pages_keep_the_most_composite_score_any_page_choice_can(seed, structured):
    """``whole_pages`` against every choice of whole pages (brute force, fresh random scores): within the page
    budget, no choice keeps more composite score (structured: a layer's block of ranks costs a page per head, and
    every layer keeps at least its first); counts are whole pages or a head's length."""
    import itertools

    r, g = random.Random(seed), torch.Generator().manual_seed(seed)
    alloc = ALLOCATORS["kvcompose"](structured=structured, whole_pages=True)
    for _ in range(20):
        L, Hkv, n, P = r.randint(2, 3), r.randint(1, 2), r.randint(3, 8), r.randint(2, 3)
        scores = torch.rand(L, 1, Hkv, n, generator=g) ** 3 * torch.rand(L, 1, 1, 1, generator=g)
        lengths = torch.full((L, 1, Hkv), n)
        held = -(-n // P)
        max_pages = torch.tensor([Hkv * r.randint(L, L * held) if structured else r.randint(0, L * Hkv * held)])
        counts = alloc.allocate_pages(scores, lengths, max_pages, P)
        assert int((-(-counts // P)).sum()) <= int(max_pages), f"seed {seed}: over the page budget"
        assert ((counts % P == 0) | (counts == lengths)).all(), f"seed {seed}: not whole pages"
        curves = scores[:, 0].sort(-1, descending=True).values  # [L, Hkv, n]
        if structured:
            assert (counts == counts[:, :, :1]).all() and (counts > 0).all(), f"seed {seed}: one count per layer"
            composite = curves.mean(1)
            composite[0] = composite.amax(0)
            rows, got = composite, counts[:, 0, 0].tolist()
            picks = itertools.product(range(1, held + 1), repeat=L)
        else:
            rows, got = curves.flatten(0, 1), counts[:, 0].flatten().tolist()
            picks = itertools.product(range(held + 1), repeat=L * Hkv)
        worth = lambda c: sum(float(rows[i, : c[i]].sum()) for i in range(len(c)))  # noqa: E731
        best = max(worth([min(p * P, n) for p in pick]) for pick in picks
                   if (Hkv if structured else 1) * sum(pick) <= int(max_pages))
        assert worth(got) >= best - 1e-5, f"seed {seed}: {worth(got)} < {best}"


def test_kvcompose_end_to_end_keeps_rank_aligned_tokens(llama, llama_cm):
    """Against the plain model's attention over [context, context]: every head of layer l keeps its own top-m_l
    tokens, m_l from kvpress's composite allocation; Sum_l m_l * Hkv is the budget; the copy is gone."""
    n = 64
    ids, _ = left_padded_batch([n], total=n, seed=3)
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="kvcompose", page_size=1)
    cm.prefill(ids)
    attn = eager_attention(torch.cat([ids, ids], 1))[:, :, n:, :n]  # [L, Hq, n, n]
    score = attn.amax(2).reshape(3, 2, 2, n).mean(2)
    score = score + score.mean(1, keepdim=True)
    budget = cm.cache_stats()["budget_bytes"] // cm.cache.token_bytes
    counts = kvpress_counts(score, budget, structured=True)
    assert int(counts.sum()) == budget - budget % 2
    for layer in range(3):
        for h in range(2):
            best = set(score[layer, h].topk(int(counts[layer, h])).indices.tolist())
            assert kept_positions(cm, layer, h) == best, f"layer {layer}, head {h}"
    stats = cm.cache_stats()
    assert int(cm.seen[0]) == n and stats["bytes_held"] <= stats["budget_bytes"]
    assert stats["peak_bytes_held"] >= 2 * stats["bytes_full"], "the context was read a second time on top"


def test_kvcompose_unstructured_is_ragged_within_budget(llama_cm):
    recipe = kvcompile.Recipe("kvcompose-unstructured", "kvcompose", "kvcompose", allocator_args={"structured": False})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=1)
    ids, mask = left_padded_batch([80, 64], total=80, seed=10)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert len(set(cm.cache.lengths.flatten().tolist())) > 1, "heads hold different numbers of tokens"
