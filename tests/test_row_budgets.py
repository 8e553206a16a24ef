"""Every recipe holds its budget on every row of a batch once it has compressed: page rounding, memory entries,
summaries, anchors and tables included (``cache_stats()["bytes_held_per_sequence"]`` against ``budget_bytes()``),
as a property over model family, batch, row lengths, page size, chunked prefill and the three budget forms.

A budget a recipe cannot hold is refused with an error that names the budget, before anything is stored. Learned
recipes are left out (their weights fit the model they were trained for, tests/test_kvzap.py), and so is a recipe
that reads text it names as token ids (it needs a tokenizer's resolution first, tests/test_taskpress.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvcompile

RECIPES = sorted(n for n, r in kvcompile.recipes().items() if not r.trained_for and n != "taskpress")
FAMILIES = ("llama", "gemma3", "qwen3")


@pytest.fixture(scope="module")
def bases():
    return {family: kvcompile.apply(tiny_model(family, seed=3), budget=1.0, recipe="full") for family in FAMILIES}


budgets = st.one_of(st.floats(0.05, 0.95), st.integers(2, 64), st.integers(2, 40).map(lambda k: f"{k}KiB"))


def held_and_budget(cm, recipe: str, rows: list[int], question: int, seed: int) -> tuple[list[int], list[int]]:
    """Compress a left-padded batch of ``rows`` tokens as a user would (a recipe that reads the question gets one);
    each row's bytes held and its budget."""
    g = torch.Generator().manual_seed(seed)
    T = max(rows)
    ids = torch.randint(2, VOCAB - 1, (len(rows), T), generator=g)
    mask = torch.stack([torch.arange(T) >= T - n for n in rows]).long()
    if kvcompile.recipes()[recipe].query_aware:
        q = torch.randint(2, VOCAB - 1, (len(rows), question), generator=g)
        cm.generate(q, context_ids=ids, context_mask=mask, max_new_tokens=1, eos_token_id=[])
    else:
        cm.prefill(ids, mask, logits="last")
    return cm.cache_stats()["bytes_held_per_sequence"], cm.budget_bytes().tolist()


def check_row_budgets(bases, recipe, family, budget, rows, question, page_size, chunk, seed) -> str:
    """What became of the call: compressed (within budget on every row) or refused, and where."""
    where = f"{recipe} on {family}, budget={budget!r}, rows={rows}, page_size={page_size}, chunk={chunk}, seed={seed}"
    try:
        cm = kvcompile.apply(bases[family], budget=budget, recipe=recipe, page_size=page_size, prefill_chunk=chunk)
    except ValueError as e:  # a configuration this recipe cannot run (a cap below its schedule, a dense pass chunked)
        assert str(e), where
        return "refused by apply"
    try:
        held, budget_bytes = held_and_budget(cm, recipe, rows, question, seed)
    except ValueError as e:
        assert "budget" in str(e), f"{where}: refused for another reason: {e}"
        assert cm.seen is None, f"{where}: a refused prompt left tokens in the cache"
        return "refused before reading"
    over = [(row, h, b) for row, (h, b) in enumerate(zip(held, budget_bytes)) if h > b]
    assert not over, f"{where}: (row, bytes held, budget) over budget: {over}"
    return "compressed"


CALLS = dict(recipe=st.sampled_from(RECIPES), family=st.sampled_from(FAMILIES), budget=budgets,
             rows=st.lists(st.integers(1, 200), min_size=1, max_size=3), question=st.integers(1, 8),
             page_size=st.sampled_from([8, 16, 32]), chunk=st.sampled_from([None, None, 24, 48]),
             seed=st.integers(0, 2**31 - 1))  # one call of a user: what it runs, on what, how compressed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CALLS)
def test_every_row_holds_its_budget(bases, recipe, family, budget, rows, question, page_size, chunk, seed):
    event(check_row_budgets(bases, recipe, family, budget, rows, question, page_size, chunk, seed))


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CALLS)
def test_every_row_holds_its_budget_long(bases, recipe, family, budget, rows, question, page_size, chunk, seed):
    event(check_row_budgets(bases, recipe, family, budget, rows, question, page_size, chunk, seed))


@pytest.mark.parametrize("recipe, family, budget, rows, page_size, chunk", [
    # a head whose share rounds to no page writes no memory entry (it wrote one, a page over the budget)
    ("core", "qwen3", 0.1772, [86, 66], 16, None),
    ("core", "qwen3", 0.4623, [4], 32, None),
    # a chunk whose budget leaves no residual slot (coding an empty set of residuals raised)
    ("anchorkv", "qwen3", 39, [59, 29], 8, 24),
])
def test_found_by_the_property(bases, recipe, family, budget, rows, page_size, chunk):
    assert check_row_budgets(bases, recipe, family, budget, rows, 4, page_size, chunk, seed=0) == "compressed"
