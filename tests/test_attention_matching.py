"""Attention Matching: entries fitted to reproduce the attention mass and output of the compacted tokens for the
reference queries, against the same keys kept as they are; within every row's budget; the model itself at budget
1.0."""

from __future__ import annotations

import torch
from conftest import assert_plain_at_full_budget, fresh_seed, left_padded_batch

import kvcompile
from kvcompile.methods import Observation
from kvcompile.methods.attention_matching import AttentionMatching


def attend(q, keys, values, log_w, scale):
    """Plain softmax attention of q [R, D] over entries with log-weights: output [R, D] and log-partition [R]."""
    logits = q @ keys.T * scale + log_w
    return torch.softmax(logits, -1) @ values, torch.logsumexp(logits, -1)


def test_fitted_entries_reproduce_the_reference_attention_better_than_the_kept_keys():
    seed = fresh_seed()
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, S, W, D = 1, 2, 2, 96, 64, 16
    keys, values = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    queries = torch.randn(B, Hkv * G, W, D, generator=g)
    q_pos = torch.arange(S, S + W).expand(B, W)  # every query sees every key
    obs = Observation(keys, values, torch.arange(S).expand(B, Hkv, S), torch.ones(B, Hkv, S, dtype=torch.bool),
                      queries, q_pos, D**-0.5, 0, 0, 1)
    scores = torch.rand(1, B, Hkv, S, generator=g)
    kept, k, v, pos, lw, counts = AttentionMatching(references=W).prototypes([obs], scores, torch.tensor([6]), 4)
    assert not kept.any() and counts.tolist() == [[[12, 12]]]  # 6 pages of 4 over 2 heads: 12 entries a head
    for h in range(Hkv):
        q = queries[0, h * G:(h + 1) * G].reshape(-1, D)
        full, full_lse = attend(q, keys[0, h], values[0, h], torch.zeros(S), D**-0.5)
        fit, fit_lse = attend(q, k[0, 0, h], v[0, 0, h], lw[0, 0, h], D**-0.5)
        chosen = pos[0, 0, h]  # the same keys, their own values, no weights
        plain, plain_lse = attend(q, keys[0, h, chosen], values[0, h, chosen], torch.zeros(12), D**-0.5)
        error = lambda out: float((out - full).square().sum() / full.square().sum())  # noqa: E731
        assert error(fit) < 0.5 * error(plain), (h, error(fit), error(plain))
        assert (fit_lse - full_lse).abs().mean() < 0.5 * (plain_lse - full_lse).abs().mean(), h
        assert (lw[0, 0, h] > -70).sum() >= 1 and torch.isfinite(lw).all()


def test_pinned_tokens_stay_and_a_head_that_fits_keeps_everything():
    g = torch.Generator().manual_seed(0)
    B, Hkv, S, D = 1, 2, 20, 8
    keys, values = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    valid = torch.ones(B, Hkv, S, dtype=torch.bool)
    valid[0, 1, 6:] = False  # head 1 holds 6 tokens: they fit
    obs = Observation(keys, values, torch.arange(S).expand(B, Hkv, S), valid, torch.randn(B, 2 * Hkv, 8, D,
                      generator=g), torch.arange(S, S + 8).expand(B, 8), D**-0.5, 0, 0, 1)
    scores = torch.rand(1, B, Hkv, S, generator=g).masked_fill(~valid, float("-inf"))
    scores[..., :2] = torch.finfo(torch.bfloat16).max  # pinned (``protect``)
    kept, *_, counts = AttentionMatching().prototypes([obs], scores, torch.tensor([4]), 4)
    assert kept[0, 0, 0, :2].all() and not kept[0, 0, 0, 2:].any() and counts[0, 0, 0] == 6
    assert torch.equal(kept[0, 0, 1], valid[0, 1]) and counts[0, 0, 1] == 0


def test_a_model_holds_every_rows_budget_and_budget_one_is_the_model(llama, llama_cm):
    ids, mask = left_padded_batch([72, 50, 33], total=72)
    for budget in (0.15, 0.4):  # at 0.15 KVzip's 4 sinks fill some heads' share: those write nothing
        cm = kvcompile.apply(llama_cm, budget=budget, recipe="attention-matching", page_size=4)
        cm.prefill(ids, mask)
        assert (cm.cache.bytes_held() <= cm.budget_bytes()).all(), budget
        assert cm.cache.weights_used, "the fitted entries carry their log-weights"
        seen = torch.tensor([72, 50, 33])[None, :, None, None]  # no entry of KVzip's reconstruction stays
        assert (cm.cache.positions() < seen).all(), budget
        assert torch.isfinite(cm.decode(ids[:, -1:])).all()
    assert_plain_at_full_budget(llama, llama_cm, "attention-matching")
