"""The native CPU decode (``kernels.cpu_native``) against plain softmax attention over the decoded rows, on fresh
random pools of every format it reads and on ragged fp32 heads, its one-row projection against ``F.linear``, and
both through the public API with the native path switched off (``KVCOMPILE_DECODE_BACKEND=reference``); each for
this machine's build and, in the full suite, the AVX2 build (``KVCOMPILE_NATIVE_ARCH=haswell``). The
native kernels are forced on (``KVCOMPILE_DECODE_BACKEND=native``) rather than chosen by timing (``auto``,
``tests/test_backend_chooser.py``), so each test reads them whichever is faster on the machine."""

from __future__ import annotations

import pytest
import torch
from conftest import fast_first, fresh_seed, left_padded_batch

import kvcompile
from kvcompile.kernels import chooser, cpu_native
from kvcompile.kernels.formats import FORMATS, encode_pool
from kvcompile.kernels.paging import gather_pages

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the PyTorch path serves")

FORMAT_NAMES = ["int8", "int4", "int3", "int2", "fp8", "kivi2", "kivi4"]


# the build for this machine, and (full suite) the build an AVX2-only x86 machine runs, where this one can run it
ARCHES = ["native"] + (["haswell"] if {"avx2", "fma"} <= set(chooser.cpu()[1]) else [])


@pytest.fixture(autouse=True, params=fast_first(ARCHES, ids=ARCHES))
def native_forced(request, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "native")
    monkeypatch.setenv("KVCOMPILE_NATIVE_ARCH", request.param)
    if cpu_native.library() is None:
        pytest.skip(f"the native library does not build for -march={request.param} here")


def attended(calls: list, state):
    """Record a call of ``cpu_native.attend`` that read the pools (it returns None where it does not)."""
    if state is not None:
        calls.append(1)
    return state


