"""What a serving user hits first: bad input changes nothing, re-targeting does not leak, fork keeps what its
recipe reads, an interrupted call leaves the model usable."""

from __future__ import annotations

import gc
import signal
from dataclasses import dataclass

import pytest
import torch
from conftest import VOCAB, left_padded_batch

import kvcompile
from kvcompile.methods.base import Scorer, register_scorer


def snapshot(cm):
    return None if cm.seen is None else (cm.cache_stats(), [t.clone() for t, _ in cm.cache.tensors().values()])


def assert_unchanged(cm, before):
    after = snapshot(cm)
    if before is None:
        assert after is None
        return
    assert after[0] == before[0], "cache_stats() changed"
    assert all(torch.equal(a, b) for a, b in zip(after[1], before[1])), "a cache tensor changed"


@pytest.fixture
def filled(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv", page_size=4)
    ids, mask = left_padded_batch([30, 20], total=30)
    cm.prefill(ids, mask)
    return cm, ids


BAD = [
    (lambda cm: cm.decode(torch.tensor([[VOCAB], [1]])), "token id 96, outside the model's vocabulary"),
    (lambda cm: cm.decode(torch.tensor([[-1], [1]])), "outside the model's vocabulary"),
    (lambda cm: cm.prefill(torch.tensor([[1, VOCAB + 5], [1, 2]])), "outside the model's vocabulary"),
    (lambda cm: cm.decode_many(torch.tensor([[1, 2], [3, VOCAB]])), "outside the model's vocabulary"),
    (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=1.5), "max_new_tokens must be"),
    (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=True), "max_new_tokens must be"),
    (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), do_sample=True, temperature=float("nan")),
     "finite temperature"),
    (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), do_sample=True, top_p=float("nan")), "top_p"),
    (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), eos_token_id="x"), "eos_token_id"),
    (lambda cm: cm.generate(torch.ones(2, 4, dtype=torch.long), generator=3), "generator"),
    (lambda cm: cm.generate(torch.tensor([[1, VOCAB]])), "vocabulary"),
    (lambda cm: cm.fork("nope"), "unknown recipe"),
    (lambda cm: cm.fork("snapkv", 2.0), "fraction"),
]


@pytest.mark.parametrize("call, message", BAD)
def test_bad_input_changes_nothing_and_the_next_call_is_the_same(filled, call, message):
    cm, ids = filled
    before = snapshot(cm)
    with pytest.raises(ValueError, match=message):
        call(cm)
    assert_unchanged(cm, before)
    fresh = kvcompile.apply(cm, budget=0.5, recipe="snapkv", page_size=4)
    fresh.prefill(*left_padded_batch([30, 20], total=30))
    torch.testing.assert_close(cm.decode(ids[:, -1:]), fresh.decode(ids[:, -1:]))


@pytest.mark.parametrize("budget", [10**30, 2**41, "1e30B", "100000000000000000000GB"])
def test_absurd_budgets_are_refused_by_apply(llama_cm, budget):
    with pytest.raises(ValueError, match="budget"):
        kvcompile.apply(llama_cm, budget=budget, recipe="snapkv")


def test_a_cap_too_small_for_the_schedule_is_refused_by_apply(llama_cm):
    with pytest.raises(ValueError, match="raise the budget"):
        kvcompile.apply(llama_cm, budget=3, recipe="h2o-decode")


def test_fork_to_a_decode_time_recipe_decodes(llama_cm):
    """The parent kept 32 queries (SnapKV's window); the fork reads what InertiaKV's schedule reads."""
    parent = kvcompile.apply(llama_cm, budget=1.0, recipe="snapkv", page_size=4)
    ids, _ = left_padded_batch([80], total=80)
    parent.prefill(ids, compress=False)
    child = parent.fork("inertiakv", 64)
    token = ids[:, -1:]
    for _ in range(40):
        token = child.decode(token)[:, -1].argmax(-1, keepdim=True)
    assert int(child.cache.lengths.max()) <= 64
    assert child.cache_stats()["ring_queries"] == child.decode_window


def test_fork_refuses_a_window_the_parent_did_not_keep(llama_cm):
    parent = kvcompile.apply(llama_cm, budget=1.0, recipe="tova", page_size=4)  # keeps 1 query
    parent.prefill(left_padded_batch([80], total=80)[0], compress=False)
    with pytest.raises(ValueError, match="reads the last 32 queries of each layer but this cache kept 1"):
        parent.fork("snapkv", 0.5)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_retargeting_shares_the_programs_and_does_not_grow_memory(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe="snapkv")
    assert cm.programs is llama_cm.programs, "re-targeting rewrites nothing"
    for _ in range(20):  # warm up allocator pools
        kvcompile.apply(cm, budget=0.5, recipe="snapkv")
    gc.collect()
    start = rss_bytes()
    for _ in range(200):
        cm = kvcompile.apply(cm, budget=0.5, recipe="snapkv")
    gc.collect()
    grown = rss_bytes() - start
    assert grown < 2 * 2**20, f"200 re-targets grew RSS by {grown / 2**20:.1f} MiB"


class Interrupt(Exception):
    pass


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("recipe, budget", [("snapkv", 0.5), ("inertiakv", 40)])
@pytest.mark.slow
def test_an_interrupted_generate_leaves_the_model_usable(llama_cm, recipe, budget):
    """KeyboardInterrupt lands anywhere inside generate (a timer, at several delays); the next call starts clean."""
    cm = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4)
    ids, mask = left_padded_batch([60, 45], total=60)
    want = kvcompile.apply(llama_cm, budget=budget, recipe=recipe, page_size=4).generate(
        ids, mask, max_new_tokens=30, eos_token_id=[])

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupted = 0
    try:
        for delay in (0.002, 0.01, 0.03, 0.06, 0.1, 0.2):
            signal.setitimer(signal.ITIMER_REAL, delay)
            try:
                cm.generate(ids, mask, max_new_tokens=30, eos_token_id=[])
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert torch.equal(cm.generate(ids, mask, max_new_tokens=30, eos_token_id=[]), want), f"after {delay} s"
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert interrupted, "no call was interrupted: the delays are too long for this machine"


@register_scorer("interrupting")
@dataclass
class Interrupting(Scorer):
    """Raises KeyboardInterrupt while it scores: a compression stopped half way."""

    def score(self, obs):
        raise KeyboardInterrupt


def test_a_call_stopped_half_way_asks_for_reset_and_generate_starts_clean(llama_cm):
    cm = kvcompile.apply(llama_cm, budget=0.5, recipe=kvcompile.Recipe("interrupting", "interrupting"), page_size=4)
    ids, _ = left_padded_batch([40], total=40)
    with pytest.raises(KeyboardInterrupt):
        cm.prefill(ids)
    with pytest.raises(RuntimeError, match="call reset"):
        cm.decode(ids[:, -1:])
    full = kvcompile.apply(cm, budget=1.0, recipe="full", page_size=4)
    cm.reset()
    torch.testing.assert_close(cm.prefill(ids, compress=False), full.prefill(ids))
