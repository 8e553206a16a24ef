"""AnchorKV (docs/methods_formats.md#anchorkv): its residual codec within its bound, attention over its rows against the
dense oracle, and the recipe through the public API: every token held, anchors exact, bytes (tables included) within the
budget, residuals spent where the budget allows, clear refusals, compiled and eager alike."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_seed, left_padded_batch, tiny_model
from test_formats import check_attention_over_both, outlier_rows

import kvcompile
from kvcompile.kernels import anchored, reference
from kvcompile.methods.anchorkv import AnchorKV, nearest
from kvcompile.methods.base import Observation
from kvcompile.methods.rope import rotate
from kvcompile.methods.snapkv import SnapKV
from kvcompile.recipes import Recipe, get_recipe


@pytest.mark.parametrize("D", [16, 64])
def test_residuals_round_trip_within_their_bound(D):
    """Outlier channel and sink token: every residual's L2 error within the stated bound; a Gaussian residual keeps
    most of itself at 2 bits (Lloyd-Max: about 0.34 of its norm off); bytes as stated."""
    g = torch.Generator().manual_seed(fresh_seed())
    r = outlier_rows((4, 9, D), g)
    codes = anchored.encode_residuals(r)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == anchored.residual_bytes(D) == D // 4 + 2
    err = (anchored.decode_residuals(codes) - r).norm(dim=-1)
    bound = anchored.residual_error_bound(r)
    assert bool((err <= bound).all()), f"error {(err - bound).max()} above the bound"
    plain = torch.randn(200, D, generator=g)
    rel = (anchored.decode_residuals(anchored.encode_residuals(plain)) - plain).norm(dim=-1) / plain.norm(dim=-1)
    assert 0.2 < float(rel.mean()) < 0.45, float(rel.mean())


def test_nearest_anchor_by_absolute_cosine_and_its_scale():
    g = torch.Generator().manual_seed(fresh_seed())
    anchors = torch.randn(1, 1, 3, 8, generator=g)
    x = torch.stack([-2.5 * anchors[0, 0, 1], anchors[0, 0, 2] * 0.5 + 1e-3 * torch.randn(8, generator=g)])[None, None]
    index, gamma = nearest(x, anchors, torch.tensor([[[True, True, True]]]))
    assert index.tolist() == [[[1, 2]]]
    torch.testing.assert_close(gamma[0, 0, 0], torch.tensor(-2.5))
    index, _ = nearest(x, anchors, torch.tensor([[[True, False, True]]]))  # an absent anchor is never chosen
    assert index[0, 0, 0] != 1


def _observation(S=40, W=8, Hkv=2, G=2, D=8, seed=0) -> Observation:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, Hkv, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g)
    queries = torch.randn(1, Hkv * G, W, D, generator=g) * 2
    return Observation(keys, values, torch.arange(S).expand(1, Hkv, S), torch.ones(1, Hkv, S, dtype=torch.bool),
                       queries, torch.arange(S - W, S)[None], D**-0.5, 0, 0, 1)


def test_anchors_are_the_newest_then_the_snapkv_top_then_seeded_random():
    """k = max(window, S / per_anchor): the window's newest tokens, floor(0.7 (k - window)) of the rest by SnapKV's
    score (average pool), the others drawn at random, the same draw for the same seed."""
    seed = fresh_seed()
    obs = _observation(seed=seed)
    method = AnchorKV(window=4, per_anchor=4, seed=seed)
    chosen = method.anchors(obs)
    assert chosen.sum(-1).tolist() == [[10, 10]]  # max(4, 40 / 4)
    assert bool(chosen[..., 36:].all())
    score = SnapKV(4, 7, smoothing="avg").score(obs)[..., :36]
    top = score.topk(4, -1).indices  # floor(0.7 * 6) by score, the other 2 at random
    assert bool(chosen.gather(-1, top).all())
    assert torch.equal(AnchorKV(window=4, per_anchor=4, seed=seed).anchors(obs), chosen)


def test_utilities_are_the_formula_term_by_term():
    """AnchorKV's utilities against a loop over queries: keys (attention squared, logit change squared, ||v - y||^2),
    values (attention squared, residual squared), averaged over the group's observed queries."""
    obs = _observation(S=12, W=3, seed=fresh_seed())
    g = torch.Generator().manual_seed(1)
    rk, rv = torch.randn(obs.keys.shape, generator=g), torch.randn(obs.values.shape, generator=g)
    u_k, u_v = AnchorKV(window=3).utilities(obs, rk, rv)
    attn = obs.window_attention()
    want_k, want_v = torch.zeros_like(u_k), torch.zeros_like(u_v)
    Hkv, G = 2, 2
    for h in range(Hkv):
        for t in range(12):
            for qh in range(h * G, h * G + G):
                for w in range(3):
                    a = attn[0, qh, w]
                    y = a @ obs.values[0, h]
                    dl = float(obs.queries[0, qh, w] @ rk[0, h, t]) * obs.scale
                    want_k[0, h, t] += a[t] ** 2 * dl**2 * (obs.values[0, h, t] - y).square().sum() / (G * 3)
                    want_v[0, h, t] += a[t] ** 2 * rv[0, h, t].square().sum() / (G * 3)
    for got, want in ((u_k, want_k), (u_v, want_v)):  # fp32 sums in another order: 1e-5 of the largest term
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def anchored_pool(lengths, P: int, D: int, g: torch.Generator, A: int = 5, R: int = 7):
    """A one-layer ``anchor2`` pool of one row (random rows, anchors and residuals, RoPE on keys) whose heads hold
    ``lengths`` entries on shuffled pages, and each head's entries decoded by hand: (pages, heads)."""
    Hkv, width = len(lengths), max(2, -(-max(lengths) // P))
    ids = torch.randperm(Hkv * width, generator=g).reshape(1, Hkv, width) + 1
    N = Hkv * width + 1
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    tables = torch.randn(2, 1, Hkv, 1 + A, D, generator=g)
    tables[0, :, :, 0] = torch.cat([inv_freq, torch.zeros(D // 2)])
    tables[1, :, :, 0] = 0
    rows = torch.randn(2, R, D, generator=g)
    residuals = anchored.encode_residuals(rows)[:, None]  # [2, 1, R, W]
    index = torch.randint(0, A, (2, N, P), generator=g)
    gamma = torch.randn(2, N, P, generator=g).half()
    slot = torch.randint(-1, R, (2, N, P), generator=g)
    codes = anchored.encode_rows(index, gamma, slot)
    meta = torch.zeros(N, P, 0)
    pos = torch.zeros(N, P, dtype=torch.int32)
    for h in range(Hkv):
        pos[ids[0, h]] = torch.arange(width * P).view(width, P).int()
    stored = reference.FormatPages(codes[0], meta, codes[1], meta, pos, ids.int(), torch.tensor([lengths]).int(),
                                   None, tables, residuals)
    heads = []
    for h, n in enumerate(lengths):
        flat = (ids[0, h, :, None] * P + torch.arange(P)).flatten()[:n]
        parts = []
        for part in (0, 1):
            i, s = index[part].flatten()[flat], slot[part].flatten()[flat]
            x = gamma[part].flatten()[flat].float()[:, None] * tables[part, 0, h, 1 + i]
            x = x + anchored.decode_residuals(residuals[part, 0, s.clamp_min(0)]) * (s >= 0)[:, None]
            parts.append(rotate(x, pos.flatten()[flat].long(), inv_freq) if part == 0 else x)
        heads.append((*parts, pos.flatten()[flat].long()))
    return stored, heads


@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("T, window", [(1, 0), (1, 5), (4, 0), (4, 7)])
def test_attention_over_anchored_and_dtype_pages_equals_dense_attention_over_both(P, T, window):
    """Heads of lengths 1, P and P + 1 in the anchored pool (ragged ones in the model-dtype pool), GQA, prefill and
    decode: attention equals one softmax over the rows decoded by hand (anchor scaled, residual, RoPE) and the
    model-dtype entries."""
    check_attention_over_both(anchored_pool, P, T, window)


# --------------------------------------------------------------------------- through the public API
def _prompt():
    return left_padded_batch([300, 250], total=300, seed=3)


def _held(cm, layer: int, S: int = 300):
    """Layer ``layer``'s keys, values, positions and valid entries, as the cache holds them, over S slots."""
    return tuple(x[:, :, :S] for x in cm.cache.dense(layer))


def test_anchorkv_holds_every_token_within_the_budget_tables_included(llama_cm):
    """By name, at three budgets: every token held in anchor pages; bytes held (rows, anchors, residual slots) within
    the budget and all of what the cache allocated reported; the 32 newest tokens (anchors) exact; more budget buys
    residuals, which bring the rest closer to the full cache's keys and values; decoded tokens go to the model dtype."""
    ids, mask = _prompt()
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    full.prefill(ids, mask)
    errors, tables = {}, {}
    for budget in (1.0, 0.3, 0.27):
        cm = kvcompile.apply(llama_cm, budget=budget, recipe="anchorkv", page_size=4)
        cm.prefill(ids, mask)
        stats = cm.cache_stats()
        pool = stats["formats"]["anchor2"]
        assert pool["tokens"] == stats["tokens_held"] == int(mask.sum()) * 3 * 2, "nothing is evicted"
        assert stats["bytes_held"] == pool["codes"] + pool["meta"] + pool["tables"]
        assert stats["bytes_held"] <= (stats["budget_bytes"] or stats["bytes_full"])
        assert stats["bytes_allocated"] == sum(t.nbytes for t, _ in cm.cache.tensors().values())
        err = 0.0
        for layer in range(3):
            got, want = _held(cm, layer), _held(full, layer)
            assert torch.equal(got[3], want[3]) and torch.equal(got[2][got[3]], want[2][want[3]])
            newest = (got[2] >= mask.sum(1).view(2, 1, 1) - 32) & got[3]
            for x, y in zip(got[:2], want[:2]):
                torch.testing.assert_close(x[newest], y[newest], atol=1e-5, rtol=1e-5)
                err += float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-6))[got[3]].mean())
        errors[budget], tables[budget] = err, pool["tables"]
        if budget == 1.0:
            cm.generate(ids, mask, max_new_tokens=3, eos_token_id=[])
            assert cm.cache_stats()["formats"]["float32"]["tokens"] == 2 * 2 * 3 * 2
    assert tables[1.0] > tables[0.3] > tables[0.27], tables
    assert errors[1.0] < errors[0.3] < errors[0.27], errors


def test_anchorkv_refuses_a_budget_its_anchors_do_not_fit_and_leaves_the_cache(llama_cm):
    ids, mask = _prompt()
    cm = kvcompile.apply(llama_cm, budget=0.3, recipe="anchorkv", page_size=4)
    cm.prefill(ids, mask)
    before = cm.cache_stats()
    low = kvcompile.apply(cm, budget=0.1, recipe="anchorkv", page_size=4)
    with pytest.raises(ValueError, match="AnchorKV's anchors and the rows of every token need .* bytes"):
        low.prefill(ids, mask)
    assert int(low.cache.held().sum()) == 0, "the refused prompt wrote nothing"
    assert cm.cache_stats() == before


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_anchorkv_on_a_hybrid_model_and_a_single_kv_head(family):
    """Gemma-3's sliding layers rotate keys with their own frequencies (each layer's table row holds its own);
    Qwen3 has one KV head: every token held, bytes within the budget, the newest tokens exact."""
    model = tiny_model(family)
    ids, mask = _prompt()
    full = kvcompile.apply(model, budget=1.0, recipe="full", page_size=4)
    full.prefill(ids, mask)
    cm = kvcompile.apply(model, budget=0.35, recipe="anchorkv", page_size=4)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["formats"]["anchor2"]["tokens"] == stats["tokens_held"] == int(mask.sum()) * 2 * cm.spec.num_kv_heads
    assert stats["bytes_held"] <= stats["budget_bytes"]
    for layer in range(2):
        got, want = _held(cm, layer), _held(full, layer)
        newest = (got[2] >= mask.sum(1).view(2, 1, 1) - 32) & got[3]
        torch.testing.assert_close(got[0][newest], want[0][newest], atol=1e-4, rtol=1e-4)


def test_a_chunked_prefill_encodes_everything_read_so_far_again(llama_cm):
    """Each chunk's compression reads the rows stored so far back (decoded) and encodes every token against new
    anchors: all tokens held, within the budget."""
    ids, mask = _prompt()
    cm = kvcompile.apply(llama_cm, budget=0.3, recipe="anchorkv", page_size=4, prefill_chunk=128)
    cm.generate(ids, mask, max_new_tokens=2, eos_token_id=[])
    stats = cm.cache_stats()
    assert stats["formats"]["anchor2"]["tokens"] == int(mask.sum()) * 3 * 2
    assert stats["bytes_held"] <= stats["budget_bytes"] + 2 * 2 * 3 * 2 * cm.cache.token_bytes  # + 2 decoded tokens


def test_anchor_pages_refuse_what_cannot_go_with_them():
    for kwargs in ({"scorer": "snapkv"}, {"scorer": None, "precise_recent": 8}):
        with pytest.raises(ValueError, match="anchor2 pages hold every token"):
            Recipe("x", format="anchor2", **kwargs)
    with pytest.raises(ValueError, match="anchor2 pages hold every token"):
        get_recipe("snapkv+anchor2")


@pytest.mark.slow
def test_anchorkv_compiled_generates_what_eager_does_without_recompiling_per_length(llama_cm):
    """The tables are program inputs whose anchor and slot counts vary with the prompt: marked dynamic, so a second
    prompt length reuses the compiled programs."""
    import torch._dynamo.utils as dynamo_utils

    ids, mask = left_padded_batch([40, 25], total=40)
    eager = kvcompile.apply(llama_cm, budget=1.0, recipe="anchorkv", page_size=4)
    compiled = kvcompile.apply(llama_cm, budget=1.0, recipe="anchorkv", page_size=4, compile=True)
    want = eager.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(compiled.generate(ids, mask, max_new_tokens=6, eos_token_id=[]), want)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    other = left_padded_batch([48, 70], total=70, seed=4)
    assert torch.equal(compiled.generate(*other, max_new_tokens=6, eos_token_id=[]),
                       eager.generate(*other, max_new_tokens=6, eos_token_id=[]))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "another prompt length recompiled"
