"""The compiled path: no graph breaks, one decode compilation over many steps, same logits as eager."""

from __future__ import annotations

import torch
from conftest import left_padded_batch
from torch._dynamo.testing import CompileCounterWithBackend

import kvcompile


def test_compiled_decode_compiles_once_and_matches_eager(llama_cm):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = kvcompile.apply(llama_cm, budget=0.5, recipe="adakv-snapkv", page_size=4, compile=counter)
    eager = kvcompile.apply(llama_cm, budget=0.5, recipe="adakv-snapkv", page_size=4)
    ids, mask = left_padded_batch([48, 30], total=48)
    a, b = compiled.prefill(ids, mask), eager.prefill(ids, mask)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for cm in (compiled, eager):
        cm.cache.reserve(64)
        cm._room = 64
    for step in range(64):
        token = b[:, -1].argmax(-1, keepdim=True)
        a, b = compiled.decode(token), eager.decode(token)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"decode step {step}: {m}")
    assert counter.frame_count == 2, "one prefill and one decode compilation, no graph breaks, no recompiles"
    assert len(set(compiled.cache.lengths.flatten().tolist())) > 1, "per-head lengths differ while decoding"


def test_compile_traces_into_the_decode_op(llama_cm):
    """decode_attention is a triton_op: AOT tracing decomposes it into the ops of its body (the Triton kernel on
    CUDA, the reference here), so Inductor sees the attention itself; prefill_attention stays one opaque node."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # mutating ops come auto_functionalized
        graphs.append({str(n.args[0] if "auto_functionalized" in str(n.target) else n.target) for n in calls})
        return make_boxed_func(gm.forward)

    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full", compile=aot_autograd(fw_compiler=record))
    logits = cm.prefill(torch.randint(2, 90, (1, 12)))
    cm.decode(logits[:, -1].argmax(-1, keepdim=True))
    assert cm.cache.packed() and cm.programs.decode_packed is None, "compiled: the traced decode, packed or not"
    prefill, decode = graphs
    assert any("prefill_attention" in t for t in prefill)
    assert not any("decode_attention" in t for t in decode)
    assert any("index_put" in t for t in decode), "the op's body (writing the new token) is in the graph"


def test_compiled_decode_writes_the_pool_in_place(llama_cm):
    """Inductor must write the new token into the pool, not clone the pool (and copy it back) every step: a pool
    written through a view (index_copy_ on k_pages.view(-1, D)) did exactly that."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4, compile=True)
    logits = cm.prefill(torch.randint(2, 90, (2, 12)))
    cm.cache.reserve(8)
    cm._room = 8
    _, codes = run_and_get_code(cm.decode, logits[:, -1].argmax(-1, keepdim=True))
    N, P, D = cm.cache.k_pages.shape
    assert codes, "the decode step was compiled"
    for shape in (f"({N}, {P}, {D})", f"({N * P}, {D})"):
        assert not any(f"empty_strided_cpu({shape}" in code for code in codes), f"a pool-sized buffer {shape}"
