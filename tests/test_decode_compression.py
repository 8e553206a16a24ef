"""Decode-time compression: the cache stays flat under its cap over a long sampled generation, protected prompt
tokens survive every eviction, signals recomputed from the query ring equal step-by-step ones, a cap above everything
changes nothing, and the compiled decode program keeps one shape through evictions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fast_first, left_padded_batch, tiny_model
from torch._dynamo.testing import CompileCounterWithBackend

import kvcompile
from kvcompile.recipes import get_recipe

POLICIES = ["inertiakv", "inertiakv-lazy", "score-free", "random-attention", "h2o-decode", "snapkv-decode", "growpage"]
PAGE = 16
CAP = 160  # tokens per KV head
PROMPTS = [24, 17]  # a left-padded batch: the rows sit at different positions


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The machine is shared: one intra-op thread keeps thousands of tiny steps from spinning against others."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base():
    model = tiny_model("llama", layers=2)
    model.config.max_position_embeddings = 4096  # RoPE does not read it; lets 2,000 generated tokens through
    return kvcompile.apply(model, budget=1.0, recipe="full", page_size=PAGE)


def variant(name: str, **decode) -> kvcompile.Recipe:
    recipe = get_recipe(name)
    return dataclasses.replace(recipe, decode={**recipe.decode, **decode})


def prompt_tokens_held(cm, layer: int) -> torch.Tensor:
    """[B, Hkv] how many of its row's prompt positions each head holds (positions within a head are distinct)."""
    _, _, pos, valid = cm.cache.dense(layer)
    return (valid & (pos < torch.tensor(PROMPTS)[:, None, None])).sum(-1)


