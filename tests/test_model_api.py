"""The CompressedModel as a user holds it: truthful labels, a module whose weights move with .to(), a forward, and
a generation loop that does not wait for the device at every step."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from torch.overrides import TorchFunctionMode

import kvcompile

READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy"}


class DeviceReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host (each one a synchronisation on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in READS
        return func(*args, **(kwargs or {}))


def test_query_aware_records_how_the_call_compressed(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    ids, mask = left_padded_batch([40, 30], total=40)
    cm.generate(ids, mask, max_new_tokens=2)
    assert cm.cache_stats()["query_aware"] is True, "the question was compressed with the context"
    cm.generate(ids[:, -5:], context_ids=ids[:, :-5], max_new_tokens=2)
    assert cm.cache_stats()["query_aware"] is False, "the context was compressed before the question was read"
    cm.reset()
    cm.prefill(ids, mask)
    assert cm.cache_stats()["query_aware"] is None, "prefill was not told which part is the question"


def test_moving_to_float64_matches_a_float64_apply():
    model = tiny_model("qwen2", seed=3, layers=2)
    cm = kvcompile.apply(model, budget=0.5, recipe="adakv-snapkv", page_size=4)
    assert sum(p.numel() for p in cm.parameters()) == sum(p.numel() for p in model.parameters())
    moved = cm.to(torch.float64)
    assert moved is cm and all(p.dtype == torch.float64 for p in cm.parameters())
    reference = kvcompile.apply(tiny_model("qwen2", seed=3, layers=2).double(), budget=0.5, recipe="adakv-snapkv",
                                page_size=4)
    ids, mask = left_padded_batch([30, 22], total=30)
    a, b = cm.prefill(ids, mask), reference.prefill(ids, mask)
    assert a.dtype == torch.float64 and cm.cache.k_pages.dtype == torch.float64
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(cm.decode(ids[:, -1:]), reference.decode(ids[:, -1:]), atol=1e-10, rtol=1e-10)


def test_forward_is_a_fresh_prefill(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=1.0, recipe="full")
    ids, mask = left_padded_batch([20, 12], total=20)
    first = cm(ids, mask)
    torch.testing.assert_close(cm(ids, mask), first)
    assert cm.seen.tolist() == [20, 12]


@pytest.mark.parametrize("recipe, budget", [("snapkv", 0.5), ("inertiakv", 48)])
def test_generation_reads_the_device_once_every_few_steps(llama_cm, recipe, budget):
    """Counted over the decode loop alone (prefill and compression may sync): at most one read per
    ``generation.CHECK_EVERY`` steps plus the decode schedule's runs (every 16 steps)."""
    from kvcompile import generation

    cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
    ids, _ = left_padded_batch([30], total=30)
    new = 96
    reads = DeviceReads()
    prefill_reads = DeviceReads()
    with prefill_reads:
        cm.generate(ids, max_new_tokens=1, eos_token_id=[0])
    with reads:
        out = cm.generate(ids, max_new_tokens=new, eos_token_id=[0])
    steps = out.shape[1] - ids.shape[1]
    loop = reads.count - prefill_reads.count
    decoder = cm.request.decoder
    runs = 0 if decoder is None else decoder.steps // decoder.schedule.every + 1
    per_run = 16  # a run scores, plans and re-reserves: it syncs, once per 16 steps
    assert loop <= steps // generation.CHECK_EVERY + 2 + runs * per_run, f"{loop} device reads over {steps} steps"
    assert runs or loop <= steps // generation.CHECK_EVERY + 2
