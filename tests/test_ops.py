"""The custom ops: opcheck-clean registrations, and the reference kernels against a plain dense oracle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import fresh_seed

import kvcompile  # noqa: F401  (registers torch.ops.kvcompile)
from kvcompile.cache import PagedKVCache
from kvcompile.cache.formatted import FORMAT_TENSORS
from kvcompile.kernels import ragged, reference
from kvcompile.plan import Plan


def shorten(cache, lengths, shrink=False):
    """Keep each head's first ``lengths`` [L, B, Hkv] tokens (a plan that evicts their tails)."""
    lengths = torch.as_tensor(lengths)
    keep = torch.arange(int(cache.lengths.max())).expand(*lengths.shape, -1)
    cache.keep(Plan(keep, lengths), shrink=shrink)


@dataclass
class Pages:
    """A layer's paged K/V as the kernels take them (one row): pools, page table [1, 1, Hkv, W], lengths [1, 1, Hkv]."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_pos: torch.Tensor
    page_table: torch.Tensor
    lengths: torch.Tensor
    packed: bool

    @property
    def page_lw(self) -> torch.Tensor:
        """No weighted entries: an empty log-weight channel."""
        return torch.zeros(0, self.page_pos.shape[1])

    def dense(self, layer: int):
        return reference.gather_dense(self.k_pages, self.v_pages, self.page_pos, self.page_table[layer],
                                      self.lengths[layer])


def filled_cache(lengths, P=4, D=8, Hq=4, seed=None, shuffle=True, own_held=False):
    """Kernel inputs for one layer whose heads (1 row) hold ``lengths`` random tokens, each head owning the pages
    of the longest (``own_held``: only the pages it fills, as the cache lays out ragged heads; the rest of its table
    row names page 0): on shuffled pages, or packed ones (consecutive, heads in order). Returns (pages, k, v)."""
    g = torch.Generator().manual_seed(seed if seed is not None else fresh_seed())
    Hkv, n = len(lengths), max(lengths)
    width = -(-n // P)
    ids = torch.arange(1, Hkv * width + 1)
    if shuffle:
        ids = torch.randperm(Hkv * width + 3, generator=g)[: Hkv * width] + 1  # spare pages: never one run
        if bool((ids.diff() == 1).all()):
            ids = ids.flip(0)
    N = int(ids.max()) + 1
    pages = Pages(torch.zeros(N, P, D), torch.zeros(N, P, D), torch.zeros(N, P, dtype=torch.int32),
                  ids.int().reshape(1, 1, Hkv, width), torch.tensor([[lengths]], dtype=torch.int32), not shuffle)
    k, v = torch.randn(1, Hkv, n, D, generator=g), torch.randn(1, Hkv, n, D, generator=g)
    slots = reference.rows_of(pages.page_table[0], torch.arange(n).expand(1, Hkv, n), P)
    reference.write_tokens(pages.k_pages, pages.v_pages, pages.page_pos, k, v, torch.arange(n)[None], slots)
    if own_held:
        held = -(-torch.tensor(lengths) // P)
        pages.page_table.masked_fill_(torch.arange(width) >= held[:, None], 0)
    return pages, k, v


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "packed"])
@pytest.mark.parametrize("lengths", [[5, 1, 9], [4, 8], [13]])
def test_paged_attention_matches_dense_masked_sdpa(lengths, shuffle):
    cache, k, v = filled_cache(lengths, Hq=2 * len(lengths), shuffle=shuffle)
    first_page = None if shuffle else 1
    k_pages = cache.k_pages.clone()
    view = reference.heads_view(cache.k_pages, cache.page_table[0], first_page)
    assert (view.data_ptr() == cache.k_pages[1].data_ptr()) == (not shuffle), "packed heads are read without a copy"
    q = torch.randn(1, 2 * len(lengths), 1, 8)
    qp = torch.full((1, 1), 50)
    out = reference.paged_attention(q, qp, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0],
                                    cache.lengths[0], 0.3, first_page=first_page)
    for h, n in enumerate(lengths):
        for g in range(2):
            expect = torch.softmax(q[0, 2 * h + g, 0] @ k[0, h, :n].T * 0.3, -1) @ v[0, h, :n]
            torch.testing.assert_close(out[0, 2 * h + g, 0], expect, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.k_pages, k_pages), "reading leaves the pool as it was"


@pytest.mark.parametrize("lengths, overhead", [([1, 600, 5, 900], None), ([5, 1, 9, 0, 13, 2], 0)])
def test_ragged_decode_by_length_class_matches_dense_attention(lengths, overhead, monkeypatch):
    """Decode over heads of very different lengths goes class by class (``page_classes``; overhead 0 forces
    classes on small heads); every head's output is its own dense softmax attention."""
    if overhead is not None:
        monkeypatch.setattr(ragged, "CLASS_OVERHEAD", overhead)
    seed = fresh_seed()
    cache, k, v = filled_cache(lengths, Hq=2 * len(lengths), seed=seed, own_held=True)
    assert len(ragged.page_classes(cache.page_table[0])) > 1, "the case must take the class path"
    q = torch.randn(1, 2 * len(lengths), 1, 8, generator=torch.Generator().manual_seed(seed))
    out = reference.paged_attention(q, torch.full((1, 1), 5000), cache.k_pages, cache.v_pages, cache.page_pos,
                                    cache.page_table[0], cache.lengths[0], 0.3)
    for h, n in enumerate(lengths):
        for g in range(2):
            expect = torch.softmax(q[0, 2 * h + g, 0] @ k[0, h, :n].T * 0.3, -1) @ v[0, h, :n]
            torch.testing.assert_close(out[0, 2 * h + g, 0], expect, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"seed {seed}: {m}")


