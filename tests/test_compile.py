"""The compiled path: no graph breaks, one decode compilation over many steps, same logits as eager."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch
from torch._dynamo.testing import CompileCounterWithBackend

import kvcompile


@pytest.mark.parametrize(
    "recipe, budget, rows", [("adakv-snapkv", 0.5, [48, 30]), ("snapkv", 0.5, [48, 48])], ids=["ragged", "packed"]
)
@pytest.mark.slow
def test_compiled_decode_compiles_once_and_matches_eager(llama_cm, recipe, budget, rows):
    """64 decode steps, lengths changing every step: one decode compilation (of the program the layout picks)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4, compile=counter)
    eager = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch(rows, total=48)
    a, b = compiled.prefill(ids, mask), eager.prefill(ids, mask)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    packed = compiled.cache.packed()
    for step in range(64):
        token = b[:, -1].argmax(-1, keepdim=True)
        a, b = compiled.decode(token), eager.decode(token)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"decode step {step}: {m}")
    assert counter.frame_count == 2, "one prefill and one decode compilation, no graph breaks, no recompiles"
    assert packed == (rows[0] == rows[1]) and compiled.cache.packed() == packed
    if not packed:
        assert len(set(compiled.cache.lengths.flatten().tolist())) > 1, "per-head lengths differ while decoding"


@pytest.mark.slow
def test_compile_traces_into_the_decode_op(llama_cm, monkeypatch):
    """The decode ops are triton_ops: AOT tracing decomposes them into the ops of their body (the Triton kernel on
    CUDA, the reference here), so Inductor sees the attention itself; prefill_attention stays one opaque node. The
    packed decode reads the pool as a slice, the other gathers pages (index_select). (The reference backend: by
    default the CPU body calls the native decode, one opaque op, ``test_cpu_native``.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    monkeypatch.setenv("KVCOMPILE_DECODE_BACKEND", "reference")
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # mutating ops come auto_functionalized
        graphs.append({str(n.args[0] if "auto_functionalized" in str(n.target) else n.target) for n in calls})
        return make_boxed_func(gm.forward)

    for rows, packed in (([12, 7], False), ([12, 12], True)):  # rows of two lengths: ragged, the gathering decode
        cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4, compile=aot_autograd(fw_compiler=record))
        ids, mask = left_padded_batch(rows, total=12)
        logits = cm.prefill(ids, mask)
        cm.decode(logits[:, -1].argmax(-1, keepdim=True))
        assert cm.cache.packed() == packed
    prefill, decode, _, decode_packed = graphs
    assert any("prefill_attention" in t for t in prefill)
    for graph in (decode, decode_packed):
        assert not any("decode_attention" in t for t in graph)
        assert any("index_put" in t for t in graph), "the op's body (writing the new token) is in the graph"
    assert any("index_select" in t for t in decode) and not any("index_select" in t for t in decode_packed)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "ragged"])
@pytest.mark.slow
def test_compiled_decode_writes_the_pool_in_place(llama_cm, packed):
    """Inductor must write the new token into the pool, not clone the pool (and copy it back) every step: a pool
    written through a view (index_copy_ on k_pages.view(-1, D)) did exactly that. Both decode programs: the packed
    one reads the pool as a slice, the other gathers pages."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4, compile=True)
    ids, mask = left_padded_batch([12, 12 if packed else 7], total=12)
    logits = cm.prefill(ids, mask)
    cm.decode(logits[:, -1].argmax(-1, keepdim=True))  # reserves room for the next steps
    assert cm.cache.packed() == packed
    _, codes = run_and_get_code(cm.decode, logits[:, -1].argmax(-1, keepdim=True))
    N, P, D = cm.cache.k_pages.shape
    assert codes, "the decode step was compiled"
    for shape in (f"({N}, {P}, {D})", f"({N * P}, {D})"):
        assert not any(f"empty_strided_cpu({shape}" in code for code in codes), f"a pool-sized buffer {shape}"


@pytest.mark.slow
def test_one_process_serves_many_shape_classes_compiled():
    """Recipes with and without an observation ring or weighted pages, one row or two, the context apart or not:
    more shape classes than Dynamo's default of 8 compiled variants per program, which was a hard error under
    fullgraph (found by bench/soak.py --compiled). Every call runs and answers what the eager model answers."""
    from conftest import VOCAB, tiny_model

    base = kvcompile.apply(tiny_model("llama", seed=1), budget=1.0, recipe="full")
    g = torch.Generator().manual_seed(0)
    for recipe, budget in [("full", 1.0), ("snapkv", 0.5), ("certkv", 0.5), ("tova", 0.5), ("h2o", 0.5)]:
        for rows in ([9], [9, 5]):
            for apart in (False, True):
                T = max(rows)
                mask = torch.stack([torch.arange(T) >= T - n for n in rows]).long()
                ids = torch.randint(2, VOCAB - 1, (len(rows), T), generator=g)
                q = torch.randint(2, VOCAB - 1, (len(rows), 3), generator=g) if apart else ids
                args = (q, None, dict(context_ids=ids, context_mask=mask)) if apart else (ids, mask, {})
                got, want = (kvcompile.apply(base, budget=budget, recipe=recipe, compile=c).generate(
                    args[0], args[1], **args[2], max_new_tokens=2, eos_token_id=[]) for c in (True, False))
                assert torch.equal(got, want), f"{recipe} rows={rows} context apart={apart}"
