"""A soak and a fuzz test of the public API: random prompt lengths, batch sizes, left padding, recipes, budgets
(fractions, tokens, bytes), two interleaved models, resets and forks, with the cache's invariants checked after
every call and every generation compared with a fresh model's. Seeded; the seed is in every failure message.

The suite runs a bounded soak (``SOAK_CALLS``); ``KVCOMPILE_SOAK=1000 pytest -m slow tests/test_soak.py -s`` runs
the long one (compiled models included) and prints RSS at the start and the end.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import VOCAB, spelled, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompile

SOAK_CALLS = 300
# FINCH compresses only with the question apart (tests/test_presses_b.py), which most calls here do not give
# learned recipes run on the model they were trained for (tests/test_kvzap.py)
RECIPES = sorted(n for n, r in kvcompile.recipes().items()
                 if r.scorer is not None and not r.query_aware and not r.trained_for)


@pytest.fixture(scope="module")
def bases():
    """Two captured models of different families (GQA Llama, sliding-window Gemma-3), long enough positions."""
    out = []
    for family in ("llama", "gemma3"):
        model = tiny_model(family, seed=11, layers=2)
        model.config.max_position_embeddings = 4096
        out.append(kvcompile.apply(model, budget=1.0, recipe="full", page_size=4))
    return out


def check_invariants(cm, where: str) -> None:
    """The cache's bookkeeping after any call: what each head holds fits what it owns, no page is owned twice,
    owned + free + scratch pages are the pool, every byte is accounted for, the budget holds."""
    if cm.seen is None:
        return
    c, stats = cm.cache, cm.cache_stats()
    P, N = c.page_size, c.k_pages.shape[0]
    assert (c.lengths.long() <= c.n_pages * P).all(), f"{where}: a head holds more than its pages"
    owned = torch.arange(c.page_table.shape[-1]) < c.n_pages[..., None]
    ids = c.page_table[owned]
    assert ids.unique().numel() == ids.numel() and (ids > 0).all() and (ids < N).all(), f"{where}: pages owned twice"
    assert ids.numel() + 1 <= N, f"{where}: the pool is smaller than what heads own"
    assert (c.page_table[~owned] == 0).all(), f"{where}: a slot past a head's pages points at a page"
    assert stats["bytes_allocated"] == sum(stats["bytes"].values())
    stored = sum(getattr(c, name).nbytes for name in ("fmt_k", "fmt_k_meta", "fmt_v", "fmt_v_meta"))  # format pool
    assert stats["bytes"]["payload"] + stats["bytes"]["free_pages"] == N * c.page_bytes + stored
    if stats["budget_bytes"] is not None and cm.request.decoder is None and cm.recipe.decode is None:
        decoded = int((c.seen - cm.request.context_tokens).sum())  # tokens appended after the compression
        L, B, Hkv = c.lengths.shape
        assert stats["bytes_held"] <= stats["budget_bytes"] + (decoded + L * B * Hkv * P) * L * Hkv * c.token_bytes, \
            f"{where}: over budget"


def random_budget(rng):
    kind = rng.choice(["fraction", "tokens", "bytes"])
    if kind == "fraction":
        return rng.choice([0.1, 0.25, 0.5, 1.0])
    if kind == "tokens":
        return rng.choice([16, 48, 128])
    return rng.choice(["24KiB", "100KiB"])


def random_batch(rng, max_len: int):
    rows = [rng.randint(1, max_len) for _ in range(rng.randint(1, 3))]
    T = max(rows)
    ids = torch.randint(2, VOCAB - 1, (len(rows), T), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    mask = torch.stack([torch.arange(T) >= T - r for r in rows]).long()
    return ids, mask


def soak(bases, calls: int, seed: int, compiled: bool = False, max_len: int = 160) -> None:
    rng = random.Random(seed)
    live = {}  # model index -> its current CompressedModel
    for call in range(calls):
        b = rng.randrange(len(bases))
        base = bases[b]
        op = rng.choice(["generate", "generate", "context", "prefill_decode", "fork", "reset"])
        where = f"seed={seed} call={call} op={op} model={b}"
        try:
            recipe, budget = spelled(rng.choice(RECIPES)), random_budget(rng)
            cm = kvcompile.apply(base, budget=budget, recipe=recipe, compile=compiled and rng.random() < 0.3)
        except ValueError as e:  # a cap too small for the recipe's schedule: refused by apply, by design
            assert "budget" in str(e), f"{where}: {e}"
            continue
        where += f" recipe={recipe.name} budget={budget}"
        ids, mask = random_batch(rng, max_len)
        new = rng.randint(1, 24)
        try:
            if op in ("generate", "context"):
                split = rng.randint(1, ids.shape[1] - 1) if op == "context" and ids.shape[1] > 1 else None
                args = (ids, mask) if split is None else (ids[:, split:], mask[:, split:])
                kwargs = {} if split is None else {"context_ids": ids[:, :split], "context_mask": mask[:, :split]}
                if split is not None and not (mask[:, :split].any(1).all() and mask[:, split:].any(1).all()):
                    with pytest.raises(ValueError, match="no tokens"):
                        cm.generate(*args, **kwargs, max_new_tokens=new)
                    continue  # a row with no context token or no question token: refused
                got = cm.generate(*args, **kwargs, max_new_tokens=new, eos_token_id=[])
                fresh = kvcompile.apply(base, budget=budget, recipe=recipe).generate(
                    *args, **kwargs, max_new_tokens=new, eos_token_id=[])
                assert torch.equal(got, fresh), f"{where}: tokens differ from a fresh model's"
            elif op == "prefill_decode":
                token = cm.prefill(ids, mask, logits="last")[:, -1].argmax(-1, keepdim=True)
                for _ in range(new):
                    token = cm.decode(token)[:, -1].argmax(-1, keepdim=True)
            elif op == "fork" and b in live and live[b].seen is not None:
                child = live[b].fork(recipe if live[b].request.deferred else None, None)
                check_invariants(child, where + " (fork)")
                cm = child
            elif op == "reset" and b in live:
                live[b].reset()
                cm = live[b]
        except ValueError as e:  # a fraction cap too small for a short prompt: refused before anything changed
            assert "budget" in str(e) or "too long" in str(e), f"{where}: {e}"
            continue
        check_invariants(cm, where)
        live[b] = cm


@pytest.mark.slow
def test_soak(bases):
    soak(bases, SOAK_CALLS, seed=int(os.environ.get("KVC_SEED", 1234)))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
@pytest.mark.skipif("KVCOMPILE_SOAK" not in os.environ, reason="the long soak runs with KVCOMPILE_SOAK=<calls>")
def test_long_soak(bases):
    calls = int(os.environ["KVCOMPILE_SOAK"])
    start = rss_mib()
    soak(bases, calls, seed=int(os.environ.get("KVC_SEED", 4321)), compiled=True, max_len=600)
    print(f"\nlong soak: {calls} calls, RSS {start:.0f} MiB at the start, {rss_mib():.0f} MiB at the end")


# ------------------------------------------------------------------ fuzz: arbitrary inputs to the public calls
tensor_ids = st.builds(
    lambda rows, cols, lo, hi, dtype: torch.randint(lo, max(hi, lo + 1), (rows, cols), dtype=dtype),
    st.integers(0, 3), st.integers(0, 5), st.integers(-3, VOCAB), st.integers(0, VOCAB + 3),
    st.sampled_from([torch.long, torch.int, torch.float32]),
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=tensor_ids, call=st.sampled_from(["prefill", "decode", "decode_many", "generate"]),
       new=st.one_of(st.integers(-1, 4), st.floats(-1, 4), st.none()))
def test_fuzz_inputs_either_raise_cleanly_or_run(bases, ids, call, new):
    """Any input either raises a ValueError/TypeError/RuntimeError and changes nothing, or runs and keeps every
    invariant."""
    cm = kvcompile.apply(bases[0], budget=0.5, recipe="snapkv")
    cm.prefill(torch.randint(2, VOCAB - 1, (2, 20)))
    before = cm.cache_stats()
    try:
        if call == "generate":
            cm.generate(ids, max_new_tokens=new, eos_token_id=[])
        else:
            getattr(cm, call)(ids)
    except (ValueError, TypeError, RuntimeError):
        assert cm.cache_stats() == before, "a refused input changed the cache"
        return
    check_invariants(cm, f"fuzz {call} {tuple(ids.shape)} {ids.dtype}")