def owning(pages) -> torch.Tensor:
    """A page table [B, Hkv, W] whose heads own ``pages`` [B][Hkv] pages each (distinct ids; 0 past them)."""
    pages = torch.tensor(pages)
    W = int(pages.max())
    ids = torch.arange(1, pages.numel() * W + 1).reshape(*pages.shape, W)
    return ids.masked_fill(torch.arange(W) >= pages[..., None], 0).int()


def test_length_classes_minimise_pages_read():
    classes = ragged.page_classes(owning([[1, 200, 2, 190]]))
    assert sorted(sorted(c.tolist()) for c, _ in classes) == [[0, 2], [1, 3]]
    assert sorted(width for _, width in classes) == [2, 200], "each class reads up to its longest head"
    assert len(ragged.page_classes(owning([[44] * 3] * 2))) == 1, "equal heads: the plain path"


def test_compact_moves_kept_rows_only():
    cache, k, v = filled_cache([9, 6])
    keep = torch.tensor([[[0, 3, 8, 0], [1, 2, 4, 5]]])
    count = torch.tensor([[3, 4]])
    before = cache.k_pages.clone()
    torch.ops.kvcompile.compact(cache.k_pages, cache.v_pages, cache.page_pos, cache.page_lw, cache.page_table[0], keep,
                                count)
    cache.lengths = count[None].int()
    keys, values, pos, valid = cache.dense(0)
    torch.testing.assert_close(keys[0, 0, :3], k[0, 0, [0, 3, 8]])
    torch.testing.assert_close(values[0, 1, :4], v[0, 1, [1, 2, 4, 5]])
    assert pos[0, 0, :3].tolist() == [0, 3, 8]
    assert torch.equal(cache.k_pages[0], before[0]), "the scratch page is nobody's"


def _attention_args(T, packed=False):
    cache, k, v = filled_cache([6, 3], shuffle=not packed)
    q = torch.randn(1, 4, T, 8)
    kn, vn = torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    qp = torch.arange(6, 6 + T)[None]
    slots = torch.zeros(1, 1, 2, T, dtype=torch.long)
    ring_slots = qp % 2  # a ring of two slots
    empty = PagedKVCache(1, 2, 4, 8, page_size=4)
    empty.setup(1)
    fmt = tuple(getattr(empty, name) for name in FORMAT_TENSORS)  # no format pool: attention skips it
    return (q, kn, vn, qp, slots, ring_slots, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_lw,
            cache.page_table, cache.lengths, torch.zeros(1, 1, 4, 2, 8), torch.zeros(1, 1, 4, 2), list(fmt), 0, 0.35, 0)


@pytest.mark.parametrize("op, T", [("prefill_attention", 3), ("decode_attention", 1), ("decode_attention_packed", 1)])
def test_opcheck_attention(op, T):
    torch.library.opcheck(getattr(torch.ops.kvcompile, op).default, _attention_args(T, packed=op.endswith("packed")))