def random_pages(D: int, P: int, lengths: list[int], g: torch.Generator):
    """fp32 key and value pages holding heads of the given lengths on shuffled pages (page 0 unused), with an
    outlier key channel, and their page table and lengths; page-table columns past a head's pages name page 0."""
    widths = [-(-n // P) for n in lengths]
    n_pages = 1 + sum(widths)
    k, v = torch.randn(n_pages, P, D, generator=g), torch.randn(n_pages, P, D, generator=g)
    k[..., 3] *= 30
    order = 1 + torch.randperm(n_pages - 1, generator=g)
    table = torch.zeros(len(lengths), max(widths + [1]), dtype=torch.int32)
    start = 0
    for i, w in enumerate(widths):
        table[i, :w] = order[start : start + w]
        start += w
    return k, v, table, torch.tensor(lengths, dtype=torch.int32)


def random_pool(name: str, D: int, P: int, lengths: list[int], g: torch.Generator):
    """``random_pages`` encoded in format ``name``."""
    k, v, table, lengths = random_pages(D, P, lengths, g)
    f = FORMATS[name]
    return f, (*encode_pool(f.key, k), *encode_pool(f.value, v)), table, lengths


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("D,G,P", [(64, 3, 16), (128, 4, 16), (16, 1, 1), (32, 8, 4)])
def test_native_attention_equals_softmax_over_the_decoded_rows(name, D, G, P):
    """One pass over the pool, each head as far as it holds (head lengths 1, P, P + 1, empty, ragged), against
    softmax attention over the rows decoded by the codecs: output and log-sum-exp."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    lengths = [1, P, P + 1, 0, 5 * P + 3, 37]
    f, (kc, km, vc, vm), table, lens = random_pool(name, D, P, lengths, g)
    B, Hkv = 2, 3
    table, lens = table.view(B, Hkv, -1), lens.view(B, Hkv)
    keys, values = (f.key, kc, km), (f.value, vc, vm)
    q = torch.randn(B, Hkv, G, D, generator=g) * D**-0.5
    assert cpu_native.serves(q, keys, values), f"{name}: the native path should serve"
    got, got_lse = cpu_native.attend(q, keys, values, table, lens)
    K = f.key.decode(gather_pages(kc, table), gather_pages(km, table), torch.float32)
    V = f.value.decode(gather_pages(vc, table), gather_pages(vm, table), torch.float32)
    held = torch.arange(K.shape[2]) < lens.unsqueeze(-1)
    logits = (q @ K.transpose(-1, -2)).masked_fill(~held[:, :, None], float("-inf"))
    want = torch.softmax(logits, -1).nan_to_num(0.0) @ V
    # fp32 sums in another order: errors relative to the sums of absolute products (keys have an outlier channel)
    score_scale = float((q.abs() @ K.abs().transpose(-1, -2)).max())
    torch.testing.assert_close(got, want, atol=1e-6 * float(V.abs().max()) * max(1.0, score_scale), rtol=1e-5,
                               msg=lambda m: f"seed {seed}: output: {m}")
    torch.testing.assert_close(got_lse, torch.logsumexp(logits, -1), atol=1e-5 * (score_scale + 1), rtol=1e-5,
                               msg=lambda m: f"seed {seed}: log-sum-exp: {m}")


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2"])
def test_native_attention_over_two_pools_is_one_softmax_over_both(name):
    """A head's rows split between a format pool and fp32 pages (a format cache's newest tokens), read in one call
    (``more``): the same as softmax over both pools' decoded rows together, output and log-sum-exp; heads empty in
    either pool or both included, and a second pool listing no pages at all."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    D, G, P, B, Hkv = 64, 3, 16, 2, 3
    f, (kc, km, vc, vm), table, lens = random_pool(name, D, P, [P + 1, 0, 37, 5 * P, 0, 3], g)
    k32, v32, table2, lens2 = random_pages(D, 4, [3, 9, 0, 1, 0, 4], g)
    q = torch.randn(B, Hkv, G, D, generator=g) * D**-0.5
    pools = [((f.key, kc, km), (f.value, vc, vm), table.view(B, Hkv, -1), lens.view(B, Hkv)),
             ((None, k32, None), (None, v32, None), table2.view(B, Hkv, -1), lens2.view(B, Hkv))]
    rows = []
    for (kcodec, k, km_), (vcodec, v, vm_), t, n in pools:
        K, V = gather_pages(k, t), gather_pages(v, t)
        if kcodec is not None:
            K = kcodec.decode(K, gather_pages(km_, t), torch.float32)
            V = vcodec.decode(V, gather_pages(vm_, t), torch.float32)
        rows.append((K, V, torch.arange(K.shape[2]) < n.unsqueeze(-1)))
    K, V, held = (torch.cat(x, 2) for x in zip(*rows))
    logits = (q @ K.transpose(-1, -2)).masked_fill(~held[:, :, None], float("-inf"))
    got, got_lse = cpu_native.attend(q, *pools[0], more=(pools[1],))
    torch.testing.assert_close(got, torch.softmax(logits, -1).nan_to_num(0.0) @ V, atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"seed {seed}: output: {m}")
    torch.testing.assert_close(got_lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"seed {seed}: log-sum-exp: {m}")
    no_pages = ((None, k32, None), (None, v32, None), table2.view(B, Hkv, -1)[..., :0], torch.zeros(B, Hkv))
    alone = cpu_native.attend(q, *pools[0])
    for a, b in zip(cpu_native.attend(q, *pools[0], more=(no_pages,)), alone):
        torch.testing.assert_close(a, b, msg=lambda m: f"seed {seed}: a pool of no pages: {m}")


@pytest.mark.parametrize("recipe", ["full", "full+int8", "snapkv+int4", "adakv+snapkv+int2", "adakv-snapkv", "kivi2"])
def test_decode_is_the_same_with_the_native_path_switched_off(llama_cm, recipe, monkeypatch):
    ids, mask = left_padded_batch([180, 147], total=180, seed=5)  # past kivi2's 128 recent tokens
    budget = 1.0 if recipe in ("full", "full+int8", "kivi2") else 0.5
    calls, native_attend = [], cpu_native.attend
    monkeypatch.setattr(cpu_native, "attend", lambda *a, **k: attended(calls, native_attend(*a, **k)))
    logits = []
    for backend in ("native", "reference"):
        monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", backend)
        cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
        nxt = cm.prefill(ids, mask)[:, -1:].argmax(-1)
        logits.append(torch.cat([cm.decode(nxt), cm.decode(nxt)], 1))
        assert bool(calls) == (backend == "native"), "the backend switches the native path on and off"
        calls.clear()
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("recipe", ["full", "adakv-snapkv"])
def test_a_compiled_decode_calls_the_native_decode(llama_cm, recipe, monkeypatch):
    """Compiled, the fp32 decode step is one opaque call to the native decode (``ops.native_decode``), with the
    logits of the eager PyTorch decode."""
    ids, mask = left_padded_batch([60, 47], total=60, seed=6)
    budget = 1.0 if recipe == "full" else 0.5
    calls, native_attend = [], cpu_native.attend
    monkeypatch.setattr(cpu_native, "attend", lambda *a, **k: attended(calls, native_attend(*a, **k)))
    logits = []
    for backend, compiled in (("reference", False), ("native", True)):
        monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", backend)
        cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4, compile=compiled)
        nxt = cm.prefill(ids, mask)[:, -1:].argmax(-1)
        calls.clear()
        logits.append(torch.cat([cm.decode(nxt), cm.decode(nxt)], 1))
        assert bool(calls) == compiled, "the compiled decode step calls the native decode"
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("I,O", [(576, 1536), (1536, 577), (64, 7), (16, 1), (32, 49157)])
def test_native_linear_equals_linear(I, O):
    """The one-row projection against ``F.linear`` on fresh random rows, weight rows past a multiple of 8 included;
    fp32 sums in another order: errors relative to the sums of absolute products."""
    g = torch.Generator().manual_seed(fresh_seed())
    x, w = torch.randn(1, I, generator=g), torch.randn(O, I, generator=g)
    w[:, 5] *= 40  # an outlier channel
    assert cpu_native.serves_linear(x, w)
    got, want = cpu_native.linear(x, w), torch.nn.functional.linear(x, w)
    torch.testing.assert_close(got, want, atol=2e-7 * float((x.abs() @ w.abs().t()).max()), rtol=1e-6)


