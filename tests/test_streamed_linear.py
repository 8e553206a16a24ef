"""StreamWeightsLinear: decode's projections as (W @ x^T)^T on CPU, the same function as F.linear."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.passes.streamed_linear import streamed_linear
from kvcompile.programs import Programs

aten = torch.ops.aten


@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (3, 5), (7,)])
@pytest.mark.parametrize("bias", [False, True])
def test_streamed_linear_matches_linear(shape, bias):
    x = torch.randn(*shape, 24)
    w = torch.randn(40, 24)
    b = torch.randn(40) if bias else None
    torch.testing.assert_close(streamed_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert streamed_linear(x, w, b).shape == (*shape, 40)


def _targets(program):
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def test_only_the_cpu_decode_programs_stream_their_weights(llama_cm):
    captured = llama_cm.programs.captured
    linears = _targets(captured).count(aten.linear.default)
    assert linears == 3 * 7 + 1, "q, k, v, o, gate, up, down per layer, and the vocabulary projection"
    programs = Programs.rewrite(captured, llama_cm.spec)  # CPU: on by default
    for decode in (programs.decode, programs.decode_packed):
        assert _targets(decode).count(streamed_linear) == linears and aten.linear.default not in _targets(decode)
    for prefill in (programs.prefill, programs.prefill_last):
        assert streamed_linear not in _targets(prefill)
    plain = Programs.rewrite(captured, llama_cm.spec, stream_weights=False)
    assert streamed_linear not in _targets(plain.decode) + _targets(plain.decode_packed)


def test_streamed_and_plain_decode_agree(llama_cm):
    """The same logits with and without the pass (up to summation order), step after step on a growing cache."""
    streamed = kvcompile.apply(llama_cm, budget=1.0, recipe="full", page_size=4)
    programs = Programs.rewrite(llama_cm.programs.captured, llama_cm.spec, stream_weights=False)
    plain = kvcompile.CompressedModel(programs, llama_cm.spec, kvcompile.recipes()["full"], kvcompile.Budget.parse(1.0),
                                      page_size=4)
    ids = torch.randint(2, 90, (3, 9))
    token = streamed.prefill(ids)[:, -1:].argmax(-1)
    plain.prefill(ids)
    for _ in range(6):
        a, b = streamed.decode(token), plain.decode(token)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        token = a[:, -1].argmax(-1, keepdim=True)
