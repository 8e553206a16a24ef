"""The flex_attention decode backend (``KVCOMPILE_DECODE_BACKEND=flex``, issue 22): a model decodes through it as
through the reference, weighted entries included, and what it cannot serve is refused at ``apply`` (the seed is
printed on failure)."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_seed, left_padded_batch
from test_ops import filled_cache

import kvcompile
from kvcompile.kernels import reference
from kvcompile.kernels.flex import flex_paged_decode


@pytest.mark.slow
def test_flex_decode_backend_generates_as_the_reference(llama_cm, monkeypatch):
    """Ragged heads (AdaKV): the same tokens and, step by step, the same logits as the reference backend."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="adakv-snapkv", page_size=4)
    ids, mask = left_padded_batch([40, 25], total=40, seed=4)
    runs = {}
    for backend in ("reference", "flex"):
        monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", backend)
        tokens = cm.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
        cm.reset()
        cm.prefill(ids, mask)
        runs[backend] = tokens, torch.cat([cm.decode(tokens[:, i : i + 1]) for i in range(3)], 1)
    assert torch.equal(runs["flex"][0], runs["reference"][0])
    torch.testing.assert_close(runs["flex"][1], runs["reference"][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 7])
def test_flex_paged_decode_adds_each_entrys_log_weight(window):
    seed = fresh_seed()
    cache, _, _ = filled_cache([5, 0, 37, 16], P=4, Hq=8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    log_weights = torch.rand(cache.page_pos.shape, generator=g) * 2  # entries standing for 1 to e^2 tokens
    q = torch.randn(1, 8, 1, 8, generator=g)
    args = (q, torch.full((1, 1), 40), cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0],
            cache.lengths[0], 0.3, window)
    torch.testing.assert_close(flex_paged_decode(*args, log_weights=log_weights),
                               reference.paged_attention(*args, log_weights=log_weights), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {seed}: {m}")


def test_flex_backend_refuses_what_it_cannot_serve(llama_cm, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "fast")
    with pytest.raises(ValueError, match="KVCOMPILE_DECODE_BACKEND='fast': pick one of auto, reference, flex"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv")
    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "flex")
    with pytest.raises(ValueError, match="flex reads model-dtype pages; this recipe stores 'int4' pages"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv+int4")
    with pytest.raises(ValueError, match=r"flex runs in eager programs \(apply\(\.\.\., compile=False\)\)"):
        kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", compile=True)


@pytest.mark.slow
def test_flex_backend_compiles_a_few_times_for_many_cache_sizes(llama_cm, monkeypatch):
    """A process that decodes caches of many sizes through flex (here: nine prompt lengths) compiles flex_attention
    a few times, not once per size, and decodes as the reference at every size: compiled per size, the ninth size
    passed dynamo's recompile limit and fell back to eager flex_attention, which materialises every score (10-20x
    slower; the issue-22 grid met it)."""
    from torch._dynamo.utils import counters

    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    compiled = counters["stats"]["unique_graphs"]
    for length in range(9, 45, 4):
        ids, mask = left_padded_batch([length], total=length, seed=length)
        runs = {}
        for backend in ("reference", "flex"):
            monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", backend)
            runs[backend] = cm.generate(ids, mask, max_new_tokens=2, eos_token_id=[])
        assert torch.equal(runs["flex"], runs["reference"]), f"prompt of {length} tokens"
    assert counters["stats"]["unique_graphs"] - compiled <= 3, "flex_attention compiled once per cache size"
