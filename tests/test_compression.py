"""Compression keeps the budget's bytes, per-head allocators store ragged lengths, chunked prefill bounds the peak."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, spelled

import kvcompile
from kvcompile.kernels import reference

# every prefill-time compressing recipe (decode-time ones: tests/test_decode_compression.py) that compresses a bare
# prefill (FINCH reads the question apart: tests/test_presses_b.py; learned recipes run on the model they were
# trained for: tests/test_kvzap.py)
RECIPES = sorted(name for name, r in kvcompile.recipes().items()
                 if r.scorer is not None and r.decode is None and not r.query_aware and not r.trained_for)
# controls that leave part of the budget unspent by definition
UNDERSPENT = {"core-unmerged": "CORE's kept tokens without its memory entries: their slots stay empty"}


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.1])
@pytest.mark.parametrize("recipe", RECIPES)
def test_bytes_held_within_budget(llama_cm, recipe, budget):
    cm = kvcompile.apply(llama_cm, budget=budget, recipe=spelled(recipe), page_size=4)
    ids, mask = left_padded_batch([160, 120, 97], total=160)
    cm.prefill(ids, mask)
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]
    kept_all = bool((cm.cache.held() == cm.cache.seen[None, :, None]).all())  # a page format that holds every token
    if recipe not in UNDERSPENT and not kept_all:
        assert stats["bytes_held"] >= 0.75 * stats["budget_bytes"], "the budget should be (nearly) used"
    held = cm.cache.bytes_held()
    per_row = cm.budget_bytes()
    assert (held <= per_row).all(), f"a sequence is over its own budget: {held.tolist()} > {per_row.tolist()}"
    assert stats["bytes_allocated"] < stats["bytes_full"], "the pool itself must shrink, not just the counters"
    assert not stats["query_aware"] and cm.seen.tolist() == [160, 120, 97]
    assert torch.isfinite(cm.decode(ids[:, -1:])).all()


def test_adakv_is_ragged_and_bytes_match_lengths(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="adakv-snapkv", page_size=4)
    ids, _ = left_padded_batch([160], total=160)
    cm.prefill(ids)
    lengths = cm.cache.lengths
    assert len(set(lengths.flatten().tolist())) > 1, "per-head allocation should give different lengths"
    pages = ((lengths.long() + 3) // 4).sum().item()
    stats = cm.cache_stats()
    assert stats["bytes_held"] == pages * cm.cache.page_bytes <= stats["budget_bytes"]


def test_token_and_byte_budgets(llama_cm):
    ids, _ = left_padded_batch([100], total=100)
    cm = kvcompile.apply(llama_cm, budget=24, recipe="snapkv", page_size=4)
    cm.prefill(ids)
    assert cm.cache.lengths.float().mean() <= 24
    cm = kvcompile.apply(llama_cm, budget="20KiB", recipe="snapkv", page_size=4)
    cm.prefill(ids)
    assert cm.cache_stats()["bytes_held"] <= 20 * 1024


def test_kept_tokens_are_the_top_scored_and_positions_continue(llama_cm):
    """streamingllm keeps sinks + the most recent tokens; decoding continues at the original position."""
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe="streamingllm", page_size=4)
    ids, _ = left_padded_batch([80], total=80)
    cm.prefill(ids)
    keys, _, pos, valid = cm.cache.dense(0)
    kept = sorted(set(pos[valid].tolist()))
    n = int(cm.cache.lengths[0, 0, 0])
    assert kept == list(range(4)) + list(range(80 - (n - 4), 80))
    cm.decode(ids[:, -1:])
    _, _, pos, valid = cm.cache.dense(0)
    assert pos[valid].max().item() == 80, "the next token keeps the original sequence position"


def test_compacted_cache_equals_selection_of_dense_cache(llama_cm):
    """Compaction moves exactly the kept tokens: dense view after == dense view before, indexed by positions."""
    cm = kvcompile.apply(llama_cm, budget=0.3, recipe=kvcompile.Recipe("knorm-adakv", "knorm", "adakv"), page_size=4)
    ids, mask = left_padded_batch([50, 31], total=50)
    cm.prefill(ids, mask, compress=False)
    before = [cm.cache.dense(layer) for layer in range(3)]
    cm.compress()
    for layer in range(3):
        k0, v0, p0, ok0 = before[layer]
        k1, v1, p1, ok1 = cm.cache.dense(layer)
        for b in range(2):
            for h in range(2):
                src = {int(p): i for i, p in enumerate(p0[b, h][ok0[b, h]])}
                idx = torch.tensor([src[int(p)] for p in p1[b, h][ok1[b, h]]], dtype=torch.long)
                assert torch.equal(k1[b, h][ok1[b, h]], k0[b, h][idx])
                assert torch.equal(v1[b, h][ok1[b, h]], v0[b, h][idx])
                assert (p1[b, h][ok1[b, h]].diff() > 0).all(), "kept tokens stay in position order"


def test_chunked_prefill_bounds_the_peak(llama_cm):
    chunk = 32
    ids, mask = left_padded_batch([256, 200], total=256)
    one_shot = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv", page_size=4)
    one_shot.prefill(ids, mask)
    chunked = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv", page_size=4, prefill_chunk=chunk)
    chunked.prefill(ids, mask)
    stats = chunked.cache_stats()
    chunk_bytes = 2 * chunk * 3 * 2 * chunked.cache.token_bytes  # 2 rows x chunk tokens x 3 layers x 2 KV heads
    assert stats["bytes_held"] <= stats["budget_bytes"]
    assert stats["peak_bytes_held"] <= stats["budget_bytes"] + chunk_bytes
    assert one_shot.cache_stats()["peak_bytes_held"] >= stats["bytes_full"], "one-shot prefill holds everything first"


def test_decode_append_writes_only_new_rows(llama_cm):
    """Appending a token touches one row per head (O(heads)); every other pool row is unchanged."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    ids, _ = left_padded_batch([40, 40], total=40)
    cm.prefill(ids)
    cm.decode(ids[:, -1:])
    k_before = cm.cache.k_pages.clone()
    cm.decode(ids[:, -1:])
    changed = (cm.cache.k_pages != k_before).any(-1).sum().item()
    assert 0 < changed <= 3 * 2 * 2  # layers x rows x KV heads


def test_paged_layout_matches_its_documented_loop(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.4, recipe="adakv-snapkv", page_size=4)
    ids, _ = left_padded_batch([37], total=37)
    cm.prefill(ids)
    c = cm.cache
    keys, _, _, valid = c.dense(1)
    for h in range(2):
        n = int(c.lengths[1, 0, h])
        rows = [c.k_pages[c.page_table[1, 0, h, j // 4], j % 4] for j in range(n)]
        loop = torch.stack(rows) if rows else keys[0, h, :0]
        assert torch.equal(keys[0, h][valid[0, h]], loop)
    assert torch.equal(reference.rows_of(c.page_table[1], torch.zeros(1, 2, 1, dtype=torch.long), 4).squeeze(-1),
                       c.page_table[1, :, :, 0].long() * 4)
