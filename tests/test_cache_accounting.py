"""Every byte the cache allocates is reported: the breakdown sums to the tensors the cache object really owns,
compression leaves about the budget's bytes allocated, the observation ring is released when nothing reads it."""

from __future__ import annotations

import pytest
import torch
from conftest import fast_first, left_padded_batch, spelled

import kvcompile

# learned recipes run on the model they were trained for: tests/test_kvzap.py
RECIPES = sorted(name for name, r in kvcompile.recipes().items()
                 if r.scorer is not None and not r.query_aware and not r.trained_for)


def owned_bytes(obj, seen=None) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj``'s attributes (modules, lists, dicts too)."""
    seen = set() if seen is None else seen
    total = 0
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() not in seen or storage.nbytes() == 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total
    if isinstance(obj, (list, tuple, set)):
        return sum(owned_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(owned_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(("kvcompile", "torch.nn")):
        return sum(owned_bytes(x, seen) for x in vars(obj).values())
    return 0


def check_accounting(cm):
    stats = cm.cache_stats()
    assert stats["bytes_allocated"] == owned_bytes(cm.cache) == sum(stats["bytes"].values())
    assert stats["bytes"]["payload"] == stats["bytes_held"]
    assert all(v >= 0 for v in stats["bytes"].values()), stats["bytes"]
    for name, value in stats["bytes"].items():
        assert stats["peak_bytes"][name] >= value, name
    return stats


@pytest.mark.parametrize("recipe", fast_first(RECIPES))
def test_allocated_bytes_are_the_tensors_the_cache_owns_and_near_the_budget(llama_cm, recipe):
    cm = kvcompile.apply(llama_cm, budget=0.25, recipe=spelled(recipe), page_size=4)
    ids, mask = left_padded_batch([160, 120], total=160)
    cm.prefill(ids, mask)
    stats = check_accounting(cm)
    parts = stats["bytes"]
    decode_ring = cm.decode_window
    if decode_ring == 0:
        assert parts["ring"] == 0, "a prefill-only recipe holds no ring after compression"
    else:
        assert stats["ring_queries"] == decode_ring, "a decode policy keeps only the window it reads"
    # slack: one scratch page; positions are 4 bytes per 2 x D x 4 bytes of payload (1/16 of it at D = 16)
    pages = parts["payload"] + parts["free_pages"]
    assert pages <= stats["budget_bytes"] + cm.cache.page_bytes
    if cm.recipe.format is None:  # a format pool's positions come with its own pages (tests/test_formats.py)
        per_page = cm.cache.page_pos.element_size() * cm.cache.page_size
        assert parts["positions"] == pages // cm.cache.page_bytes * per_page
    cm.generate(ids, mask, max_new_tokens=20, eos_token_id=[])
    check_accounting(cm)


def test_peaks_track_the_uncompressed_prompt_and_kvzip_reconstruction(llama_cm):
    ids, _ = left_padded_batch([96], total=96)
    snap = kvcompile.apply(llama_cm, budget=0.25, recipe="snapkv", page_size=4)
    snap.prefill(ids)
    zipped = kvcompile.apply(llama_cm, budget=0.25, recipe="kvzip", page_size=4)
    zipped.prefill(ids)
    a, b = snap.cache_stats(), zipped.cache_stats()
    assert a["peak_bytes"]["payload"] == a["bytes_full"], "the whole prompt was held before compression"
    assert b["peak_bytes"]["payload"] >= 2 * b["bytes_full"], "KVzip's reconstruction pass holds the context twice"
    assert b["peak_bytes"]["ring"] > 0 == b["bytes"]["ring"], "its ring held the reconstruction's queries, then went"


def test_ring_is_sized_by_what_was_seen_not_by_the_window(llama_cm):
    """h2o reads up to 8192 queries; a 40-token prompt needs a ring of 40, and none once it is compressed."""
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="h2o", page_size=4)
    ids, _ = left_padded_batch([40], total=40)
    cm.prefill(ids, compress=False)
    assert cm.cache_stats()["ring_queries"] == 40
    cm.compress()
    assert cm.cache_stats()["ring_queries"] == 0 and cm.cache_stats()["bytes"]["ring"] == 0


def test_reset_releases_the_pool(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    cm.prefill(left_padded_batch([100], total=100)[0])
    cm.reset()
    assert owned_bytes(cm.cache) <= 2 * cm.cache.page_bytes, "nothing of the last request is kept"
