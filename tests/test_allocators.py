"""Allocators: every recipe holds its budget; each allocator's defining property on a constructed case."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, fresh_seed, left_padded_batch, tiny_model

import kvcompile
from kvcompile.calibration import catekv as catekv_calibration
from kvcompile.calibration import ripplekv as ripplekv_calibration
from kvcompile.calibration import sgdkv as sgdkv_calibration
from kvcompile.methods import Observation, base, catekv, certkv, page_entrokv, ripplekv, sgdkv, shares
from kvcompile.methods.contourkv import ContourKV
from kvcompile.observation import observe

MINE = ["contourkv", "contourkv-balancing", "certkv", "page-entrokv", "ripplekv", "sgd-kv", "catekv"]


def _observation(B=1, Hkv=2, G=2, S=40, W=4, D=8, seed=0) -> Observation:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    positions = torch.arange(S).expand(B, Hkv, S)
    queries = torch.randn(B, Hkv * G, W, D, generator=g) * 2
    q_pos = torch.arange(S - W, S).expand(B, W)
    valid = torch.ones(B, Hkv, S, dtype=torch.bool)
    return Observation(keys, values, positions, valid, queries, q_pos, D**-0.5, 0, 0, 1)


def _attend(q, keys, values, visible, scale, log_weights=None):
    """Attention output [B, Hkv, D] of one query per head q [B, Hkv, D] over keys, values [B, Hkv, S, D] whose
    entries stand for exp(log_weights) [B, Hkv, S] tokens each (None: one)."""
    logits = torch.einsum("bhd,bhsd->bhs", q, keys.float()) * scale
    if log_weights is not None:
        logits = logits + log_weights
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("bhs,bhsd->bhd", probs, values.float())


@pytest.mark.parametrize("recipe", MINE)
def test_full_budget_keeps_everything_and_reproduces_logits(llama_cm, recipe):
    """At budget 1.0 the recipe runs uncompressed; and compressing to a budget that holds every token (the
    allocator's own decision, page rounding included) keeps every token: the next logits match the full cache."""
    ids, _ = left_padded_batch([70, 70], total=70)
    full = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    ref, ref_next = full.prefill(ids), full.decode(ids[:, -1:])
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe=recipe, page_size=4)
    assert torch.equal(cm.prefill(ids), ref)
    held = cm.cache_stats()["bytes_held_per_sequence"][0]  # both rows hold the same
    cm = kvcompile.apply(llama_cm, budget=f"{held}B", recipe=recipe, page_size=4)
    cm.prefill(ids)
    assert (cm.cache.lengths == 70).all(), "a budget that holds everything must evict nothing"
    torch.testing.assert_close(cm.decode(ids[:, -1:]), ref_next)


