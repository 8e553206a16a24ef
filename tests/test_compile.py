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
