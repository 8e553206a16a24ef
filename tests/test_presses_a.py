"""kvpress presses by name (issue 16, part a): each scorer against a plain restatement of its formula
on fresh random inputs (the seed is printed; TEST_SEED=<seed> replays a failure), a property the section gives,
then each recipe end to end."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from conftest import assert_plain_at_full_budget, left_padded_batch, tiny_model
from test_scorers import MAX, LargestTensor, exact_leverage, make_obs

import kvcompile
from kvcompile.methods import SCORERS
from kvcompile.observation import observe

NEW = ["observed-attention", "lagkv", "noncausal-attention", "leverage-score", "cur", "cappress"]


@pytest.fixture
def seed():
    """A fresh seed per test, printed (pytest shows it when the test fails); TEST_SEED=<seed> replays one."""
    s = int(os.environ.get("TEST_SEED", random.randrange(2**31)))
    print(f"seed = {s}")
    return s


def zscore(x):
    return (x - x.mean()) / x.std(unbiased=False)


def cut_tails(obs, lengths):
    """Mark everything after lengths[b][h] tokens of head (b, h) as not held, and make it garbage."""
    for b, row in enumerate(lengths):
        for h, n in enumerate(row):
            obs.valid[b, h, n:] = False
            obs.keys[b, h, n:], obs.values[b, h, n:] = 1e3, -1e3
    return obs


# ----------------------------------------------------------------------------------- observed-attention
def visible(obs):
    """[B, Hq, W, S] which observed query sees which key: causal, within the sliding window, held."""
    G = obs.queries.shape[1] // obs.keys.shape[1]
    qp, kp = obs.query_positions[:, None, :, None], obs.positions.repeat_interleave(G, 1)[:, :, None, :]
    ok = (kp <= qp) & (qp >= 0) & obs.valid.repeat_interleave(G, 1)[:, :, None, :]
    return ok & (qp - kp < obs.window) if obs.window else ok


def observed_attention_reference(obs):
    """[B, Hkv, S] column sums of the dense attention matrix over the observed queries, divided by how many of
    them see each key, mean over the group."""
    see = visible(obs)
    B, Hkv, S = obs.valid.shape
    G = obs.queries.shape[1] // Hkv
    logits = obs.queries.float() @ obs.keys.float().repeat_interleave(G, 1).transpose(-1, -2) * obs.scale
    attn = torch.softmax(logits.masked_fill(~see, float("-inf")), -1).nan_to_num(0.0)
    return (attn.sum(2) / see.sum(2).clamp_min(1)).reshape(B, Hkv, G, S).mean(2)


@pytest.mark.parametrize("S, W, window", [(24, 24, 0), (24, 10, 0), (24, 24, 5)])
def test_observed_attention_is_the_mean_attention_a_key_received(seed, S, W, window):
    obs = make_obs(B=2, S=S, W=W, seed=seed)
    obs.window = window
    torch.testing.assert_close(SCORERS["observed-attention"](block=4).score(obs), observed_attention_reference(obs))


def test_observed_attention_on_a_real_sliding_window_layer():
    """Gemma-3's first layer attends within 6 positions: only the queries inside that window count."""
    cm = kvcompile.apply(tiny_model("gemma3"), budget=1.0, recipe="observed-attention", page_size=4)
    ids, mask = left_padded_batch([40, 27], total=40, seed=7)
    cm.prefill(ids, mask, compress=False)
    obs = observe(cm.cache, cm.programs.layers[0])
    assert obs.window == 6
    scores = SCORERS["observed-attention"]().score(obs)
    torch.testing.assert_close(scores[obs.valid], observed_attention_reference(obs)[obs.valid])


def test_observed_attention_of_uniform_attention_is_the_harmonic_closed_form():
    n = 30
    obs = make_obs(S=n, queries=torch.zeros(1, 4, n, 8))  # every logit 0: A[i, j] = 1 / (i + 1)
    harmonic = torch.cat([torch.zeros(1), (1 / torch.arange(1, n + 1.0)).cumsum(0)])  # H_0 .. H_n
    j = torch.arange(n)
    expected = (harmonic[n] - harmonic[j]) / (n - j)
    scores = SCORERS["observed-attention"]().score(obs)
    torch.testing.assert_close(scores[0, 0], expected)
    assert (scores[0, 0].diff() < 0).all(), "strictly decreasing in j"


def test_observed_attention_ignores_unheld_keys_and_missing_queries(seed):
    obs = cut_tails(make_obs(S=40, seed=seed), [[30, 30]])
    obs.query_positions = obs.query_positions.masked_fill(obs.query_positions >= 30, -1)
    short = make_obs(S=30, seed=seed, keys=obs.keys[:, :, :30], values=obs.values[:, :, :30],
                     queries=obs.queries[:, :, :30])
    scorer = SCORERS["observed-attention"]()
    torch.testing.assert_close(scorer.score(obs)[..., :30], scorer.score(short))


