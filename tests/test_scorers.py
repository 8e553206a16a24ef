"""Prefill scorers: each one's defining property on a constructed case, then every recipe end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_plain_at_full_budget, fresh_seed, left_padded_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompile
from kvcompile.eval.uor import union_overhead, union_sizes
from kvcompile.methods import SCORERS, Observation
from kvcompile.methods.compactor import leverage
from kvcompile.methods.jacap import weighted_leverage
from kvcompile.methods.kvzip import GlobalTopK
from kvcompile.methods.twinkv import TwinKVCapacities
from kvcompile.observation import observe

RECIPES = [
    "tova", "h2o", "keydiff", "expected-attention", "adakv-expected-attention", "criticalkv", "adakv-criticalkv",
    "compactor", "kvzip", "jacap", "twinkv",
]
MAX = torch.finfo(torch.float32).max


def make_obs(B=1, Hkv=2, G=2, S=40, D=8, W=None, seed=0, keys=None, values=None, queries=None) -> Observation:
    """Every head holds positions 0..S-1; the window holds the last W prompt queries (all of them by default)."""
    g = torch.Generator().manual_seed(seed)
    W = S if W is None else W
    keys = torch.randn(B, Hkv, S, D, generator=g) if keys is None else keys
    values = torch.randn(B, Hkv, S, D, generator=g) if values is None else values
    queries = torch.randn(B, Hkv * G, W, D, generator=g) if queries is None else queries
    positions = torch.arange(S).expand(B, Hkv, S)
    query_positions = torch.arange(S - W, S).expand(B, W)
    return Observation(keys, values, positions, torch.ones(B, Hkv, S, dtype=torch.bool), queries, query_positions,
                       D**-0.5, 0, 0, 1)


def dense_attention(obs: Observation):
    """[B, Hq, W, S] causal softmax attention written out directly (the reference)."""
    G = obs.queries.shape[1] // obs.keys.shape[1]
    keys = obs.keys.repeat_interleave(G, 1)
    logits = obs.queries @ keys.transpose(-1, -2) * obs.scale
    causal = obs.positions[:, :1, None, :] <= obs.query_positions[:, None, :, None]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)


def ragged_obs(g: torch.Generator, window: int, weighted: bool, every_query: bool) -> Observation:
    """Random rows of different lengths (left padding), slots some heads do not hold, a window in ring order
    (slots shuffled, unfilled slots -1) of every query or of the last few, optionally log-weights and a sliding
    window."""
    B, Hkv, G, S, D = 2, 2, 3, int(torch.randint(20, 140, (1,), generator=g)), 8
    W = S if every_query else int(torch.randint(1, S + 1, (1,), generator=g))
    pad = torch.randint(0, S // 2, (B,), generator=g)
    positions = (torch.arange(S)[None] - pad[:, None]).clamp_min(0)[:, None].expand(B, Hkv, S).contiguous()
    valid = (torch.arange(S)[None] >= pad[:, None])[:, None] & (torch.rand(B, Hkv, S, generator=g) > 0.2)
    query_positions = torch.arange(S - W, S)[None] - pad[:, None]
    query_positions = query_positions.masked_fill(query_positions < 0, -1)[:, torch.randperm(W, generator=g)]
    return Observation(torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), positions,
                       valid, torch.randn(B, Hkv * G, W, D, generator=g), query_positions, 0.3, window, 0, 1,
                       log_weights=torch.rand(B, Hkv, S, generator=g) if weighted else None)


def plain_window_attention(obs: Observation, chunk: int = 0) -> torch.Tensor:
    """[B, Hq, W, S] the observed queries' attention written out with one mask over every (query, key) pair."""
    G = obs.queries.shape[1] // obs.keys.shape[1]
    logits = obs.queries @ obs.keys.repeat_interleave(G, 1).transpose(-1, -2) * obs.scale
    if obs.log_weights is not None:
        logits = logits + obs.log_weights.repeat_interleave(G, 1)[:, :, None]
    qp, kp = obs.query_positions[:, None, :, None], obs.positions.repeat_interleave(G, 1)[:, :, None]
    seen = (qp // chunk == kp // chunk) if chunk else (kp <= qp)
    seen = seen & obs.valid.repeat_interleave(G, 1)[:, :, None] & (qp >= 0)
    if obs.window:
        seen = seen & (qp - kp < obs.window)
    return torch.softmax(logits.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)


@pytest.mark.parametrize("window, weighted, chunk", [(0, False, 0), (0, True, 0), (7, False, 0), (0, False, 6)])
def test_observed_attention_equals_the_plain_softmax(window, weighted, chunk):
    """The observation's attention (a block of ``SPAN_QUERIES`` queries or more over only the keys it can see, the
    mask only where some query does not see a key; a smaller one over every key) equals one softmax over every pair,
    as a whole, by block and summed by key."""
    g = torch.Generator().manual_seed(fresh_seed())
    for every_query in (True, True, False, False, False):
        obs = ragged_obs(g, window, weighted, every_query)
        want = plain_window_attention(obs, chunk)
        torch.testing.assert_close(obs.window_attention(chunk=chunk), want)
        W = want.shape[2]
        torch.testing.assert_close(obs.window_attention(slice(W // 3, W), chunk=chunk), want[:, :, W // 3 :])
        for block in (1, 5, 64):
            torch.testing.assert_close(obs.received_attention(block, chunk=chunk), want.sum(2))


def build(name, **kwargs):
    return SCORERS[name](**kwargs)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any single op output had (a tensor that never exists cannot be counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# ---------------------------------------------------------------------------------------------- scorers
@pytest.mark.parametrize("smoothing", ["max", "avg"])
def test_snapkv_is_the_windows_mean_attention_smoothed(smoothing):
    """SnapKV against its formula written out on fresh random shapes: the window's mean attention, averaged over
    each GQA group, smoothed over 7 neighbours; "avg" as kvpress computes it (an average pool of the tokens before
    the window, their scores alone, zeros past the edges); the window kept above everything."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    S, W, K = int(torch.randint(12, 40, (1,), generator=g)), 5, 7
    obs = make_obs(B=2, Hkv=2, G=3, S=S, W=W, seed=seed)
    scores = build("snapkv", window=W, kernel=K, smoothing=smoothing).score(obs)
    mean = dense_attention(obs).mean(2).view(2, 2, 3, S).mean(2)  # [B, Hkv, S]
    context = mean[..., : S - W]
    if smoothing == "avg":
        want = torch.nn.functional.pad(context, (K // 2, K // 2)).unfold(-1, K, 1).mean(-1)
    else:
        want = torch.stack([mean[..., max(0, j - K // 2): j + K // 2 + 1].amax(-1) for j in range(S - W)], -1)
    torch.testing.assert_close(scores[..., : S - W], want, msg=lambda m: f"seed {seed}: {m}")
    assert (scores[..., S - W:] == MAX).all(), f"seed {seed}: the window is kept"


def test_tova_ranks_by_the_last_querys_attention():
    obs = make_obs(W=1)
    attn = dense_attention(obs)[:, :, -1]  # [B, Hq, S]
    group = build("tova", pool="group").score(obs)
    layer = build("tova").score(obs)
    last = obs.positions == obs.positions.max()
    assert (group[last] == MAX).all() and (layer[last] == MAX).all(), "the last token is always kept"
    torch.testing.assert_close(group[~last], attn.reshape(1, 2, 2, -1).mean(2)[~last])
    torch.testing.assert_close(layer[~last], attn.mean(1, keepdim=True).expand(1, 2, -1)[~last])


def test_tova_layer_pooling_matches_heads_by_position():
    """After per-head compression KV heads hold different tokens; TOVA's one shared ranking follows positions."""
    obs = make_obs(W=1, S=20)
    even = torch.arange(0, 20, 2)  # KV head 1 kept only the even positions, compacted to its front
    obs.keys[0, 1, :10] = obs.keys[0, 1, even]
    obs.positions = obs.positions.clone()
    obs.positions[0, 1, :10] = even
    obs.valid[0, 1, 10:] = False
    attn = obs.window_attention()[:, :, 0]  # [1, 4, 20]
    scores = build("tova").score(obs)
    for p in range(19):
        heads_0 = attn[0, :2, p].sum()
        heads_1 = attn[0, 2:, p // 2].sum() if p % 2 == 0 else 0.0
        expected = (heads_0 + heads_1) / 4
        assert torch.allclose(scores[0, 0, p], expected), f"position {p}"
        if p % 2 == 0:
            assert torch.allclose(scores[0, 1, p // 2], expected), f"position {p} in the ragged head"


def test_h2o_is_the_cumulative_attention_of_every_prefill_query():
    obs = make_obs(S=50)
    dense = dense_attention(obs).sum(2)  # [B, Hq, S]
    torch.testing.assert_close(build("h2o", block=7).cumulative_attention(obs), dense)
    shorter = make_obs(S=50, W=64)  # a window wider than the prompt: empty slots are ignored
    shorter.query_positions = torch.cat([torch.full((1, 14), -1), torch.arange(50)[None]], 1)
    shorter.queries = torch.cat([torch.randn(1, 4, 14, 8), obs.queries], 2)
    torch.testing.assert_close(build("h2o", block=16).cumulative_attention(shorter), dense)
    heavy = dense.reshape(1, 2, 2, -1).mean(2)
    only_heavy = build("h2o", block=7, heavy_ratio=1.0).score(obs)
    assert torch.equal(only_heavy.argsort(descending=True), heavy.argsort(descending=True))


def test_h2o_keeps_heavy_hitters_and_recent_tokens_half_and_half():
    obs = make_obs(S=50)
    heavy = dense_attention(obs).sum(2).reshape(1, 2, 2, -1).mean(2)
    order = build("h2o").score(obs).argsort(descending=True)
    for k in range(2, 51):
        for h in range(2):
            top = set(order[0, h, :k].tolist())
            assert set(heavy[0, h].argsort(descending=True)[: k // 2].tolist()) <= top, f"heavy, k={k}"
            assert set(range(50 - k // 2, 50)) <= top, f"recent, k={k}"


def test_h2o_never_builds_an_n_by_n_tensor_at_8k():
    n = 8192
    obs = make_obs(Hkv=1, G=2, S=n, D=8)
    counter = LargestTensor()
    with counter:
        scores = build("h2o", window=n, block=256).score(obs)
    assert torch.isfinite(scores).all() and scores.shape == (1, 1, n)
    assert counter.largest < n * n // 8, f"an op produced {counter.largest} elements (n x n = {n * n})"
    small = make_obs(Hkv=1, G=2, S=1024, D=8)
    dense_counter = LargestTensor()
    with dense_counter:
        small.window_attention()
    assert dense_counter.largest >= 1024 * 1024, "the counter sees a dense attention matrix when there is one"


def test_keydiff_keeps_keys_far_from_the_mean_direction():
    keys = torch.zeros(1, 1, 12, 4)
    keys[..., 0] = 1.0
    keys += 0.05 * torch.randn(1, 1, 12, 4, generator=torch.Generator().manual_seed(0))
    keys[0, 0, 7] = torch.tensor([0.0, 3.0, 0.0, 0.0])
    obs = make_obs(Hkv=1, G=1, S=12, D=4, keys=keys)
    scores = build("keydiff").score(obs)
    assert int(scores.argmax()) == 7
    obs.keys = keys * torch.rand(1, 1, 12, 1) * 5  # the score reads directions only
    torch.testing.assert_close(build("keydiff").score(obs), scores)


def test_expected_attention_matches_the_gaussian_expectation():
    """exp(z) is E[exp(scale q.k)] for Gaussian queries: compare with the average over many sampled queries."""
    g = torch.Generator().manual_seed(0)
    D, S, W = 4, 10, 20000
    mu = torch.tensor([0.5, -0.3, 0.2, 0.1])
    chol = torch.tensor([[0.6, 0, 0, 0], [0.2, 0.5, 0, 0], [0.0, 0.1, 0.4, 0], [0.1, 0.0, 0.2, 0.3]])
    queries = (mu + torch.randn(W, D, generator=g) @ chol.T)[None, None]
    obs = make_obs(Hkv=1, G=1, S=S, D=D, W=W, queries=queries)
    obs.query_positions = torch.arange(S, S + W)[None]
    scores = build("expected-attention", window=W, use_vnorm=False).score(obs)[0, 0]
    sampled = torch.exp(obs.scale * queries[0, 0] @ obs.keys[0, 0].T).mean(0)[4:]
    torch.testing.assert_close(scores[4:], sampled / sampled.sum(), rtol=0.03, atol=0)
    assert (scores[:4] == MAX).all(), "sinks are kept"
    with_norm = build("expected-attention", window=W).score(obs)[0, 0]
    torch.testing.assert_close(with_norm[4:], scores[4:] * obs.values[0, 0, 4:].norm(dim=-1))


def test_criticalkv_reweights_by_value_norm_and_keeps_its_first_stage():
    """Base: TOVA, whose last query is built to attend less to later tokens. Equal value norms keep the base order;
    a late token with a large value enters the top-k; any top-k holds the base's top first_stage_ratio * k."""
    S = 30
    keys = torch.zeros(1, 1, S, 8)
    keys[..., 0] = 0.3 * (S - torch.arange(S).float())
    query = torch.zeros(1, 1, 1, 8)
    query[..., 0] = 1.0
    values = torch.ones(1, 1, S, 8)
    obs = make_obs(Hkv=1, G=1, S=S, W=1, keys=keys, values=values, queries=query)
    obs.weights["o_proj"] = torch.eye(8)  # W_o = identity: ||W_o v||_1 = ||v||_1
    critical = build("criticalkv", base="tova", base_args={"pool": "group"}, first_stage_ratio=0.5)
    base = build("tova", pool="group").score(obs)
    assert torch.equal(critical.score(obs).argsort(descending=True), base.argsort(descending=True))
    obs.values = values.clone()
    obs.values[0, 0, 25] *= 100
    top4 = critical.score(obs)[0, 0].topk(4).indices.tolist()
    assert 25 in top4 and 25 not in base[0, 0].topk(4).indices.tolist()
    obs.values = torch.rand(1, 1, S, 8, generator=torch.Generator().manual_seed(1)) * 3
    order = critical.score(obs)[0, 0].argsort(descending=True)
    base_order = base[0, 0].argsort(descending=True)
    for k in range(1, S + 1):
        first = set(base_order[: k // 2].tolist())
        assert first <= set(order[:k].tolist()), f"top-{k} misses the base's top {k // 2}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_criticalkv_weighs_values_through_the_output_projection_as_kvpress(seed):
    """The second stage ranks by (base + epsilon) * ||W_o v||_1, the value through each query head's slice of W_o,
    averaged over a KV head's query heads: kvpress's ``CriticalKVPress.vwl1norm``, restated with one loop per query
    head. With first_stage_ratio 0 the ranking is the second stage's alone."""
    Hkv, G, S, D, hidden = 2, 3, 40, 8, 12
    obs = make_obs(Hkv=Hkv, G=G, S=S, D=D, seed=seed)
    w_o = torch.randn(hidden, Hkv * G * D, generator=torch.Generator().manual_seed(100 + seed))
    obs.weights["o_proj"] = w_o
    base = build("tova", pool="group").score(obs)
    norms = torch.stack([torch.stack([(obs.values[:, h] @ w_o[:, (h * G + g) * D:(h * G + g + 1) * D].T).abs().sum(-1)
                                      for g in range(G)]).mean(0) for h in range(Hkv)], 1)  # [B, Hkv, S]
    expected = ((base + 1e-4) * norms).argsort(-1, descending=True)
    critical = build("criticalkv", base="tova", base_args={"pool": "group"}, first_stage_ratio=0.0)
    assert torch.equal(critical.score(obs).argsort(-1, descending=True), expected), f"seed {seed}"
    plain = build("criticalkv", base="tova", base_args={"pool": "group"}, first_stage_ratio=0.0, projected=False)
    assert not torch.equal(plain.score(obs).argsort(-1, descending=True), expected), "W_o made no difference"


def test_two_stage_scores_keep_the_heads_apart(llama_cm):
    """Merged rankings carry the first criterion's values, so Ada-KV over CriticalKV splits a layer's tokens between
    its heads by the base's scores, as Ada-KV over SnapKV does. Rank-valued scores were the same numbers in every
    head, and Ada-KV split them evenly (to within rounding: 100-103 tokens per head here)."""
    ids, mask = left_padded_batch([256, 256], total=256, seed=3)  # long enough that SnapKV's window pins few
    spread = {}
    for recipe in ("adakv-criticalkv", "adakv-snapkv", "criticalkv"):
        cm = kvcompile.apply(llama_cm, budget=0.4, recipe=recipe, page_size=4)
        cm.prefill(ids, mask)
        lengths = cm.cache.lengths  # [L, B, Hkv]
        spread[recipe] = int((lengths.amax(-1) - lengths.amin(-1)).max())
    assert spread["adakv-criticalkv"] == spread["adakv-snapkv"] > 16, spread
    assert spread["criticalkv"] <= 4, spread  # uniform: page rounding only


def exact_leverage(x):
    """Squared row norms of an orthonormal basis of the centred rows' column space (rank-revealing SVD)."""
    u, s, _ = torch.linalg.svd((x - x.mean(0)).double(), full_matrices=False)
    return (u[:, s > 1e-6 * s[0]] ** 2).sum(-1)


@pytest.mark.parametrize("rank, sketch", [(8, 8), (8, 12), (3, 4)])
def test_compactor_leverage_matches_exact_leverage(rank, sketch):
    """The sketch keeps the keys' row space whenever it is at least their rank, so leverage is exact there."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(60, rank, generator=g) @ torch.randn(rank, 8, generator=g)
    approx = leverage(x[None, None], torch.ones(1, 1, 60, dtype=torch.bool), sketch, g)[0, 0]
    torch.testing.assert_close(approx.double(), exact_leverage(x), rtol=1e-4, atol=1e-5)
    assert abs(float(approx.sum()) - rank) < 1e-3, "leverage scores sum to the rank"


def test_chunked_attention_is_non_causal_within_chunks():
    obs = make_obs(S=32)
    attn = obs.window_attention(slice(3, 20), chunk=8)  # [B, Hq, 17, S]
    q = torch.arange(3, 20)[:, None]
    same_chunk = q // 8 == torch.arange(32)[None] // 8
    assert ((attn > 0) == same_chunk).all(), "a query sees exactly its own chunk, later keys included"
    torch.testing.assert_close(attn.sum(-1), torch.ones(1, 4, 17))


def test_compactor_ignores_unheld_tokens_and_keeps_its_sinks():
    obs = make_obs(S=40)
    obs.valid[:, :, 30:] = False
    scores = build("compactor", chunk=16).score(obs)
    held = scores[obs.valid]
    assert torch.isfinite(held).all()
    assert (scores[:, :, :8] == MAX).all() and (scores[:, :, 26:30] == MAX).all(), "first 8 and last 4 held"
    g = torch.Generator().manual_seed(5)
    lev = leverage(obs.keys, obs.valid, 48, g)
    restricted = leverage(obs.keys[:, :, :30], obs.valid[:, :, :30], 48, torch.Generator().manual_seed(5))
    torch.testing.assert_close(lev[:, :, :30], restricted)


def test_kvzip_scores_the_max_attention_of_the_reconstruction_queries():
    """Reconstruction queries aimed at tokens 5 and 9 make those the top non-sink tokens; the reconstruction's own
    tokens (positions from its first query on) are never kept."""
    S, D = 24, 8
    keys = torch.randn(1, 1, S, D, generator=torch.Generator().manual_seed(0))
    queries = torch.zeros(1, 1, 4, D)
    queries[0, 0, 1], queries[0, 0, 3] = 8 * keys[0, 0, 5], 8 * keys[0, 0, 9]
    obs = make_obs(Hkv=1, G=1, S=S, D=D, W=4, keys=keys, queries=queries)
    obs.query_positions = torch.tensor([[20, 21, 22, 23]])  # positions 20.. are the reconstruction
    scores = build("kvzip").score(obs)[0, 0]
    assert (scores[:4] == MAX).all() and (scores[20:] == float("-inf")).all()
    assert set(scores[4:20].topk(2).indices.add(4).tolist()) == {5, 9}
    torch.testing.assert_close(scores[4:20], dense_attention(obs)[0, 0].amax(0)[4:20])


def test_kvzip_end_to_end_keeps_what_the_reconstruction_reads(llama):
    """Against the plain model's own attention over [context, context]: KVzip keeps, per (layer, KV head), exactly
    the global top-budget tokens by max attention from the second copy; the copy is gone afterwards."""
    n = 64
    ids, _ = left_padded_batch([n], total=n, seed=3)
    cm = kvcompile.apply(llama, budget=0.25, recipe="kvzip", page_size=1)
    cm.prefill(ids)
    eager = tiny_model("llama", layers=3)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attn = torch.stack(eager(torch.cat([ids, ids], 1), output_attentions=True).attentions)  # [L, 1, Hq, 2n, 2n]
    ref = attn[:, 0, :, n:, :n].amax(2).reshape(3, 2, 2, n).amax(2)  # [L, Hkv, n]
    ref[..., :4] = float("inf")
    budget = cm.cache_stats()["budget_bytes"] // cm.cache.token_bytes
    chosen = torch.zeros(ref.numel(), dtype=torch.bool)
    chosen[ref.flatten().topk(budget).indices] = True
    chosen = chosen.reshape(3, 2, n)
    for layer in range(3):
        _, _, pos, valid = cm.cache.dense(layer)
        for h in range(2):
            kept = set(pos[0, h][valid[0, h]].tolist())
            assert kept == set(torch.nonzero(chosen[layer, h]).flatten().tolist()), f"layer {layer}, head {h}"
    stats = cm.cache_stats()
    assert int(cm.seen[0]) == n and stats["bytes_held"] <= stats["budget_bytes"]
    assert stats["peak_bytes_held"] >= 2 * stats["bytes_full"], "the reconstruction was prefilled on top"
    assert cm.cache.ring.capacity == 0, "the reconstruction's queries are gone, and the ring with them"


def test_global_topk_keeps_the_overall_top_scores():
    scores = torch.tensor([[9.0, 1.0, 0.5], [8.0, 7.0, float("-inf")]]).reshape(2, 1, 1, 3)  # [L, B, Hkv, S]
    counts = GlobalTopK().allocate(scores, torch.tensor([[[3]], [[2]]]), torch.tensor([3]))
    assert counts.flatten().tolist() == [1, 2]
    assert GlobalTopK().allocate(scores, torch.tensor([[[3]], [[2]]]), torch.tensor([9])).flatten().tolist() == [3, 2]


def test_jacap_score_is_the_log_det_drop():
    """-log(1 - score_i) = log det A - log det A without token i (the matrix-determinant lemma)."""
    g = torch.Generator().manual_seed(0)
    w, u = torch.rand(12, generator=g, dtype=torch.float64), torch.randn(12, 5, generator=g, dtype=torch.float64)
    scores = weighted_leverage(w, u)
    A = torch.eye(5, dtype=torch.float64) + (w[:, None, None] * u[:, :, None] * u[:, None, :]).sum(0)
    for i in range(12):
        without = A - w[i] * torch.outer(u[i], u[i])
        drop = torch.logdet(A) - torch.logdet(without)
        torch.testing.assert_close(-torch.log1p(-scores[i]), drop)


def test_jacap_discounts_a_value_that_others_repeat():
    S, D = 16, 4
    keys = torch.ones(1, 1, S, D)  # one direction: the prior is uniform, every weight equal
    values = torch.zeros(1, 1, S, D)
    values[..., 0] = 1.0  # everyone repeats e0 ...
    values[0, 0, 10] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # ... except token 10
    obs = make_obs(Hkv=1, G=1, S=S, D=D, keys=keys, values=values)
    scores = build("jacap").score(obs)[0, 0]
    assert int(scores[4:].argmax()) + 4 == 10


def test_twinkv_discounts_far_twins_only():
    S, D = 80, 32
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, S, D, generator=g)
    keys[0, 0, 60] = keys[0, 0, 10]  # a far twin (distance 50 > local)
    keys[0, 0, 22] = keys[0, 0, 20]  # a near twin (distance 2)
    values = torch.ones(1, 1, S, D)
    obs = make_obs(Hkv=1, G=1, S=S, D=D, W=8, keys=keys, values=values)
    scorer = build("twinkv", window=8)
    f = scorer.twins(obs)[0, 0]
    assert f[10] == 1 and f[60] == 1 and f[20] == 0 and f[22] == 0 and f.sum() == 2
    scores = scorer.score(obs)[0, 0]
    assert scores[10] < scores[30] and scores[20] == scores[30]
    assert (scores[:4] == MAX).all() and (scores[72:] == MAX).all(), "sinks and the window are kept"


def test_twinkv_capacities_follow_score_mass_and_fill_the_budget():
    scores = torch.ones(1, 1, 2, 100)  # [L, B, Hkv, S]
    scores[0, 0, 0] *= 3.0  # head 0 has three times the mass
    counts = TwinKVCapacities(floor=0.0).allocate(scores, torch.tensor([[[100, 100]]]), torch.tensor([80]))
    assert counts.flatten().tolist() == [60, 20]
    capped = TwinKVCapacities(floor=0.2).allocate(scores, torch.tensor([[[50, 100]]]), torch.tensor([120]))
    assert capped.flatten().tolist() == [50, 70], "what a full head cannot take goes to the others"


def test_uor_counts_the_union_of_per_query_head_selections():
    same = torch.arange(10.0).expand(1, 2, 10)  # both query heads of one KV head agree
    disjoint = torch.stack([torch.arange(10.0), -torch.arange(10.0)])[None]
    valid = torch.ones(1, 1, 10, dtype=torch.bool)
    k = torch.tensor([[3]])
    assert union_sizes(same, valid, k).item() == 3 and union_sizes(disjoint, valid, k).item() == 6
    assert union_overhead(build("keydiff"), make_obs(), 0.25) is None, "no per-query-head form"
    ratio = union_overhead(build("tova"), make_obs(W=1), 0.25)
    assert ratio.shape == (1, 2) and ((ratio >= 1) & (ratio <= 2)).all()


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_generates_with_the_context_compressed_first(llama_cm, recipe):
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    context, mask = left_padded_batch([60, 44], total=60, seed=4)
    question, _ = left_padded_batch([5, 5], total=5, seed=1)
    out = cm.generate(question, context_ids=context, context_mask=mask, max_new_tokens=4, eos_token_id=[])
    assert out.shape == (2, 9) and cm.cache_stats()["recipe"] == kvcompile.recipes()[recipe].tag


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_at_full_budget_is_the_plain_model(llama, llama_cm, recipe):
    assert_plain_at_full_budget(llama, llama_cm, recipe)


def test_scores_are_computed_on_what_the_cache_observed(llama_cm):
    """The scorers read a real Observation of the tiny model without producing NaN or touching invalid slots."""
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="h2o", page_size=4)
    ids, mask = left_padded_batch([50, 31], total=50)
    cm.prefill(ids, mask, compress=False)
    obs = observe(cm.cache, cm.programs.layers[1])
    for name in ["tova", "h2o", "keydiff", "expected-attention", "compactor", "jacap", "twinkv"]:
        scores = SCORERS[name]().score(obs)
        assert not scores[obs.valid].isnan().any(), name