# ---------------------------------------------------------------------------------------------- contourkv
def _constructed_scores(L=3, B=2, Hkv=4, S=50, seed=0):
    """Heads from flat to peaked (attention-like, >= 0), some shorter than others; [L, B, Hkv, S] and lengths."""
    g = torch.Generator().manual_seed(seed)
    sharp = torch.linspace(0.5, 6.0, L * Hkv).reshape(L, 1, Hkv, 1)
    scores = torch.softmax(torch.randn(L, B, Hkv, S, generator=g) * sharp, -1)
    lengths = torch.randint(S // 2, S + 1, (L, B, Hkv), generator=g)
    held = torch.arange(S) < lengths[..., None]
    return scores.masked_fill(~held, float("-inf")), lengths


def _sorted_mass(scores):
    mass, _ = shares.attention_mass(scores)
    a = mass.sort(-1, descending=True).values
    dropped = 1 - torch.cat([torch.zeros_like(a[..., :1]), a.cumsum(-1)], -1)  # D(b), b = 0..S
    return a, dropped


def test_pooled_rank_is_the_plain_rank_without_ties_and_round_robin_with_them():
    scores = torch.randn(3, 4, 10)
    plain = scores.flatten(-2).argsort(-1, descending=True).argsort(-1)
    assert torch.equal(base.pooled_rank(scores), plain)
    pinned = torch.tensor([[9.0, 9.0, 1.0], [9.0, 9.0, 0.0]])
    assert base.pooled_rank(pinned).tolist() == [0, 2, 4, 1, 3, 5]


@pytest.mark.parametrize("name", ["adakv", "global-topk"])
def test_pins_beyond_the_budget_are_split_evenly_between_heads(name):
    """Every token pinned (``protect``) and room for half: each head keeps half, not the first head all of it."""
    L, B, Hkv, S = 2, 1, 4, 16
    scores = base.protect(torch.randn(L, B, Hkv, S), torch.ones(L, B, Hkv, S, dtype=torch.bool))
    lengths = torch.full((L, B, Hkv), S, dtype=torch.int32)
    kept = kvcompile.methods.ALLOCATORS[name]().allocate(scores, lengths, torch.tensor([L * Hkv * S // 2]))
    assert (kept == S // 2).all(), kept.flatten().tolist()


def test_contourkv_equalises_dropped_mass_within_one_token():
    scores, lengths = _constructed_scores()
    budget = torch.tensor([150, 320])
    counts = ContourKV().allocate(scores, lengths, budget)
    assert torch.equal(counts.sum((0, 2)), budget) and (counts <= lengths).all()
    a, dropped = _sorted_mass(scores)
    after = dropped.gather(-1, counts[..., None])[..., 0]  # what each head drops
    before = dropped.gather(-1, (counts - 1).clamp_min(0)[..., None])[..., 0]  # ... had it kept one token fewer
    for b in range(2):
        worst_kept = after[:, b].max()
        one_fewer = before[:, b][counts[:, b] > 0].min()
        assert worst_kept <= one_fewer + 1e-6, "some head drops more than another head would with one token fewer"
    spread = after.amax((0, 2)) - after.amin((0, 2))
    assert (spread <= a.amax((0, 2, 3)) + 1e-6).all(), "dropped masses differ by more than one token's mass"


def test_contourkv_balancing_keeps_everything_above_one_mass_level():
    scores, lengths = _constructed_scores(seed=1)
    counts = ContourKV(variant="balancing").allocate(scores, lengths, torch.tensor([150, 320]))
    a, _ = _sorted_mass(scores)
    last_kept = a.gather(-1, (counts - 1).clamp_min(0)[..., None])[..., 0].masked_fill(counts == 0, float("inf"))
    first_dropped = a.gather(-1, counts.clamp_max(a.shape[-1] - 1)[..., None])[..., 0].masked_fill(counts >= lengths, 0)
    assert (first_dropped.amax((0, 2)) <= last_kept.amin((0, 2)) + 1e-7).all()


# ---------------------------------------------------------------------------------------------- certkv
@pytest.mark.parametrize("weighted", [False, True], ids=["tokens", "weighted-tail"])
def test_certkv_summary_is_exact_for_its_query(weighted):
    """One weighted entry (mean key and value, log-weight the tail's log-mass less the mean key's logit) gives the
    reference query its attention over the full cache; the same entry at weight 1 does not. A tail that holds
    weighted entries (an earlier summary) is counted with their weights."""
    obs = _observation(B=2, Hkv=2, G=3, S=40)
    g = torch.Generator().manual_seed(1)
    if weighted:
        obs.log_weights = torch.rand(2, 2, 40, generator=g) * 3
    evicted = torch.rand(2, 2, 40, generator=g) < 0.6
    key, value, position, log_weight = certkv.CertKV().summarize(obs, evicted)
    q = certkv.reference_query(obs)
    full = _attend(q, obs.keys, obs.values, obs.valid, obs.scale, obs.log_weights)
    kept_k = torch.cat([obs.keys, key[:, :, None]], 2)
    kept_v = torch.cat([obs.values, value[:, :, None]], 2)
    visible = torch.cat([obs.valid & ~evicted, torch.ones(2, 2, 1, dtype=torch.bool)], 2)
    lw = torch.zeros(2, 2, 40) if obs.log_weights is None else obs.log_weights
    summary_lw = torch.cat([lw, log_weight[:, :, None]], 2)
    torch.testing.assert_close(_attend(q, kept_k, kept_v, visible, obs.scale, summary_lw), full, atol=1e-6, rtol=1e-5)
    assert torch.equal(position, torch.full((2, 2), 39))
    assert (log_weight > 0).all(), "a visible tail of several tokens weighs more than one token"
    unweighted = torch.cat([lw, torch.zeros(2, 2, 1)], 2)
    assert not torch.allclose(_attend(q, kept_k, kept_v, visible, obs.scale, unweighted), full, atol=1e-4), \
        "the weight matters"


@pytest.mark.parametrize("turns", [1, 2], ids=["one-turn", "over-summaries"])
def test_certkv_cache_summary_row_reproduces_the_evicted_tail(llama_cm, turns):
    """After compression the summary entry sits right after the kept tokens, at the head's latest position, and
    the reference query's attention over the compressed cache (log-weights included) equals its attention over the
    full cache; also when the cache already held an earlier turn's summaries, which count with their weights."""
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="certkv", page_size=4)
    ids, mask = left_padded_batch([160, 120], total=160)
    if turns == 2:  # a first turn compressed: its summaries are held when the second turn is compressed
        cm.prefill(ids[:, :80], mask[:, :80])
        ids, mask = ids[:, 80:], mask[:, 80:]
    cm.prefill(ids, mask, compress=False)
    before = [observe(cm.cache, layer) for layer in cm.programs.layers]
    assert (turns == 2) == any(obs.log_weights.any() for obs in before)
    lengths = cm.cache.lengths.clone()
    cm.compress()
    assert (cm.cache.lengths < lengths).all()
    assert cm.cache_stats()["bytes_held"] <= cm.cache_stats()["budget_bytes"]
    for layer, obs in enumerate(before):
        q = certkv.reference_query(obs)
        keys, values, positions, valid = cm.cache.dense(layer)
        full = _attend(q, obs.keys, obs.values, obs.valid, obs.scale, obs.log_weights)
        compressed = _attend(q, keys, values, valid, obs.scale, cm.cache.log_weights(layer))
        torch.testing.assert_close(compressed, full, atol=1e-6, rtol=1e-5)
        last = (cm.cache.lengths[layer].long() - 1)[..., None]
        assert torch.equal(positions.gather(-1, last)[..., 0], obs.positions.masked_fill(~obs.valid, -1).amax(-1))


def test_certkv_gives_slots_to_dispersed_tails_and_meets_the_budget_exactly():
    """Two heads with the same scores: one whose values are all alike (its summary is exact, it needs no real
    slot beyond the summary) and one with scattered values, which takes every real slot."""
    obs = _observation(B=1, Hkv=2, G=1, S=30)
    obs.values[0, 0] = 1.0  # head 0: every value the same
    scores = torch.softmax(torch.randn(1, 2, 30, generator=torch.Generator().manual_seed(2)), -1)
    allocator = certkv.CertKV()
    stats = allocator.layer_stats(obs, scores)
    assert torch.allclose(stats[0, 0], torch.zeros(31), atol=1e-5) and (stats[0, 1, :-2] > 0).all()
    counts = allocator.allocate(scores[None], torch.full((1, 1, 2), 30), torch.tensor([20]), stats[None])
    assert counts.sum() == 20, "the integer budget is met exactly"
    assert counts[0, 0, 0] == 1 and counts[0, 0, 1] == 19, counts.tolist()


# ---------------------------------------------------------------------------------------------- page-entrokv
def test_page_entrokv_keeps_whole_pages_shared_by_the_group(llama_cm):
    P = 4
    cm = kvcompile.apply(llama_cm, budget=0.3, recipe="page-entrokv", page_size=P)
    ids, _ = left_padded_batch([70, 70], total=70, seed=3)
    cm.prefill(ids, compress=False)
    expected = []
    for layer in cm.programs.layers:
        obs = observe(cm.cache, layer)
        s = cm.scorer.score(obs)[..., :70].masked_fill(~obs.valid[..., :70], float("-inf"))
        expected.append(torch.nn.functional.pad(s, (0, 2), value=float("-inf")).unflatten(-1, (18, P)).amax(-1))
    cm.compress()  # budget 0.3 of the 70 tokens each row read
    for layer in range(3):
        _, _, positions, valid = cm.cache.dense(layer)
        for b in range(2):
            for h in range(2):
                kept = positions[b, h][valid[b, h]]
                pages = kept.div(P, rounding_mode="floor").unique()
                whole = torch.cat([torch.arange(p * P, min(p * P + P, 70)) for p in pages.tolist()])
                assert torch.equal(kept, whole), f"layer {layer} row {b} head {h} keeps part of a page"
                top = expected[layer][b, h].argsort(descending=True, stable=True)[: pages.numel()].sort().values
                assert torch.equal(pages, top), "the kept pages are the group's top pages by pooled score"
                assert set(range(4)) <= set(kept.tolist()), "sinks are kept"
    # UOR = 1: each KV head stores one selection (its group's top pages, checked above) that all of its query
    # heads read, so the union over the group is exactly what the per-head budget pays for


def test_page_entrokv_weights_focused_heads_and_isolates_sinks():
    S = 20
    focused = torch.full((S,), 0.01).index_fill(0, torch.tensor([10]), 1.0)
    diffuse = torch.ones(S)
    sink_heavy = torch.ones(S).index_fill(0, torch.tensor([0]), 50.0)  # looks focused only because of the sink
    attn = torch.stack([focused, diffuse, sink_heavy, diffuse])[None]
    attn = attn / attn.sum(-1, keepdim=True)
    sink = (torch.arange(S) < 4).expand(1, 2, S)
    w = page_entrokv.PageEntroKV().group_weights(attn, sink, num_kv_heads=2)
    assert w[0, 0, 0] > 0.9, "the focused head dominates its group"
    torch.testing.assert_close(w[0, 1], torch.tensor([0.5, 0.5])), "a sink-dominated head is as diffuse as it is"


# ---------------------------------------------------------------------------------------------- ripplekv
def test_ripplekv_layer_budgets_follow_sensitivity():
    scores = torch.zeros(3, 1, 2, 400)
    counts = ripplekv.RippleKV(layer_sensitivity=(0.0, 1.0, 0.5), ratio=4.0).allocate(
        scores, torch.full((3, 1, 2), 400), torch.tensor([700])
    )
    assert counts.sum() == 700
    per_layer = counts[:, 0].sum(-1).double()
    expected = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(per_layer / per_layer[0], expected, atol=0.02, rtol=0)


def test_ripplekv_calibration_measures_kl_and_is_cached(llama_cm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path))
    ids = torch.randint(2, VOCAB - 1, (1, 96), generator=torch.Generator().manual_seed(0))
    assert ripplekv_calibration.calibrate(llama_cm, ids, noise=0.0) == (0.0, 0.0, 0.0), "no noise, no divergence"
    sensitivity = ripplekv_calibration.calibrate(llama_cm, ids)
    assert len(sensitivity) == 3 and all(s > 0 for s in sensitivity)
    monkeypatch.setattr(ripplekv_calibration, "_measure", lambda *a, **k: pytest.fail("measured twice"))
    assert ripplekv_calibration.calibrate(llama_cm, ids) == sensitivity, "the second call reads the disk cache"
    recipe = kvcompile.Recipe("ripplekv-cal", "snapkv", "ripplekv", allocator_args={"layer_sensitivity": sensitivity})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    cm.prefill(left_padded_batch([160], total=160)[0])
    per_layer = cm.cache.lengths[:, 0].sum(-1)
    assert per_layer[max(range(3), key=sensitivity.__getitem__)] == per_layer.max()


# ---------------------------------------------------------------------------------------------- sgd-kv
def test_sgdkv_budgets_are_proportional_with_overflow_redistributed():
    scores = torch.zeros(1, 1, 4, 100)
    lengths = torch.tensor([[[100, 100, 100, 30]]])
    allocator = sgdkv.SGDKV(head_scores=((1.0, 1.0, 2.0, 4.0),), reserve=10)
    counts = allocator.allocate(scores, lengths, torch.tensor([200]))[0, 0]
    # floors 10 each; pool 160 by 1:1:2:4 = 20, 20, 40, 80 -> head 3 capped at 30 (20 taken), 60 spread 1:1:2
    assert counts.tolist() == [45, 45, 80, 30]


def test_sgdkv_calibration_matches_attention_of_the_model(llama_cm, llama, tmp_path, monkeypatch):
    """Head scores equal those read off the transformers model's own (eager) attention weights."""
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path))
    g = torch.Generator().manual_seed(4)
    source = torch.randint(2, VOCAB - 1, (60,), generator=g)
    answer = torch.cat([torch.tensor([1, 1]), source[[5, 17, 33, 48, 52]]])  # two filler tokens, then 5 keywords
    ids = torch.cat([source, answer])[None]
    mask = torch.zeros(ids.shape[1], dtype=torch.bool)
    mask[62:] = True
    scores = torch.tensor(sgdkv_calibration.calibrate(llama_cm, ids, mask))
    eager = tiny_model("llama", layers=3)
    eager.load_state_dict(llama.state_dict())
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
    targets = torch.arange(62, ids.shape[1])
    occurs = ids[0, None, :62] == ids[0, targets][:, None]
    for layer, attn in enumerate(attentions):
        a = attn[0][:, targets - 1, :62].masked_fill(~occurs, 0).amax(-1).mean(-1)  # [Hq]
        torch.testing.assert_close(scores[layer], a.reshape(2, 2).mean(-1), atol=1e-5, rtol=1e-4)


def test_sgdkv_diagnostic_task_marks_keyword_tokens():
    class Chars:  # a tokenizer with one token per character
        def __call__(self, text, return_offsets_mapping=False):
            return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}

    docs = ["The lighthouse keeper watched storms.", "Engineers designed bridges carefully."]
    ids, mask = sgdkv_calibration.diagnostic_task(Chars(), docs, keywords=2)
    marked = "".join(chr(int(i)) if m else "|" for i, m in zip(ids[0], mask))
    words = [w for w in marked.split("|") if w]
    assert words == ["lighthouse", "watched", "Engineers", "carefully"]