def test_observed_attention_never_builds_a_query_by_key_tensor():
    n = 1024
    obs = make_obs(S=n, D=4)
    with LargestTensor() as probe:
        SCORERS["observed-attention"](block=64).score(obs)
    assert probe.largest < n * n, f"largest tensor {probe.largest} elements"


# ---------------------------------------------------------------------------------------------- lagkv
def lagkv_reference(keys, values, n, sink, L, cross):
    """(scores, kept) of one head's first n tokens, written out partition by partition."""
    scores, kept = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    kept[:sink] = True
    if n < sink + 2 * L:
        scores[sink:] = (torch.arange(sink, n) - sink) / (n - sink)
        return scores, kept
    P = (n - sink) // L
    for p in range(P - 1):
        this, ref = slice(sink + p * L, sink + (p + 1) * L), slice(sink + (p + 1) * L, sink + (p + 2) * L)
        s = 0
        for x in (keys, values):
            low, high = x[ref].min(0).values, x[ref].max(0).values
            s = s + torch.softmax(((x[this] - low) / (high - low)).std(-1), 0) / 2
        scores[this] = s if cross else torch.tensor([float((s < v).sum()) for v in s]) / L
    kept[sink + (P - 1) * L :] = True
    return scores, kept


@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_matches_the_partition_by_partition_reference(seed, cross):
    sink, L, S = 3, 5, 34
    lengths = [[34, 27], [12, 23]]  # every head its own length: full, a remainder, too short, exactly 4 partitions
    obs = cut_tails(make_obs(B=2, S=S, seed=seed), lengths)
    scores = SCORERS["lagkv"](n_sink=sink, lag_size=L, cross_scoring=cross).score(obs)
    for b, row in enumerate(lengths):
        for h, n in enumerate(row):
            ref, kept = lagkv_reference(obs.keys[b, h], obs.values[b, h], n, sink, L, cross)
            got = scores[b, h, :n]
            assert ((got == MAX) == kept).all(), (b, h)
            torch.testing.assert_close(got[~kept], ref[~kept], msg=f"head {(b, h)}")