@pytest.mark.parametrize("compiled", fast_first([False, True], ids=["eager", "compiled"]))
def test_a_batch_one_decode_projects_with_the_native_linear(llama_cm, compiled, monkeypatch):
    """A batch-1 decode step runs its projections on the native one-row projection (eager, and compiled through
    ``ops.native_linear``), with the logits of the PyTorch path; a batch of two does not call it."""
    calls, native_linear = [], cpu_native.linear
    monkeypatch.setattr(cpu_native, "linear", lambda *a: calls.append(1) or native_linear(*a))
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(fresh_seed()))
    for rows in (1, 2):
        logits = []
        for backend in ("reference", "native"):
            monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", backend)
            cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full", compile=compiled and backend == "native")
            nxt = cm.prefill(ids[:rows])[:, -1:].argmax(-1)
            calls.clear()
            logits.append(cm.decode(nxt))
            assert bool(calls) == (backend == "native" and rows == 1), (backend, rows)
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_compiler_that_fails_leaves_the_pytorch_path(tmp_path, monkeypatch):
    """No library is built (and a warning names why) when the compiler fails; the next call with a working
    compiler builds into the cache folder and reuses that build."""
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    cpu_native._built.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build"):
            assert cpu_native.library() is None
        assert not cpu_native.enabled()
        monkeypatch.delenv("CC")
        cpu_native._built.cache_clear()
        assert cpu_native.library() is not None
        assert len(list((tmp_path / "native").glob("cpu_decode-*.so"))) == 1
    finally:
        monkeypatch.undo()
        cpu_native._built.cache_clear()


@pytest.mark.parametrize("weighted", [False, True])
def test_native_ragged_fp32_decode_equals_the_gathering_path(weighted, monkeypatch):
    """fp32 heads of different lengths (an empty one among them) read in place as far as each holds, with and
    without log-weights, against the decode that gathers them (the native path switched off)."""
    from kvcompile.kernels import reference

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, D, P = 2, 3, 3, 32, 4
    lengths = torch.tensor([[1, 4, 5], [0, 23, 9]], dtype=torch.int32)
    widths = (lengths + P - 1) // P
    n_pages = 1 + int(widths.sum())
    k, v = torch.randn(n_pages, P, D, generator=g), torch.randn(n_pages, P, D, generator=g)
    order = (1 + torch.randperm(n_pages - 1, generator=g)).tolist()
    table = torch.zeros(B, Hkv, int(widths.max()), dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            table[b, h, : widths[b, h]] = torch.tensor([order.pop() for _ in range(widths[b, h])], dtype=torch.int32)
    lw = torch.randn(n_pages, P, generator=g).clamp_min(0) if weighted else None
    q, pos = torch.randn(B, Hkv * G, 1, D, generator=g), torch.zeros(n_pages, P, dtype=torch.int32)
    q_pos = torch.full((B, 1), 100)
    got = reference.paged_attention(q, q_pos, k, v, pos, table, lengths, 0.2, log_weights=lw)
    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "reference")
    want = reference.paged_attention(q, q_pos, k, v, pos, table, lengths, 0.2, log_weights=lw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    assert float(got[1, :G].abs().max()) == 0.0, "an empty head attends to nothing"