# ---------------------------------------------------------------------------------------------- catekv
def test_catekv_compresses_consistent_heads_and_keeps_adaptive_ones():
    S, g = 200, torch.Generator().manual_seed(5)
    flat = torch.rand(4, S, generator=g) * 0.2 + 1.0  # adaptive: every chunk similar
    peaked = torch.zeros(4, S)
    peaked[:, 40:56] = 30.0  # consistent: the same chunk wins
    scores = torch.stack([flat, peaked])[:, None]  # [2, 1, 4, S]: layer 0 heads flat, layer 1 heads peaked
    allocator = catekv.CateKVHeads(adaptive_fraction=0.5, consistent_share=0.25)
    assert allocator.classify(catekv.variation(scores)).reshape(-1).tolist() == [True] * 4 + [False] * 4
    counts = allocator.allocate(scores, torch.full((2, 1, 4), S), torch.tensor([8 * 50]))
    assert counts.sum() == 400
    assert (counts[1] == 12).all() and (counts[0] == 88).all(), counts.tolist()


def test_catekv_scorer_counts_query_hits_per_chunk():
    obs = _observation(B=1, Hkv=1, G=2, S=96, W=6, D=8)
    direction = torch.randn(8, generator=torch.Generator().manual_seed(7))
    obs.queries.mul_(0.1).add_(direction)  # every query looks the same way ...
    obs.keys[:, :, 40:48] = direction * 3  # ... at chunk 5 (tokens 40-47)
    scorer = catekv.CateKV(last_q=6, init=8, recent=16, chunk=8, top_threshold=0.5, top_fraction=0.99)
    s = scorer.score(obs)[0, 0]
    pinned = s >= base._PINNED
    assert pinned[:8].all() and pinned[-16:].all() and not pinned[8:-16].any()
    assert s[40:48].floor().eq(6).all(), "every observed query hits the chunk"
    assert s[8:-16].argmax() // 8 == 4