def test_packed_decode_matches_gathering_decode():
    """The packed op reads the layer's pages as one slice of the pool; it answers what the gathering op answers."""
    args = _attention_args(1, packed=True)
    gathered = torch.ops.kvcompile.decode_attention(*[a.clone() if torch.is_tensor(a) else a for a in args])
    torch.testing.assert_close(torch.ops.kvcompile.decode_attention_packed(*args), gathered)


@pytest.mark.parametrize("held, start", [([5, 1, 9], 9), ([8, 8], 8), ([0, 6], 6), ([5, 7], 4)],
                         ids=["ragged", "equal", "empty-head", "overlapping"])
def test_prefill_after_held_entries_matches_dense_causal_attention(held, start):
    """T new tokens after what each head holds (a later prefill chunk, a question after compression): the prefill
    op answers plain causal attention over each head's held entries and the new ones, both where its split path
    applies (new tokens after every held one) and where it does not ("overlapping": a held position after the first
    new one, served by the general path)."""
    T, Hkv, P, D = 6, len(held), 4, 8
    cache, k, v = filled_cache([n + T for n in held], P=P, D=D, Hq=2 * Hkv)  # room for T more per head
    g = torch.Generator().manual_seed(fresh_seed())
    q, kn, vn = torch.randn(1, 2 * Hkv, T, D, generator=g), *torch.randn(2, 1, Hkv, T, D, generator=g)
    before = torch.tensor([[held]], dtype=torch.int32)
    slots = reference.rows_of(cache.page_table[0], before[0, ..., None].long() + torch.arange(T), P)[None]
    qp = torch.arange(start, start + T)[None]
    empty = PagedKVCache(1, Hkv, 2 * Hkv, D, page_size=P)
    empty.setup(1)
    fmt = [getattr(empty, name) for name in FORMAT_TENSORS]
    out = torch.ops.kvcompile.prefill_attention(
        q, kn, vn, qp, slots, torch.zeros(1, T, dtype=torch.long), cache.k_pages, cache.v_pages, cache.page_pos,
        cache.page_lw, cache.page_table, before + T, torch.zeros(1, 1, 2 * Hkv, 0, D), torch.zeros(1, 1, 2 * Hkv, 0),
        fmt, 0, 0.3, 0)
    for h, n in enumerate(held):
        keys, values = torch.cat([k[0, h, :n], kn[0, h]]), torch.cat([v[0, h, :n], vn[0, h]])
        visible = torch.cat([torch.arange(n), qp[0]])[None] <= qp[0, :, None]
        for r in (2 * h, 2 * h + 1):
            logits = (q[0, r] @ keys.T * 0.3).masked_fill(~visible, float("-inf"))
            torch.testing.assert_close(out[0, r], torch.softmax(logits, -1) @ values, atol=1e-5, rtol=1e-5)


def test_packed_follows_every_page_table_change():
    cache = PagedKVCache(1, 2, 4, 8, page_size=4)
    cache.setup(1)
    cache.reserve(12)
    assert cache.packed(), "equal heads after reserve: the run 1, 2, 3, ..."
    cache.append(torch.ones(1, 12, dtype=torch.bool))
    shorten(cache, [[[12, 4]]])  # the short head gives pages back: heads no longer equally long
    assert not cache.packed()
    cache.reserve(4)  # 4 and 2 pages: still uneven
    cache.append(torch.ones(1, 4, dtype=torch.bool))
    assert not cache.packed()
    shorten(cache, [[[8, 8]]])
    cache.pack()  # two pages each again, renumbered in order
    assert cache.packed()


def test_opcheck_compact():
    cache, _, _ = filled_cache([9, 6])
    args = (cache.k_pages, cache.v_pages, cache.page_pos, cache.page_lw, cache.page_table[0],
            torch.tensor([[[0, 3, 8, 0], [1, 2, 4, 5]]]), torch.tensor([[3, 4]]))
    torch.library.opcheck(torch.ops.kvcompile.compact.default, args)


def test_reserve_release_and_trim_return_memory():
    cache = PagedKVCache(2, 2, 2, 8, page_size=4)
    cache.setup(2)
    cache.reserve(torch.tensor([10, 3]))
    assert cache.n_pages.tolist() == [[[3, 3], [1, 1]]] * 2
    cache.append(torch.tensor([[True] * 10, [False] * 7 + [True] * 3]))
    assert cache.k_pages.shape[0] >= 1 + int(cache.n_pages.sum()), "the pool holds every owned page"
    shorten(cache, [[[2, 5], [3, 1]]] * 2)
    assert cache.n_pages.tolist() == [[[1, 2], [1, 1]]] * 2
    keys_before = [cache.dense(layer) for layer in range(2)]
    cache.trim()
    assert cache.k_pages.shape[0] == 1 + int(cache.n_pages.sum())
    for layer in range(2):
        for a, b in zip(keys_before[layer], cache.dense(layer)):
            assert torch.equal(a, b), "trim renumbers pages without changing what heads hold"


