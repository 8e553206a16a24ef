"""Compiled serving: each decode program compiles once per batch size, for any prompt length, any number of
generated tokens and a decode-time schedule, without touching private state; tokens equal eager's."""

from __future__ import annotations

import collections
import os
import random

import pytest
import torch
from conftest import VOCAB, tiny_model
from torch._inductor.compile_fx import compile_fx

import kvcompile

KINDS = ("prefill_attention", "decode_attention_packed", "decode_attention")


class Recorder:
    """A torch.compile backend (Inductor) that records which program it compiled and for what batch size."""

    def __init__(self):
        self.compiles = collections.Counter()

    def __call__(self, gm, example_inputs):
        ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        kind = next(k for k in KINDS if any(k + "." in op for op in ops))
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        batch = next(x.shape[0] for name, x in zip(names, example_inputs) if "input_ids" in name)
        self.compiles[kind, str(batch)] += 1
        return compile_fx(gm, example_inputs)

    def decode_compiles(self):
        return {k: n for k, n in self.compiles.items() if k[0].startswith("decode")}


@pytest.fixture(scope="module")
def long_model():
    model = tiny_model("llama", layers=2)
    model.config.max_position_embeddings = 4096  # RoPE does not read it: lets 2,000-token prompts through
    return kvcompile.apply(model, budget=1.0, recipe="full")


def prompts(seed: int, n: int, vocab: int = VOCAB):
    """(input_ids, attention_mask) of ``n`` requests: random lengths 1..2000, batches of 1 and 2 (left-padded)."""
    rng = random.Random(seed)
    for i in range(n):
        rows = [rng.randint(1, 2000) for _ in range(1 + i % 2)]
        T = max(rows)
        ids = torch.randint(2, vocab - 1, (len(rows), T), generator=torch.Generator().manual_seed(seed + i))
        mask = torch.stack([torch.arange(T) >= T - r for r in rows]).long()
        yield ids, mask


def serve(base, recipe, budget, vocab: int):
    """30 generate calls of random lengths and batch sizes and a 500-step decode loop, compiled against eager;
    returns the compilations, by (program, batch size)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recorder = Recorder()
    compiled = kvcompile.apply(base, budget=budget, recipe=recipe, compile=recorder)
    eager = kvcompile.apply(base, budget=budget, recipe=recipe)
    for i, (ids, mask) in enumerate(prompts(seed=17, n=30, vocab=vocab)):
        kwargs = dict(max_new_tokens=3 + i % 5, eos_token_id=[])
        got, want = compiled.generate(ids, mask, **kwargs), eager.generate(ids, mask, **kwargs)
        assert torch.equal(got, want), f"request {i} (lengths {mask.sum(1).tolist()}): compiled tokens differ"
    token = torch.tensor([[5]])
    compiled.reset(), eager.reset()
    compiled.prefill(token.expand(1, 40).contiguous())
    eager.prefill(token.expand(1, 40).contiguous())
    for step in range(500):
        a, b = compiled.decode(token), eager.decode(token)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"decode step {step}: {m}")
        token = b[:, -1].argmax(-1, keepdim=True)
    decode = recorder.decode_compiles()
    assert decode and all(n == 1 for n in decode.values()), f"decode programs recompiled: {dict(recorder.compiles)}"
    unique = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert unique == sum(recorder.compiles.values()), (unique, dict(recorder.compiles))
    print(f"compiles ({recipe}): {dict(recorder.compiles)}; dynamo unique_graphs {unique}")


@pytest.mark.parametrize("recipe, budget", [("adakv-snapkv", 0.5), ("inertiakv", 96)], ids=["ragged", "decode-cap"])
@pytest.mark.slow
def test_thirty_prompt_lengths_and_500_decode_steps_compile_decode_once_per_batch_size(long_model, recipe, budget):
    serve(long_model, recipe, budget, VOCAB)


@pytest.mark.slow
@pytest.mark.skipif("KVCOMPILE_LONG" not in os.environ, reason="about 20 minutes on 2 cores: KVCOMPILE_LONG=1")
@pytest.mark.parametrize("recipe, budget", [("adakv-snapkv", 0.25), ("inertiakv", 256)])
def test_smollm2_compiles_decode_once_per_batch_size(recipe, budget):
    model, _ = kvcompile.load_model("smollm2-135m")
    serve(kvcompile.apply(model, budget=1.0, recipe="full"), recipe, budget, model.config.vocab_size)