def test_catekv_calibration_classifies_heads(llama_cm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CALIBRATION", str(tmp_path))
    g = torch.Generator().manual_seed(6)
    samples = [torch.randint(2, VOCAB - 1, (1, 120), generator=g) for _ in range(2)]
    scorer = catekv.CateKV(last_q=16, init=4, recent=16, chunk=8)
    adaptive = catekv_calibration.calibrate(llama_cm, samples, scorer, adaptive_fraction=0.5)
    assert len(adaptive) == 3 and sum(map(sum, adaptive)) == 3
    recipe = kvcompile.Recipe("catekv-cal", "catekv", "catekv", {"last_q": 16, "init": 4, "recent": 16, "chunk": 8},
                              {"adaptive_heads": adaptive})
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=recipe, page_size=4)
    cm.prefill(left_padded_batch([160], total=160)[0])
    kept = cm.cache.lengths[:, 0]
    keep_more = torch.tensor(adaptive)
    assert kept[keep_more].min() > kept[~keep_more].max()


def test_global_topk_whole_pages_keeps_the_most_score_any_page_choice_can():
    """``GlobalTopK(whole_pages=True)`` against every choice of whole pages per head (brute force, fresh random
    scores and lengths): within the page budget, no choice keeps more score; counts are whole pages or a head's
    length; pinned tokens' pages are kept first."""
    import itertools

    from kvcompile.methods.kvzip import GlobalTopK

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    P, S = 2, 7
    for _ in range(20):
        lengths = torch.randint(0, S + 1, (1, 1, 3), generator=g)
        scores = torch.rand(1, 1, 3, S, generator=g).masked_fill(torch.arange(S) >= lengths[..., None], float("-inf"))
        max_pages = torch.randint(0, 8, (1,), generator=g)
        counts = GlobalTopK(whole_pages=True).allocate_pages(scores, lengths, max_pages, P)
        pages = -(-counts // P)
        assert int(pages.sum()) <= int(max_pages), f"seed {seed}: over the page budget"
        assert ((counts % P == 0) | (counts == lengths)).all() and (counts <= lengths).all(), f"seed {seed}"

        def kept(c):  # the score a head keeps with its best c tokens
            best = scores[0, 0].clamp_min(0).sort(-1, descending=True).values
            return sum(float(best[h, : int(c[h])].sum()) for h in range(3))

        held = [-(-int(n) // P) for n in lengths.flatten()]
        best = max(kept([min(p * P, int(n)) for p, n in zip(choice, lengths.flatten())])
                   for choice in itertools.product(*(range(h + 1) for h in held)) if sum(choice) <= int(max_pages))
        assert kept(counts.flatten()) >= best - 1e-6, f"seed {seed}: {kept(counts.flatten())} < {best}"
    pinned = base.protect(torch.rand(1, 1, 2, 4), torch.tensor([False, True])[:, None].expand(2, 4)[None, None])
    counts = GlobalTopK(whole_pages=True).allocate_pages(pinned, torch.full((1, 1, 2), 4), torch.tensor([2]), 2)
    assert counts.flatten().tolist() == [0, 4], "the pinned head's pages first"
