"""Steps as retention units (docs/methods_scorers.md#steps-as-retention-units, inferred): ``segments=`` (validation,
rules), the step tasks, and ``stepkv`` / ``commitkv`` / ``reco`` against their specifications, on tiny models and
constructed observations."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_plain_at_full_budget, byte_tokenizer

import kvcompile
from kvcompile.eval.step_tasks import STEP_TASKS, needed_retention, step_spans
from kvcompile.eval.synthetic import make_sample
from kvcompile.methods import SCORERS, Observation
from kvcompile.recipes import Recipe, reflection

STEP_RECIPES = ["stepkv", "commitkv", "reco"]
SIZE = 8  # tokens per segment in the equal-segment prompts


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def prompt(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def held_sets(cm) -> list[set[int]]:
    """The positions each (layer, KV head) of row 0 holds."""
    pos = cm.held_positions()[:, 0]
    return [set(p[p >= 0].tolist()) for layer in pos for p in layer]


def partial_segments(held: set[int], size: int = SIZE) -> list[int]:
    """Segments (of ``size`` tokens from 0) that a head holds some but not all of."""
    counts = {}
    for p in held:
        counts[p // size] = counts.get(p // size, 0) + 1
    return [s for s, c in counts.items() if c < size]


def small_window(name: str, **args) -> Recipe:
    return Recipe(f"{name}-w8", name, scorer_args={"window": 8, **args})


# ------------------------------------------------------------------------------------------ segments=
@pytest.mark.parametrize("segments, message", [
    ([(0, 8), (4, 12)], "sorted and not overlap"),
    ([(8, 4)], "0 <= start < end"),
    ([(0, 8, 9)], r"\(start, end\) ints"),
    ([8, 4], "strictly increasing"),
    ([-1, 4], "strictly increasing"),
    ([0, 80], "past the 64 tokens"),
    ([(0, 100)], "past the 64 tokens"),
    ([1.5], "must be ints"),
    ([], "non-empty list"),
    ("paragraphs", "unknown segments rule"),
    ("blank-lines", "pass tokenizer="),
])
def test_bad_segments_are_refused_with_a_clear_error_and_leave_the_model_untouched(byte_full, segments, message):
    cm = kvcompile.apply(byte_full, budget=16, recipe="stepkv")
    tokenizer = byte_tokenizer() if segments == "paragraphs" else None
    with pytest.raises(ValueError, match=message):
        cm.prefill(prompt(), segments=segments, tokenizer=tokenizer)
    assert cm.seen is None
    with pytest.raises(ValueError, match=message):
        cm.generate(prompt(), max_new_tokens=2, segments=segments, tokenizer=tokenizer)
    assert cm.seen is None


@pytest.mark.parametrize("rule, text, first_tokens", [
    ("blank-lines", "one two\n\nthree\n \nfour", ["o", "t", "f"]),
    ("tool-calls", "System.\nAction: a(1)\nObservation: x\nAction: b(2)\nObservation: y", ["S", "A", "A"]),
])
def test_a_rule_starts_a_segment_after_each_blank_line_or_at_each_tool_call(tok, byte_full, rule, text, first_tokens):
    """Bytes are tokens here: a segment must start at the character the rule names, and stepkv must see it (a
    budget of the last segment alone keeps exactly that segment: the current step)."""
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    starts = kvcompile.segments.boundaries(rule, ids, torch.ones_like(ids, dtype=torch.bool), tok)[0].tolist()
    assert [text[s] for s in starts] == first_tokens
    last = len(text) - starts[-1]  # page_size 1: every head keeps exactly its count (no rounding to pages)
    cm = kvcompile.apply(byte_full, budget=last, recipe=small_window("stepkv"), page_size=1)
    cm.prefill(ids, segments=rule, tokenizer=tok)
    assert all(h == set(range(starts[-1], len(text))) for h in held_sets(cm))


def test_spans_leave_their_gaps_as_segments_and_generate_takes_segments(byte_full):
    """Spans (4, 12), (20, 28) of a 32-token prompt make segments [0, 4), [4, 12), [12, 20), [20, 28), [28, 32)."""
    cm = kvcompile.apply(byte_full, budget=12, recipe=small_window("stepkv"), page_size=1)
    out = cm.generate(prompt(32), max_new_tokens=3, segments=[(4, 12), (20, 28)])
    assert out.shape == (1, 35)
    kept = held_sets(cm)
    bounds = [0, 4, 12, 20, 28, 32]
    for h in kept:
        prompt_part = {p for p in h if p < 32}
        parts = [set(range(a, b)) & prompt_part for a, b in zip(bounds, bounds[1:])]
        assert sum(0 < len(part) < b - a for part, a, b in zip(parts, bounds, bounds[1:])) <= 1


# ------------------------------------------------------------------------------------------ stepkv
@pytest.mark.parametrize("name", STEP_RECIPES)
def test_a_budget_of_whole_steps_keeps_no_partial_step(byte_full, name):
    """A budget of whole steps: 8 equal steps, a budget of 3 of them per head keeps 3 whole steps in every head."""
    cm = kvcompile.apply(byte_full, budget=3 * SIZE, recipe=small_window(name), page_size=1)
    cm.prefill(prompt(), segments=list(range(0, 64, SIZE)))
    for held in held_sets(cm):
        assert len(held) == 3 * SIZE and partial_segments(held) == []
        assert set(range(56, 64)) <= held  # the current step (the observed queries') first


@pytest.mark.parametrize("name", STEP_RECIPES)
@pytest.mark.parametrize("budget", [13, 21, 30])
def test_any_budget_keeps_whole_steps_and_at_most_one_partial_one_per_head(byte_full, name, budget):
    cm = kvcompile.apply(byte_full, budget=budget, recipe=small_window(name), page_size=1)
    cm.prefill(prompt(seed=1), segments=list(range(0, 64, SIZE)))
    for held in held_sets(cm):
        assert len(held) == budget and len(partial_segments(held)) <= 1


@pytest.mark.parametrize("name", STEP_RECIPES)
@pytest.mark.parametrize("budget", [0.25, 0.1, "8KiB"])
def test_each_step_recipe_runs_by_name_within_its_budget_bytes(byte_full, name, budget):
    cm = kvcompile.apply(byte_full, budget=budget, recipe=name, page_size=4)
    cm.prefill(prompt(200), segments=list(range(0, 200, 10)))
    stats = cm.cache_stats()
    assert 0 < stats["bytes_held"] <= stats["budget_bytes"]
    cm.prefill(prompt(40, seed=3), segments=[(0, 20)])  # a second turn appends its segments
    stats = cm.cache_stats()
    assert stats["bytes_held"] <= stats["budget_bytes"]


@pytest.mark.parametrize("name", STEP_RECIPES)
def test_full_budget_reproduces_the_model(llama, llama_cm, name):
    assert_plain_at_full_budget(llama, llama_cm, name)


def test_without_segments_the_prompt_is_one_step(byte_full):
    """No segments: one step, ranked inside by token saliency, as when the caller gives one segment."""
    held = []
    for segments in (None, [0]):
        cm = kvcompile.apply(byte_full, budget=12, recipe=small_window("stepkv"), page_size=1)
        cm.prefill(prompt(), segments=segments)
        held.append(held_sets(cm))
    assert held[0] == held[1] and all(len(h) == 12 for h in held[0])


# ------------------------------------------------------------------------------------------ oracles
def observation(keys, queries, query_positions, segments) -> Observation:
    B, Hkv, S, D = keys.shape
    return Observation(keys, torch.zeros_like(keys), torch.arange(S).expand(B, Hkv, S),
                       torch.ones(B, Hkv, S, dtype=torch.bool), queries, query_positions, 1.0, 0, 0, 1,
                       segments=segments)


def step_order(scores: torch.Tensor, segments: torch.Tensor) -> list[int]:
    """Segments in the order a head's top-k takes them (by their best entry's rank)."""
    order = scores[0, 0].argsort(descending=True).tolist()
    return list(dict.fromkeys(int(segments[0, p]) for p in order))


def test_stepkv_ranks_steps_by_the_recent_queries_attention_per_token():
    """Oracle on a small shape: 4 steps of 4 tokens, one-hot keys; the recent queries (in step 3) pay step 1 the
    most mass per token, then step 0, then step 2. Reference order: current step, then mass per token."""
    D, S = 16, 16
    keys = torch.zeros(1, 1, S, D)
    keys[0, 0, torch.arange(S), torch.arange(S)] = 1.0
    segments = (torch.arange(S) // 4)[None]
    weights = torch.zeros(D)
    weights[4:8], weights[0:4], weights[8:12] = 3.0, 1.5, 0.5  # steps 1, 0, 2 by attention
    queries = weights.expand(1, 1, 4, D).clone()  # the window: positions 12..15 (step 3)
    obs = observation(keys, queries, torch.arange(12, 16)[None], segments)
    scores = SCORERS["stepkv"](window=4).score(obs)
    attn = torch.softmax(torch.where(torch.arange(S) <= 12, weights, -torch.inf), -1)  # the first window query
    assert attn[4:8].sum() > attn[0:4].sum() > attn[8:12].sum()
    assert step_order(scores, segments) == [3, 1, 0, 2]


def test_commitkv_retires_a_consumed_step_first_and_keeps_the_first_and_current_steps():
    """Steps of 4 tokens: 0 (system), 1 (an observation the commit of step 2 reads and nobody reads after), 2, 3
    (current; its queries read step 2). Step 1 passes the joint test (after <= epsilon, after <= before): it ranks
    last, below step 2, though it is older; step 0 ranks right after the current step."""
    D, S = 16, 16
    keys = torch.zeros(1, 1, S, D)
    keys[0, 0, torch.arange(S), torch.arange(S)] = 1.0
    segments = (torch.arange(S) // 4)[None]
    queries = torch.zeros(1, 1, S, D)
    queries[0, 0, 8:12, 4:8] = 12.0  # step 2's queries (its commit) read step 1
    queries[0, 0, 12:16, 8:12] = 12.0  # the current step's queries read step 2, not step 1
    obs = observation(keys, queries, torch.arange(S)[None], segments)
    scorer = SCORERS["commitkv"](window=4, commit_tokens=4, epsilon=0.01)
    before, after = scorer.effects(obs, segments, 4)
    assert before[0, 1] > 0.5 and after[0, 1] < 0.01 and after[0, 2] > 0.5
    assert step_order(scorer.score(obs), segments) == [3, 0, 2, 1]


def test_reco_with_a_constant_reward_is_stepkv(byte_full):
    """ReCo with a constant reward is StepKV, through the public API: the same held positions at every budget."""
    ids = prompt(seed=4)
    for budget in (10, 19, 33):
        held = []
        for recipe in (small_window("stepkv"), small_window("reco", reward="constant")):
            cm = kvcompile.apply(byte_full, budget=budget, recipe=recipe, page_size=1)
            cm.prefill(ids, segments=list(range(0, 64, SIZE)))
            held.append(held_sets(cm))
        assert held[0] == held[1]


def test_the_reflection_penalty_lowers_a_reflection_step_below_its_twin(tok):
    """Two steps with the same attention; the one holding "Wait" ranks below the other with the penalty, above it
    without (it comes first by position when they tie)."""
    text = "Wait a bit.." + "Keep a bit.." + "Now the end."
    ids = torch.tensor(tok.encode(text, add_special_tokens=False))
    S, D = len(ids), 16
    keys = torch.zeros(1, 1, S, D)
    segments = (torch.arange(S) // 12)[None]
    obs = observation(keys, torch.zeros(1, 1, 4, D), torch.arange(S - 4, S)[None], segments)
    obs.token_ids = ids.expand(1, 1, S)
    args = reflection.resolve(small_window("reco", reward="constant"), tok).scorer_args | {"window": 4}
    assert step_order(SCORERS["reco"](**args).score(obs), segments) == [2, 1, 0]
    assert step_order(SCORERS["reco"](**(args | {"penalty": 0.0})).score(obs), segments) == [2, 0, 1]


def test_bad_step_parameters_are_refused():
    with pytest.raises(ValueError, match="reflection markers"):
        SCORERS["reco"](penalty=0.5)
    with pytest.raises(ValueError, match="reward"):
        SCORERS["reco"](reward="prm")
    with pytest.raises(ValueError, match="commit_tokens"):
        SCORERS["commitkv"](commit_tokens=0)
    with pytest.raises(ValueError, match="reflection penalty is ReCo"):
        reflection.resolve("stepkv", byte_tokenizer())


# ------------------------------------------------------------------------------------------ step tasks
@pytest.mark.parametrize("task", sorted(STEP_TASKS))
def test_step_tasks_are_deterministic_fit_the_length_and_locate_their_steps(tok, task):
    a, b = (make_sample(task, tok, 600, seed=3, index=1) for _ in range(2))
    assert a == b and a != make_sample(task, tok, 600, seed=4, index=1)
    context, question = a.prompt(tok)
    ids = tok(context, add_special_tokens=False)["input_ids"]
    assert len(ids) + len(tok.encode(question)) + STEP_TASKS[task].max_new_tokens <= 600
    spans = step_spans(tok, context, a.steps)
    assert [tok.decode(ids[s:e]) for s, e in spans] == list(a.steps)
    assert a.needed and all(a.answers[0] in a.steps[i] for i in a.needed[:1])


def test_needed_retention_counts_the_needed_steps_tokens_held(tok, byte_full):
    sample = make_sample("steps_agent", tok, 800, seed=0)
    context, _ = sample.prompt(tok)
    ids = torch.tensor([tok(context, add_special_tokens=False)["input_ids"]])
    spans = step_spans(tok, context, sample.steps)
    full = kvcompile.apply(byte_full, budget=1.0, recipe="full")
    full.prefill(ids)
    assert needed_retention(full.held_positions(), spans, sample.needed) == 1.0
    last = len(ids[0]) - spans[-1][0]  # a budget of the last step and what follows it: nothing earlier
    cm = kvcompile.apply(byte_full, budget=last, recipe=small_window("stepkv"), page_size=1)
    cm.prefill(ids, segments=[spans[-1][0]])
    expected = 1.0 if sample.needed == (len(spans) - 1,) else 0.0
    assert needed_retention(cm.held_positions(), spans, sample.needed) == expected


# ------------------------------------------------------------------------------------------ sweep and lm-eval
def test_a_sweep_segments_a_step_task_by_its_steps(tok, byte_full, monkeypatch):
    """The sweep hands the sample's step spans to the shared prefill; the stepkv cell compresses over them."""
    from kvcompile.eval import sweep

    seen = []
    prefill = type(byte_full).prefill
    monkeypatch.setattr(type(byte_full), "prefill", lambda self, *a, **k: seen.append(k.get("segments")) or
                        prefill(self, *a, **k))
    result = sweep.run(byte_full, tok, ["stepkv"], [0.25], ["steps_agent"], n_samples=1, length=700, progress=False)
    sample = make_sample("steps_agent", tok, 700)
    assert seen[0] == step_spans(tok, sample.prompt(tok)[0], sample.steps)
    assert all("error" not in r or r["error"] is None for r in result["samples"])


def test_an_lm_eval_task_segments_the_context_by_its_rule(tok, byte_full):
    from lm_eval.api.instance import Instance

    from kvcompile.eval.harness import KVCompileLM
    from kvcompile.eval.synthetic import SEPARATOR

    context = "\n\n".join(f"Action: get_user(U{i})\nObservation: user {i} is in room {100 + i}." for i in range(6))
    gen = {"until": [], "max_gen_toks": 4, "do_sample": False, "segments": "blank-lines"}
    lm = KVCompileLM(byte_full, tokenizer=tok, recipe="stepkv", budget=0.3)
    request = Instance(request_type="generate_until", doc={}, arguments=(context + SEPARATOR + "\nRoom of U2?", gen),
                       idx=0)
    lm.generate_until([request], disable_tqdm=True)
    starts = lm.cm.cache.segment_starts[0].tolist()
    assert [context[s] for s in starts] == ["A"] * 6
    with pytest.raises(ValueError, match="unknown segments rule"):
        lm.generate_until([Instance(request_type="generate_until", doc={}, idx=0, arguments=(
            context + SEPARATOR + "?", gen | {"segments": "paragraphs"}))], disable_tqdm=True)
