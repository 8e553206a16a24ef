"""The query-leak decomposition (issue 20 item 2): each condition does what it says, checked on a tiny model through
the public API; and ``compress(keep_last=...)``, the runtime capability the restricted condition needs."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, fresh_seed

import kvcompile
from kvcompile.eval.analysis import nominal, queryleak
from kvcompile.eval.decoding import answer
from kvcompile.eval.sweep import grid, shared_base

DOC, QUESTION = 240, 24


@pytest.fixture(scope="module")
def full(byte_full):
    return byte_full


def prompt(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 258, (DOC,), generator=g).tolist(), torch.randint(2, 258, (QUESTION,), generator=g).tolist()


def conditions(full, recipe: str, doc, question):
    """{condition: model after the question is read} for ``recipe`` at 0.25, forked from one shared prefill."""
    base = shared_base(full, grid([recipe], [0.25]))
    base.prefill(torch.tensor([doc]), compress=False)
    asked = base.fork()
    logits = asked.prefill(torch.tensor([question]), compress=False, logits="last")[0, -1]
    (r, b), = grid([recipe], [0.25])[1:]
    return {c: queryleak.compressed(base, asked, logits, r, b, c, question) for c in queryleak.CONDITIONS}


def test_each_condition_answers_as_the_library_path_it_names(full):
    """query-aware = ``generate(prompt)``; boundary = ``generate(question, context_ids=document)``: the same greedy
    tokens from the shared-prefill forks as from a model that reads the prompt on its own."""
    seed = fresh_seed()
    doc, question = prompt(seed)
    models = conditions(full, "snapkv", doc, question)
    own = kvcompile.apply(full, budget=0.25, recipe="snapkv")
    for condition, kwargs in (("query-aware", {"input_ids": torch.tensor([doc + question])}),
                              ("boundary", {"input_ids": torch.tensor([question]),
                                            "context_ids": torch.tensor([doc])})):
        model, logits = models[condition]
        ours = answer(model, byte_tokenizer(), logits, 6)
        ref = own.generate(**kwargs, max_new_tokens=6)[0, kwargs["input_ids"].shape[1]:].tolist()
        assert ours == ref[: len(ours)], f"seed={seed} {condition}: {ours} vs {ref}"


@pytest.mark.parametrize("recipe", ["snapkv", "adakv-snapkv"])
def test_boundary_ranking_never_saw_the_question(full, recipe):
    """Two different questions after the same document: the boundary condition keeps the same document entries in
    every (layer, KV head), so its ranking could not have read either question."""
    seed = fresh_seed()
    doc, q1 = prompt(seed)
    _, q2 = prompt(seed + 1)
    kept = []
    for question in (q1, q2):
        model, _ = conditions(full, recipe, doc, question)["boundary"]
        pos = model.held_positions()
        kept.append(pos.masked_fill(pos >= DOC, -1).sort(-1).values)
    assert torch.equal(*kept), f"seed={seed}"


def test_restricted_keeps_every_question_token_and_spends_the_document_budget(full):
    """Restricted: every question entry held in every head, and the document keeps what the boundary condition
    keeps per head (uniform allocation: the same counts, the same bytes), chosen with the question in view."""
    seed = fresh_seed()
    doc, question = prompt(seed)
    models = conditions(full, "snapkv", doc, question)
    restricted, boundary = (models[c][0] for c in ("restricted", "boundary"))
    pos_r, pos_b = restricted.held_positions(), boundary.held_positions()
    assert ((pos_r >= DOC).sum(-1) == QUESTION).all(), f"seed={seed}"
    assert torch.equal(((pos_r >= 0) & (pos_r < DOC)).sum(-1), ((pos_b >= 0) & (pos_b < DOC)).sum(-1)), f"seed={seed}"
    assert restricted.cache_stats()["bytes_held"] == boundary.cache_stats()["bytes_held"]
    assert queryleak.question_kept(restricted, DOC) == 1.0


def test_keep_last_refuses_bad_input_before_anything_changes(full):
    doc, question = prompt(0)
    model = kvcompile.apply(full, budget=0.25, recipe="snapkv")
    model.prefill(torch.tensor([doc + question]), compress=False)
    before = model.cache_stats()["bytes_held"]
    for bad in (-1, DOC + QUESTION, 2.0, True):
        with pytest.raises(ValueError, match="keep_last must be an int"):
            model.compress(keep_last=bad)
    for recipe, what in (("snapkv+int4", "page format"), ("kvzip", "reconstruction")):
        other = model.fork(recipe) if recipe != "kvzip" else None
        if other is None:
            other = kvcompile.apply(full, budget=0.25, recipe=recipe)
            other.prefill(torch.tensor([doc + question]), compress=False)
        with pytest.raises(NotImplementedError, match=what):
            other.compress(keep_last=QUESTION)
    assert model.cache_stats()["bytes_held"] == before
    model.compress(keep_last=QUESTION)
    assert model.cache_stats()["bytes_held"] < before


def test_run_writes_every_condition_with_bytes(full, tmp_path):
    result = queryleak.run(full, byte_tokenizer(), ["snapkv"], [0.25], ["passkey"], n_samples=1, length=600,
                           progress=False)
    (row,) = result["decomposition"]
    assert row["n"] == 1 and all(row[f"{c} bytes"] > 0 for c in queryleak.CONDITIONS)
    assert row["restricted bytes"] == row["boundary bytes"]
    assert {r["condition"] for r in result["samples"] if r["recipe"] == "snapkv@2"} == set(queryleak.CONDITIONS)
    text = queryleak.markdown(result, "byte-llama", "kvcompile analyze queryleak")
    assert "| passkey | snapkv@2 | 0.25 | 1 |" in text


@pytest.mark.parametrize("run", [queryleak.run, nominal.run])
@pytest.mark.parametrize("bad, match", [({"recipes": ["nope"]}, "unknown recipe 'nope'"),
                                        ({"tasks": ["nope"]}, "unknown task 'nope'"),
                                        ({"n_samples": 0}, "n_samples must be a positive int")])
def test_analyses_refuse_bad_input_naming_it(full, run, bad, match):
    args = {"recipes": ["snapkv"], "budgets": [0.25], "tasks": ["passkey"], "n_samples": 1} | bad
    with pytest.raises(ValueError, match=match):
        run(full, byte_tokenizer(), args.pop("recipes"), args.pop("budgets"), args.pop("tasks"), **args,
            progress=False)
