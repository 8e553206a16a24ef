"""kvpress's MergingPress as the ``merging`` wrapper (docs/methods_wrappers.md#merging): evicted values folded into the
most similar kept entry, against a direct restatement of the specification, then by name end to end (its budget,
generation and full-budget checks are ``test_wrappers``' composed-recipe tests)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import left_padded_batch

import kvcompile
from kvcompile.methods.merging import ValueMerging
from kvcompile.recipes import compose


@pytest.fixture
def seed():
    seed = int(os.environ.get("KVC_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    return seed


def spec_merge(keys, values, valid, kept, threshold, fraction, eps=1e-6):
    """Section 47, one head and one evicted entry at a time: target by cosine among the kept, the threshold and
    quantile gates, w = max(sigma, 0) |v_i| / (|v_i| + |v_t| + eps), v_t <- (v_t + sum w v) / (1 + sum w)."""
    out = values.clone()
    B, H, S, _ = keys.shape
    for b in range(B):
        for h in range(H):
            survivors = [t for t in range(S) if kept[b, h, t]]
            evicted = [i for i in range(S) if valid[b, h, i] and not kept[b, h, i]]
            if not survivors or not evicted:
                continue
            cos = lambda i, t: torch.nn.functional.cosine_similarity(keys[b, h, i], keys[b, h, t], dim=0)  # noqa: E731
            best = {i: max(survivors, key=lambda t: (cos(i, t), -t)) for i in evicted}
            sigma = {i: float(cos(i, best[i])) for i in evicted}
            cut = torch.quantile(torch.tensor(list(sigma.values())), 1 - fraction) if fraction < 1 else -2.0
            sums = {t: (torch.zeros_like(values[b, h, t]), 0.0) for t in survivors}
            for i in evicted:
                if sigma[i] >= threshold and sigma[i] >= cut:
                    t, vi = best[i], values[b, h, i]
                    w = max(sigma[i], 0.0) * vi.norm() / (vi.norm() + values[b, h, t].norm() + eps)
                    sums[t] = (sums[t][0] + w * vi, sums[t][1] + w)
            for t, (total, mass) in sums.items():
                out[b, h, t] = (values[b, h, t] + total) / (1 + mass)
    return out


@pytest.mark.parametrize("threshold, fraction", [(0.0, 1.0), (0.2, 0.75), (-1.0, 0.5)])
def test_merge_is_the_specification(seed, threshold, fraction):
    B, H, S, D = 2, 2, 14, 8
    keys, values = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    valid = torch.arange(S) < torch.randint(1, S + 1, (B, H, 1))
    kept = valid & (torch.rand(B, H, S) < 0.4)
    got = ValueMerging(threshold, fraction, block=5).merge(keys, values, valid, kept)
    want = spec_merge(keys, values, valid, kept, threshold, fraction)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{m}\nseed={seed}")


def _compressed(recipe, shared):
    child = shared.fork(recipe, budget=0.25)
    child.compress()
    return child, [child.cache.dense(layer) for layer in range(3)]


def test_merging_keeps_the_base_selection_and_keys_and_merges_values_as_specified(llama_cm):
    """``merging+snapkv`` keeps what SnapKV keeps, with the same keys, positions and bytes; each kept value is
    the wrapper's merge of the evicted ones into it; a threshold of 1 merges nothing."""
    shared = kvcompile.apply(llama_cm, budget=1.0, recipe="snapkv", page_size=4)
    shared.prefill(*left_padded_batch([96, 70], total=96), compress=False)
    before = [shared.cache.dense(layer) for layer in range(3)]
    base, plain = _compressed("snapkv", shared)
    merging, merged = _compressed("merging+snapkv", shared)
    stats = merging.cache_stats()
    assert stats["bytes_held"] == base.cache_stats()["bytes_held"] <= stats["budget_bytes"]
    assert stats["recipe"] == "merging+snapkv@3"
    for (k0, v0, p0, ok0), (k1, _, p1, ok1), (k, v, p, ok) in zip(before, plain, merged):
        assert torch.equal(k, k1) and torch.equal(p, p1) and torch.equal(ok, ok1), "keys and positions as the base's"
        kept = ok0 & (p0[..., :, None] == p1[..., None, :]).logical_and(ok1[..., None, :]).any(-1)
        want = spec_merge(k0, v0, ok0, kept, 0.0, 1.0)
        for b, h in torch.cartesian_prod(torch.arange(v.shape[0]), torch.arange(v.shape[1])).tolist():
            torch.testing.assert_close(v[b, h][ok[b, h]], want[b, h][kept[b, h]], atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(v, v1) for (_, v, _, _), (_, v1, _, _) in zip(merged, plain)), "something merged"
    none = compose("merging", "snapkv", similarity_threshold=1.0)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_compressed(none, shared)[1], plain))


def test_merging_refuses_what_it_cannot_do(llama_cm):
    with pytest.raises(ValueError, match="bad merge parameters: merge_fraction must be in \\(0, 1\\]; got 0"):
        compose("merging", "snapkv", merge_fraction=0)
    with pytest.raises(ValueError, match="bad merge parameters: similarity_threshold is a cosine"):
        compose("merging", "snapkv", similarity_threshold=2)
    with pytest.raises(ValueError, match="value merging runs at prefill compression only"):
        kvcompile.get_recipe("merging+decoding+knorm")
    with pytest.raises(ValueError, match="beside a summarising allocator"):
        kvcompile.apply(llama_cm, budget=0.25, recipe="merging+certkv")
    with pytest.raises(NotImplementedError, match="value merging does not work with int4 pages"):
        kvcompile.apply(llama_cm, budget=0.25, recipe="merging+snapkv+int4")
