"""Answer-evidence gap (issue 20 item 5, inferred): the chain task carries its chain and a
distractor, the probes ask for each fact's source, fact positions are the facts' tokens; a run on the tiny model
holds the whole chain at full budget and reports the gap as score minus grounded."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import byte_tokenizer

from kvcompile.eval.analysis import gap
from kvcompile.eval.synthetic import make_sample
from kvcompile.recipes import get_recipe


def test_chain_sample_carries_its_chain_a_distractor_and_one_probe_per_fact():
    index = random.SystemRandom().randrange(1000)
    s = make_sample(gap.chain_task(3), byte_tokenizer(), 900, seed=0, index=index)
    assert len(s.facts) == 4 == len(s.probes)
    positions = [s.context.index(f) for f in s.facts]
    assert positions == sorted(positions), f"index={index}"  # the chain in order
    root_var, value = s.facts[0].removeprefix("VAR ").rstrip(".").split(" = ")
    assert s.answers == (value,) and s.probes[0][2] == value
    assert s.context.count("VAR ") == 2 * (1 + 2 * 3)  # the chain and a distractor chain: a root, 3 copies
    last = s.facts[-1].split(" = ")[0]
    assert last in s.question and s.answer_prefix.startswith(f"Answer: {last}")
    for fact, (question, prefix, ref) in zip(s.facts[1:], s.probes[1:]):  # each probe names the fact's source
        target, source = fact.rstrip(".").split(" = ")
        assert target in question and source == "VAR " + ref and prefix.endswith(f"{target} = VAR")
    with pytest.raises(ValueError, match="hops must be a positive int"):
        gap.chain_task(0)


def test_fact_positions_are_the_facts_tokens():
    tok = byte_tokenizer()
    s = make_sample(gap.chain_task(2), tok, 800, seed=1)
    prompt = gap.Prompt(s, tok)
    for fact, pos in zip(s.facts, prompt.fact_positions):
        assert "".join(s.context[p] for p in pos) == fact.rstrip(".")  # byte tokens: position = character


def test_run_holds_the_chain_at_full_budget_and_reports_the_gap(byte_full):
    result = gap.run(byte_full, byte_tokenizer(), ["streamingllm"], [0.1], n_samples=1, length=700, hops=2,
                     progress=False)
    full, comp = result["summary"]
    assert full["recipe"].startswith("full@") and full["chain_coverage"] == 1.0 == full["weakest_fact"]
    assert comp["bytes_held"] < full["bytes_held"] and comp["chain_coverage"] < 1.0
    for row in result["samples"]:
        assert len(row["probes"]) == 3 and len(row["facts"]) == 3
        assert row["grounded"] == float(row["score"] == 1 and row["consistent"] == 1)
    for row in result["summary"]:
        assert row["gap"] == pytest.approx(100 * (row["score"] - row["grounded"]))
    tag = get_recipe("streamingllm").tag
    assert f"| {tag} | 0.1 | 1 |" in gap.markdown(result, "byte-llama", "kvcompile analyze gap")


def test_probe_reads_a_fork_and_leaves_the_model_as_it_was(byte_full):
    tok = byte_tokenizer()
    prompt = gap.Prompt(make_sample(gap.chain_task(1), tok, 600, seed=2), tok)
    model = byte_full.fork()
    model.prefill(torch.tensor([prompt.context_ids]), compress=False)
    seen = model.seen.clone()
    first = gap.cell_row(model, prompt, tok)
    assert torch.equal(model.seen, seen) and gap.cell_row(model, prompt, tok) == first