@pytest.mark.parametrize("name", fast_first(POLICIES))
def test_flat_bytes_and_protected_prompt_over_2000_sampled_tokens(base, name):
    """Slack: the cap rounded up to whole pages, plus one page per head for GrowPage's uneven heads."""
    cm = kvcompile.apply(base, budget=CAP, recipe=variant(name, prompt=True))
    every = cm.recipe.decode["every"]
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    logits = cm.prefill(ids, mask, logits="last")
    L, B, Hkv = cm.cache.lengths.shape
    bound = L * B * Hkv * (-(-CAP // PAGE) + 1) * cm.cache.page_bytes
    g = torch.Generator().manual_seed(0)
    held, pools = [], set()
    for step in range(2000):
        token = torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=g)
        logits = cm.decode(token)
        held.append(int(cm.cache.bytes_held().sum()))
        pools.add(cm.cache.k_pages.shape[0])
        assert held[-1] <= bound, f"step {step}: {held[-1]} bytes held > {bound}"
        if name != "growpage":
            assert int(cm.cache.lengths.max()) <= CAP, f"step {step}: a head is over the cap"
        if step % every == 0:  # a run (eviction) just happened
            for layer in range(L):
                kept = prompt_tokens_held(cm, layer)
                assert (kept == torch.tensor(PROMPTS)[:, None]).all(), f"step {step}, layer {layer}: prompt lost {kept}"
    assert int(cm.cache.lengths.max()) < 2000, "the generation went far past the cap, so tokens were evicted"
    assert len(pools) == 1, f"the page pool changed size while decoding: {sorted(pools)}"
    assert cm.cache_stats()["peak_bytes_held"] == max(held), "the reported peak is the real one"


@pytest.mark.parametrize("budget", [CAP, 0.25], ids=["tokens", "fraction"])
@pytest.mark.parametrize("name", fast_first(POLICIES))
def test_pool_storage_stays_near_the_cap_over_1000_tokens(base, name, budget):
    """The pool tensors themselves, not only the tokens held: within 1.15x the cap plus one page per head (and the
    scratch page), at every step (a fraction cap grows with the tokens read); budget_bytes is the cap on the same
    tokens."""
    cm = kvcompile.apply(base, budget=budget, recipe=name)
    ids, mask = left_padded_batch([120, 100], total=120)
    token = cm.prefill(ids, mask, logits="last")[:, -1].argmax(-1, keepdim=True)
    L, B, Hkv = cm.cache.lengths.shape
    for step in range(1000):
        token = cm.decode(token)[:, -1].argmax(-1, keepdim=True)
        if step % 10 and step != 999:
            continue
        stats = cm.cache_stats()
        pool = stats["bytes"]["payload"] + stats["bytes"]["free_pages"]
        bound = 1.15 * stats["budget_bytes"] + (L * B * Hkv + 1) * cm.cache.page_bytes
        assert pool <= bound, f"step {step}: pool {pool} B > {bound:.0f} B (cap {stats['budget_bytes']} B)"
        # caps are whole pages (``DecodeCompressor.ceiling``): nothing held beyond the budget, except that GrowPage
        # shares a row's cap unevenly between heads, each with up to one partial page
        slack = L * B * Hkv * cm.cache.page_bytes if name == "growpage" else 0
        assert stats["bytes_held"] <= stats["budget_bytes"] + slack, f"step {step}"


def test_unprotected_prompt_is_evicted(base):
    """The control for the test above: at this cap the prompt does get evicted when nothing protects it."""
    cm = kvcompile.apply(base, budget=CAP, recipe=variant("random-attention", prompt=False))
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    cm.prefill(ids, mask)
    token = ids[:, -1:]
    for _ in range(400):
        token = cm.decode(token)[:, -1].argmax(-1, keepdim=True)
    assert (prompt_tokens_held(cm, 0) < torch.tensor(PROMPTS)[:, None]).any()


def sampled(cm) -> torch.Tensor:
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    return cm.generate(ids, mask, max_new_tokens=100, do_sample=True, eos_token_id=[],
                       generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def uncompressed(base):
    return sampled(base)


@pytest.mark.parametrize("name", POLICIES)
def test_cap_above_everything_changes_nothing(base, uncompressed, name):
    capped = kvcompile.apply(base, budget=512, recipe=name)  # holds the prompt and all 100 new tokens
    out = sampled(capped)
    decoder = capped.request.decoder
    assert decoder is not None and decoder.steps > capped.recipe.decode["every"], "runs happened"
    assert torch.equal(out, uncompressed)


@pytest.mark.parametrize("name", ["inertiakv", "inertiakv-lazy", "h2o-decode", "growpage"])
def test_signals_from_the_query_ring_equal_step_by_step_signals(base, name):
    """A run every 16 steps recomputes each step's attention from the ring of queries; no token is evicted in
    between, so folding 16 steps at once must give the state that folding after every step gives."""
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    states = []
    for every in (16, 1):
        cm = kvcompile.apply(base, budget=512, recipe=variant(name, every=every))
        cm.generate(ids, mask, max_new_tokens=34, eos_token_id=[])  # 33 decode steps: both ran after the last
        states.append(cm.request.decoder.states)
    for layer, (batched, stepwise) in enumerate(zip(*states)):
        torch.testing.assert_close(batched.tokens, stepwise.tokens, equal_nan=True, msg=lambda m: f"layer {layer}: {m}")
        for key in ("short", "long", "demand"):  # GrowPage's query summaries and demand
            if key in stepwise.extra:
                torch.testing.assert_close(batched.extra[key], stepwise.extra[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["inertiakv", "random-attention", "growpage"])
def test_decode_many_equals_one_decode_call_per_token(base, name):
    """Teacher forcing in segments that end where the schedule runs sees the caches single steps see."""
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    forced = torch.randint(2, 90, (2, 300), generator=torch.Generator().manual_seed(5))
    one, many = (kvcompile.apply(base, budget=CAP, recipe=name) for _ in range(2))
    one.prefill(ids, mask, logits="last")
    many.prefill(ids, mask, logits="last")
    expected = torch.cat([one.decode(forced[:, t : t + 1]) for t in range(forced.shape[1])], 1)
    got = torch.cat([many.decode_many(forced[:, t : t + 37]) for t in range(0, forced.shape[1], 37)], 1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(many.cache.lengths, one.cache.lengths) and int(one.cache.lengths.max()) < 300
    for layer in range(2):
        (_, _, pos_m, ok_m), (_, _, pos_o, ok_o) = many.cache.dense(layer), one.cache.dense(layer)
        assert torch.equal(pos_m[ok_m], pos_o[ok_o]), "the same tokens were kept"
    assert many.cache_stats()["peak_bytes_held"] == one.cache_stats()["peak_bytes_held"]


def test_query_ring_keeps_the_last_w_queries_and_narrows(base):
    """Query p sits in slot p mod W: after a padded prefill and a decode step each row's ring holds its last W
    queries (the same vectors a wider ring holds at those positions); narrowing keeps the newest ones."""
    rings = {}
    for W in (4, 8):
        cm = kvcompile.apply(base, budget=1.0, recipe=kvcompile.Recipe(f"w{W}", "snapkv", scorer_args={"window": W}))
        ids, mask = left_padded_batch([5, 6], total=6)
        cm.prefill(ids, mask, compress=False)
        cm.decode(torch.tensor([[7], [7]]))
        rings[W] = cm.cache.ring
    ring, wide = rings[4], rings[8]
    for b, last in enumerate([[2, 3, 4, 5], [3, 4, 5, 6]]):
        assert ring.positions[b].tolist() == sorted(last, key=lambda p: p % 4)
        for slot, p in enumerate(ring.positions[b].tolist()):
            other = wide.positions[b].tolist().index(p)
            assert torch.equal(ring.queries[:, b, :, slot], wide.queries[:, b, :, other]), "queries sit with positions"
    ring.resize(2)
    assert ring.positions.tolist() == [[4, 5], [6, 5]]


def test_compiled_decode_keeps_one_shape_through_evictions(base):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = kvcompile.apply(base, budget=96, recipe="inertiakv", compile=counter)
    eager = kvcompile.apply(base, budget=96, recipe="inertiakv")
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    expected = eager.generate(ids, mask, max_new_tokens=200, eos_token_id=[])
    assert torch.equal(compiled.generate(ids, mask, max_new_tokens=200, eos_token_id=[]), expected)
    assert int(compiled.cache.lengths.max()) <= 96
    assert counter.frame_count == 2, "one prefill and one decode compilation: evictions keep the decode shapes"


def test_bad_decode_schedules(base):
    with pytest.raises(ValueError, match="unknown decode policy"):
        kvcompile.Recipe("x", "snapkv", decode={"policy": "nope"})
    with pytest.raises(ValueError, match="bad decode schedule: alpha must be"):
        kvcompile.Recipe("x", "snapkv", decode={"policy": "inertiakv", "args": {"alpha": 1.5}})
    with pytest.raises(ValueError, match="raise the budget to at least 6 tokens per KV head"):
        kvcompile.apply(base, budget=5, recipe="inertiakv")  # 4 sinks leave no room at a cap of 5, known at apply
    cm = kvcompile.apply(base, budget=0.1, recipe="inertiakv")  # a fraction: known once the prompt is; too small
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))  # for these prompts, it is floored, not refused
    cm.generate(ids, mask, max_new_tokens=8, eos_token_id=[])
    assert cm.cache_stats()["decode_uncapped_rows"] == [0, 1]


def test_schedule_scales_to_a_small_cap(base):
    """random-attention's bursts of 64 plus a window of 64 exceed a cap of 64: both shrink to fit, and it says so."""
    cm = kvcompile.apply(base, budget=64, recipe="random-attention")
    ids, mask = left_padded_batch(PROMPTS, total=max(PROMPTS))
    cm.generate(ids, mask, max_new_tokens=200, eos_token_id=[])
    schedule = cm.cache_stats()["decode_schedule"]
    assert schedule["every"] + schedule["recent"] < 64 and schedule["every"] >= 1
    assert int(cm.cache.lengths.max()) <= 64