def test_reserve_packs_heads_without_changing_them():
    cache = PagedKVCache(2, 2, 2, 8, page_size=4)
    cache.setup(2)
    cache.reserve(torch.tensor([6, 3]))
    n = 6
    k = torch.randn(2, 2, n, 8)
    step = cache.append(torch.tensor([[True] * 6, [True] * 3 + [False] * 3]))
    for layer in range(2):
        reference.write_tokens(cache.k_pages, cache.v_pages, cache.page_pos, k, k, step.q_pos, step.slots[layer])
    cache.release_unused()
    before = [cache.dense(layer) for layer in range(2)]
    cache.reserve(5)  # rows grow unevenly after pages were given up; reserve packs them again
    owned = torch.arange(cache.page_table.shape[-1]) < cache.n_pages[..., None]
    assert cache.page_table[owned].tolist() == list(range(1, int(owned.sum()) + 1)), "pages consecutive, in order"
    cache.pack()  # already packed: nothing moves
    for layer in range(2):
        valid = before[layer][3]
        for a, b in zip(before[layer], cache.dense(layer)):
            assert torch.equal(a[valid], b[:, :, : a.shape[2]][valid]), "the same tokens, on a wider page table"
        torch.testing.assert_close(before[layer][0][0, :, :6], k[0])
        torch.testing.assert_close(before[layer][0][1, :, :3], k[1, :, :3])


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "packed"])
def test_flex_paged_decode_matches_the_reference(shuffle, window):
    """The flex_attention formulation (``kernels.flex``) of a decode step over ragged heads, one of them empty,
    equals the reference on fresh random inputs."""
    from kvcompile.kernels.flex import flex_paged_decode

    seed = fresh_seed()
    lengths = [5, 0, 37, 16]
    cache, _, _ = filled_cache(lengths, P=4, Hq=2 * len(lengths), seed=seed, shuffle=shuffle)
    q = torch.randn(1, 2 * len(lengths), 1, 8, generator=torch.Generator().manual_seed(seed))
    qp = torch.full((1, 1), 40)
    args = (q, qp, cache.k_pages, cache.v_pages, cache.page_pos, cache.page_table[0], cache.lengths[0], 0.3, window)
    torch.testing.assert_close(flex_paged_decode(*args), reference.paged_attention(*args), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {seed}: {m}")
    # what follows from the page table is kept until it changes: new lengths alone, then a changed table, are read
    cache.lengths[0] -= (cache.lengths[0] > 0).int()
    torch.testing.assert_close(flex_paged_decode(*args), reference.paged_attention(*args), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {seed}, shorter heads on the same pages: {m}")
    cache.page_table[0, 0] = cache.page_table[0, 0].flip(0)  # two heads swap their pages (and so their tokens)
    cache.lengths[0, 0] = cache.lengths[0, 0].flip(0)
    torch.testing.assert_close(flex_paged_decode(*args), reference.paged_attention(*args), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {seed}, pages swapped between heads: {m}")


def test_eager_runs_call_the_op_bodies_and_the_programs_keep_the_ops(llama_cm):
    """An eager decode step reaches no kvcompile op through the dispatcher (its bookkeeping cost 0.6 ms per call:
    ``passes.for_eager_run``), while the programs that are compiled, saved and exported still call the ops."""
    from conftest import left_padded_batch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Namespaces(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.namespace)
            return func(*args, **(kwargs or {}))

    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    ids, mask = left_padded_batch([20, 14], total=20)
    token = cm.generate(ids, mask, max_new_tokens=1)[:, -1:]
    with Namespaces() as mode:
        logits = cm.decode(token)
    assert "aten" in mode.seen and "kvcompile" not in mode.seen, sorted(mode.seen)
    assert torch.isfinite(logits).all()
    targets = {n.target for p in (cm.programs.decode, cm.programs.prefill) for n in p.graph.nodes}
    assert {torch.ops.kvcompile.decode_attention.default, torch.ops.kvcompile.prefill_attention.default} <= targets
