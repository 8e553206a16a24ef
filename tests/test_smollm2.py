"""The real model: SmolLM2-135M-Instruct retrieves a pass key through the compressed runtime at full budget."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.eval.synthetic import passkey

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    model, tok = kvcompile.load_model("smollm2-135m")
    return model, tok, kvcompile.apply(model, budget=1.0, recipe="full")


def encode(tok, text):
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def test_passkey_at_full_budget_and_bytes(smollm2):
    model, tok, cm = smollm2
    sample = passkey(tok, 1000, seed=3)
    context, question = (encode(tok, text) for text in sample.prompt(tok))
    out = cm.generate(question, context_ids=context, max_new_tokens=8)
    answer = tok.decode(out[0, question.shape[1] :])
    assert sample.answer in answer, f"expected {sample.answer}, got {answer!r}"
    stats = cm.cache_stats()
    n_tokens = int(cm.seen[0])  # context + question + generated tokens that were fed back
    assert stats["bytes_full"] == n_tokens * 30 * 3 * 64 * 2 * 4  # layers x KV heads x dims x (K, V) x fp32
    assert stats["bytes_held"] == sum(-(-n // 16) for n in [n_tokens] * 90) * 16 * 64 * 2 * 4


def test_matches_transformers_greedy(smollm2):
    model, tok, cm = smollm2
    ids = tok(["The capital of France is", "Water boils at a temperature of"], return_tensors="pt", padding=True)
    ours = cm.generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=12)
    with torch.no_grad():
        theirs = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours[:, : theirs.shape[1]], theirs)


def test_demo_answers_and_reports_both_caches(capsys):
    """The README's first command, as a user runs it: the pass key, both rows, the held bytes at about the budget
    (adakv-snapkv 0.5), and a decode rate taken over the steps after the first, which also sets the decode up."""
    from kvcompile import cli

    assert cli.main(["demo"]) == 0
    out, err = capsys.readouterr()
    key = out.split("pass key: ")[1].split()[0]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("full ", "adakv-snapkv "))}
    assert set(rows) == {"full", "adakv-snapkv"}, out
    for name, row in rows.items():
        assert key in row[2], f"{name} answered {row[2]!r}, the pass key is {key}"
        held_over_full, tok_s, first_s = (float(v) for v in row[-4:-3] + row[-2:])
        assert tok_s > 0 and first_s > 0
    assert 0.4 < float(rows["adakv-snapkv"][-4]) <= 0.5 and float(rows["full"][-4]) >= 1.0
    assert "the steps after the first" in err
