"""The custom ops: opcheck-clean registrations, and the reference kernels against a plain dense oracle."""

from __future__ import annotations

import pytest
import torch

import kvcompile  # noqa: F401  (registers torch.ops.kvcompile)
from kvcompile.cache import PagedKVCache
from kvcompile.kernels import reference


def filled_cache(lengths, P=4, D=8, Hq=4, seed=None):
    """A cache for one layer whose heads (1 row) hold ``lengths`` random tokens on shuffled pages."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    Hkv = len(lengths)
    cache = PagedKVCache(1, Hkv, Hq, D, page_size=P)
    cache.setup(1)
    n = max(lengths)
    cache.reserve(n)
    perm = torch.randperm(cache.k_pages.shape[0] - 1, generator=g) + 1  # shuffle physical pages
    owned = cache.page_table > 0
    cache.page_table[owned] = perm[: int(owned.sum())].int()
    k = torch.randn(1, Hkv, n, D, generator=g)
    v = torch.randn(1, Hkv, n, D, generator=g)
    real = torch.ones(1, n, dtype=torch.bool)
    slots = cache.slots_for(real)[0]
    reference.write_tokens(cache.k_pages, cache.v_pages, cache.page_pos, k, v, torch.arange(n)[None], slots)
    cache.lengths[0, 0] = torch.tensor(lengths, dtype=torch.int32)
    return cache, k, v


@pytest.mark.parametrize("lengths", [[5, 1, 9], [4, 8], [13]])
def test_paged_attention_matches_dense_masked_sdpa(lengths):
    cache, k, v = filled_cache(lengths, Hq=2 * len(lengths))
    q = torch.randn(1, 2 * len(lengths), 1, 8)
    qp = torch.full((1, 1), 50)
    out = reference.paged_attention(q, qp, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0],
                                    cache.lengths[0], 0.3)
    for h, n in enumerate(lengths):
        for g in range(2):
            expect = torch.softmax(q[0, 2 * h + g, 0] @ k[0, h, :n].T * 0.3, -1) @ v[0, h, :n]
            torch.testing.assert_close(out[0, 2 * h + g, 0], expect, atol=1e-5, rtol=1e-5)


def test_compact_moves_kept_rows_only():
    cache, k, v = filled_cache([9, 6])
    keep = torch.tensor([[[0, 3, 8, 0], [1, 2, 4, 5]]])
    count = torch.tensor([[3, 4]])
    before = cache.k_pages.clone()
    torch.ops.kvcompile.compact(cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0], keep, count)
    cache.lengths[0, 0] = count[0].int()
    keys, values, pos, valid = cache.dense(0)
    torch.testing.assert_close(keys[0, 0, :3], k[0, 0, [0, 3, 8]])
    torch.testing.assert_close(values[0, 1, :4], v[0, 1, [1, 2, 4, 5]])
    assert pos[0, 0, :3].tolist() == [0, 3, 8]
    assert torch.equal(cache.k_pages[0], before[0]), "the scratch page is nobody's"


def _attention_args(T):
    cache, k, v = filled_cache([6, 3])
    q = torch.randn(1, 4, T, 8)
    kn, vn = torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    qp = torch.arange(6, 6 + T)[None]
    slots = torch.zeros(1, 1, 2, T, dtype=torch.long)
    return (q, kn, vn, qp, slots, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table, cache.lengths,
            torch.zeros(1, 1, 4, 2, 8), 0, 0.35, 0)


@pytest.mark.parametrize("op, T", [("prefill_attention", 3), ("decode_attention", 1)])
def test_opcheck_attention(op, T):
    torch.library.opcheck(getattr(torch.ops.kvcompile, op).default, _attention_args(T))


def test_opcheck_compact():
    cache, _, _ = filled_cache([9, 6])
    args = (cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0],
            torch.tensor([[[0, 3, 8, 0], [1, 2, 4, 5]]]), torch.tensor([[3, 4]]))
    torch.library.opcheck(torch.ops.kvcompile.compact.default, args)


def test_reserve_release_and_trim_return_memory():
    cache = PagedKVCache(2, 2, 2, 8, page_size=4)
    cache.setup(2)
    cache.reserve(torch.tensor([10, 3]))
    assert cache.n_pages.tolist() == [[[3, 3], [1, 1]]] * 2
    cache.lengths[:] = torch.tensor([[10, 10], [3, 3]], dtype=torch.int32)
    used = int(cache.n_pages.sum())
    assert cache.n_free == cache.k_pages.shape[0] - 1 - used
    cache.lengths[:] = torch.tensor([[2, 5], [3, 1]], dtype=torch.int32)
    cache.release_unused()
    assert cache.n_pages.tolist() == [[[1, 2], [1, 1]]] * 2
    keys_before = [cache.dense(layer) for layer in range(2)]
    cache.trim()
    assert cache.k_pages.shape[0] == 1 + int(cache.n_pages.sum())
    for layer in range(2):
        for a, b in zip(keys_before[layer], cache.dense(layer)):
            assert torch.equal(a, b), "trim renumbers pages without changing what heads hold"