def test_lagkv_keeps_about_as_many_tokens_of_every_scored_partition(seed):
    sink, L, P = 4, 16, 9
    obs = make_obs(S=sink + P * L + 7, seed=seed)
    scores = SCORERS["lagkv"](n_sink=sink, lag_size=L).score(obs)
    free = scores != MAX
    assert free.sum(-1).eq((P - 1) * L).all(), "partitions 0 .. P-2 are scored, the rest kept"
    for k in (13, 40, 77):
        top = scores.masked_fill(~free, float("-inf")).topk(k, -1).indices  # [B, Hkv, k]
        per_part = torch.stack([((top - sink) // L == p).sum(-1) for p in range(P - 1)])
        assert (per_part.amax(0) - per_part.amin(0) <= 1).all(), f"k = {k}: {per_part.flatten(1).T.tolist()}"


# ------------------------------------------------------------------------- noncausal-attention, leverage-score
def test_noncausal_attention_matches_chunked_attention_written_out(seed):
    B, Hkv, G, S, C = 2, 2, 2, 21, 8
    obs = cut_tails(make_obs(B=B, Hkv=Hkv, G=G, S=S, seed=seed), [[21, 17], [11, 21]])
    scores = SCORERS["noncausal-attention"](chunk=C).score(obs)
    for b in range(B):
        for h in range(Hkv):
            n = int(obs.valid[b, h].sum())
            k, v = obs.keys[b, h, :n], obs.values[b, h, :n]
            mass = torch.zeros(n)
            for g in range(G):
                q = obs.queries[b, h * G + g]  # query i sits at position i (every position of the row has one)
                for start in range(0, n, C):
                    held, asking = slice(start, min(start + C, n)), slice(start, min(start + C, S))
                    mass[held] += torch.softmax(q[asking] @ k[held].T * obs.scale, -1).sum(0) / G
            mass = mass * v.norm(dim=-1)
            padded = torch.nn.functional.pad(mass, (1, 1))
            counts = torch.full((n,), 3.0)
            counts[[0, -1]] = 2.0
            smooth = (padded[:-2] + padded[1:-1] + padded[2:]) / counts
            torch.testing.assert_close(scores[b, h, :n], zscore(smooth), msg=f"head {(b, h)}")


def test_leverage_score_is_the_z_scored_exact_leverage_of_the_centred_keys(seed):
    obs = cut_tails(make_obs(B=2, S=40, D=8, seed=seed), [[40, 25], [33, 40]])
    scores = SCORERS["leverage-score"](seed=seed).score(obs)
    for b in range(2):
        for h in range(2):
            n = int(obs.valid[b, h].sum())
            ref = zscore(exact_leverage(obs.keys[b, h, :n])).float()  # a sketch of 48 spans all 8 dimensions
            torch.testing.assert_close(scores[b, h, :n], ref, rtol=1e-4, atol=1e-4, msg=f"head {(b, h)}")


def _without_sinks(obs, first: int = 8, last: int = 4):
    """kvpress's slice of the Compactor's sinks, as an Observation: their keys invalid, their queries gone,
    positions counted from the first token after the first sinks."""
    newest = obs.positions.masked_fill(~obs.valid, -1).amax((-1, -2))
    sink = (obs.positions < first) | (obs.positions > newest[:, None, None] - last)
    qp = obs.query_positions
    q_sink = (qp < first) | (qp > newest[:, None] - last) | (qp < 0)
    return dataclasses.replace(obs, positions=obs.positions - first, valid=obs.valid & ~sink,
                               query_positions=torch.where(q_sink, -1, qp - first)), sink


def test_compactor_is_the_blend_of_its_two_components_over_the_tokens_between_its_sinks(seed):
    obs = make_obs(B=2, S=50, seed=seed)
    compactor = SCORERS["compactor"](chunk=16, seed=seed, blending=0.35)
    core, sink = _without_sinks(obs)
    parts = (0.35 * SCORERS["leverage-score"](seed=seed).score(core)
             + SCORERS["noncausal-attention"](chunk=16).score(core))
    blend = compactor.score(obs)
    free = blend != MAX
    assert free.sum(-1).eq(50 - 8 - 4).all() and torch.equal(free, ~sink)
    torch.testing.assert_close(blend[free], parts[free])


def test_compactor_sinks_do_not_move_the_other_tokens_scores(seed):
    """kvpress slices the sinks out before scoring: a sink key a hundred times longer (a real attention sink)
    changes no other token's score."""
    obs = make_obs(B=1, S=60, seed=seed)
    compactor = SCORERS["compactor"](chunk=16, seed=seed)
    before = compactor.score(obs)
    keys, values = obs.keys.clone(), obs.values.clone()
    keys[:, :, 0] *= 100
    values[:, :, 0] *= 100
    queries = obs.queries.clone()
    queries[:, :, (obs.query_positions[0] >= 56).nonzero()[:, 0]] *= 50  # the last sinks' queries too
    after = compactor.score(dataclasses.replace(obs, keys=keys, values=values, queries=queries))
    free = before != MAX
    torch.testing.assert_close(after[free], before[free], msg=f"seed {seed}")


# ------------------------------------------------------------------------------------------------ cur
def cur_reference(keys, values, positions, w, how, sinks):
    """One head's scores over its n held tokens: window shares of ||k||^2 and ||v||^2, combined, normalised."""
    def local(x):
        return torch.cat([c / c.sum() for c in x.split(w)]) if w else x

    k, v = local(keys.pow(2).sum(-1)), local(values.pow(2).sum(-1))
    s = {"key": k, "value": v, "kv_avg": (k + v) / 2, "kv_product": k * v}[how]
    return (s / s.sum()).masked_fill(positions < sinks, MAX)


@pytest.mark.parametrize("how", ["key", "value", "kv_avg", "kv_product"])
@pytest.mark.parametrize("local", [True, False])
def test_cur_matches_the_window_normalised_energies(seed, how, local):
    lengths = [[37, 16], [9, 40]]
    obs = cut_tails(make_obs(B=2, S=40, seed=seed), lengths)
    scorer = SCORERS["cur"](leverage_type=how, use_local_approximation=local, local_window_size=8)
    scores = scorer.score(obs)
    for b, row in enumerate(lengths):
        for h, n in enumerate(row):
            ref = cur_reference(obs.keys[b, h, :n], obs.values[b, h, :n], obs.positions[b, h, :n], 8 if local else 0,
                                how, 4)
            torch.testing.assert_close(scores[b, h, :n], ref, msg=f"head {(b, h)}")


def test_cur_ignores_the_scale_of_a_window_and_ranks_by_kv_energy_without_windows(seed):
    obs = make_obs(S=48, seed=seed)
    scaled = make_obs(S=48, keys=obs.keys.clone(), values=obs.values, queries=obs.queries)
    scaled.keys[:, :, 16:32] *= 7.0
    local = SCORERS["cur"]()
    torch.testing.assert_close(local.score(scaled), local.score(obs))
    whole = SCORERS["cur"](local_window_size=48).score(obs)[..., 4:]
    energy = (obs.keys.pow(2).sum(-1) * obs.values.pow(2).sum(-1))[..., 4:]
    assert (whole.argsort(-1) == energy.argsort(-1)).all()


# ------------------------------------------------------------------------------------------- cappress
def cappress_reference(obs, tau, sink, eps):
    """[B, Hq, S] w_j v_j' A^-1 v_j per query head, with A written out and inverted (float64)."""
    B, Hq, _, D = obs.queries.shape
    G = Hq // obs.keys.shape[1]
    out = torch.zeros(B, Hq, obs.keys.shape[2], dtype=torch.float64)
    for b in range(B):
        for r in range(Hq):
            held = obs.valid[b, r // G] & (obs.positions[b, r // G] >= sink)
            k, v = obs.keys[b, r // G][held].double(), obs.values[b, r // G][held].double()
            mu = obs.queries[b, r][obs.query_positions[b] >= sink].double().mean(0)
            c = (k @ mu / (k.norm(dim=-1) * mu.norm())).clamp(-1, 1)
            w = torch.exp(tau * c - (tau * c).max())
            A = torch.eye(D, dtype=torch.float64) + ((w + eps)[:, None] * v).T @ v
            out[b, r, held] = w * ((v @ torch.linalg.inv(A)) * v).sum(-1)
    return out


def test_cappress_matches_the_capacity_matrix_written_out(seed):
    obs = cut_tails(make_obs(B=2, S=30, seed=seed), [[30, 19], [25, 30]])  # queries at the sinks too
    scorer = SCORERS["cappress"](tau=5.0, n_sink=4, epsilon=1e-3)
    ref = cappress_reference(obs, 5.0, 4, 1e-3).float()
    per_head = scorer.score_per_query_head(obs)
    scored = (obs.valid & (obs.positions >= 4)).repeat_interleave(2, 1)
    torch.testing.assert_close(per_head[scored], ref[scored], rtol=1e-4, atol=1e-6)
    assert (per_head[:, :, :4] == MAX).all()
    pooled = scorer.score(obs)
    torch.testing.assert_close(pooled[..., 4:], ref.reshape(2, 2, 2, -1).mean(2)[..., 4:], rtol=1e-4, atol=1e-6)


def test_cappress_capacity_identity(seed):
    """sum_j (w_j + eps) l_j = D - tr(A^-1) with l_j = score_j / w_j, and every l_j < 1 / (w_j + eps)."""
    tau, eps, D = 5.0, 1e-2, 8
    obs = make_obs(Hkv=1, G=1, S=40, D=D, W=16, seed=seed)
    scores = SCORERS["cappress"](tau=tau, n_sink=0, epsilon=eps).score(obs)[0, 0].double()
    k, v, mu = obs.keys[0, 0].double(), obs.values[0, 0].double(), obs.queries[0, 0].double().mean(0)
    c = k @ mu / (k.norm(dim=-1) * mu.norm())
    w = torch.exp(tau * c - (tau * c).max())
    A = torch.eye(D, dtype=torch.float64) + ((w + eps)[:, None] * v).T @ v
    lev = scores / w
    torch.testing.assert_close(((w + eps) * lev).sum(), D - torch.linalg.inv(A).trace(), rtol=1e-4, atol=1e-5)
    assert (lev < 1 / (w + eps)).all()


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("recipe", NEW)
def test_recipe_compresses_within_the_budget_and_generates(llama_cm, recipe):
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([300, 170], total=300, seed=5)  # lagkv scores partitions from 260 tokens on
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] < stats["bytes_full"]
    assert stats["recipe"] == kvcompile.recipes()[recipe].tag
    assert torch.isfinite(cm.decode(ids[:, -1:])).all()


@pytest.mark.parametrize("recipe", NEW)
def test_recipe_at_full_budget_is_the_plain_model(llama, llama_cm, recipe):
    assert_plain_at_full_budget(llama, llama_cm, recipe)


def test_observed_attention_keeps_the_top_of_the_plain_models_own_attention(llama):
    """Against the plain model's eager attention matrices, as kvpress reads them: per (layer, KV head), the kept
    tokens are the top quarter by column sum / (n - j), mean over the group."""
    n, L, Hkv = 64, 3, 2
    ids, _ = left_padded_batch([n], total=n, seed=6)
    cm = kvcompile.apply(llama, budget=0.25, recipe="observed-attention", page_size=1)
    cm.prefill(ids)
    eager = tiny_model("llama", layers=L)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attn = torch.stack(eager(ids, output_attentions=True).attentions)[:, 0]  # [L, Hq, n, n]
    ref = (attn.sum(2) / torch.arange(n, 0, -1)).reshape(L, Hkv, -1, n).mean(2)
    for layer in range(L):
        _, _, pos, valid = cm.cache.dense(layer)
        for h in range(Hkv):
            kept = set(pos[0, h][valid[0, h]].tolist())
            assert kept == set(ref[layer, h].topk(n // 4).indices.tolist()), f"layer {layer}, head {h}"
