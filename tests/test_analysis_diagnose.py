"""Failure diagnosis (issue 20 item 4, inferred): C->W selection on constructed outcomes, the
evidence boost at factor 1 changes nothing and at factor 4 changes the answer's logits, the sham is count-matched,
the evidence positions are the answer's tokens; a run and the CLI on the tiny model."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import byte_tokenizer, run_analysis

import kvcompile
from kvcompile.eval.analysis import diagnose, masked

DOC, QUESTION = 200, 12


def compressed_keep(byte_full, seed: int, recipe: str = "snapkv"):
    g = torch.Generator().manual_seed(seed)
    doc, question = torch.randint(2, 258, (1, DOC), generator=g), torch.randint(2, 258, (1, QUESTION), generator=g)
    cm = kvcompile.apply(byte_full, budget=0.25, recipe=recipe)
    cm.prefill(doc)
    return doc, question, masked.kept(cm.held_positions(), DOC)


def test_outcomes_and_summary_select_full_correct_compressed_wrong_rows():
    assert [diagnose.outcome(f, c) for f, c in [(1, 0), (0, 1), (1, 1), (0, 0), (1, 0.5)]] == \
        ["C->W", "W->C", "C->C", "W->W", "C->W"]
    base = {"task": "t", "recipe": "r@1", "budget": "0.1", "coverage": 0.5, "drift": 1.0}
    rows = [base | {"full_score": 1, "score": 0, "outcome": "C->W", "masked_score": 0, "boost_score": 1,
                    "sham_score": 0},
            base | {"full_score": 1, "score": 0, "outcome": "C->W", "masked_score": 0, "boost_score": 0,
                    "sham_score": 1, "coverage": 0.0, "drift": 3.0},
            base | {"full_score": 1, "score": 1, "outcome": "C->C", "coverage": 1.0, "drift": 0.0},
            base | {"full_score": 0, "score": 1, "outcome": "W->C"},
            base | {"error": "boom"}]
    (row,) = diagnose.summary(rows)
    assert (row["n"], row["errors"], row["C->W"], row["C->C"], row["W->C"], row["W->W"]) == (4, 1, 2, 1, 1, 0)
    assert (row["boost flips"], row["sham flips"], row["replay wrong"], row["evidence held C->W"]) == (1, 1, 2, 1)
    assert row["coverage C->W"] == 0.25 and row["drift C->W"] == 2.0 and row["coverage C->C"] == 1.0
    assert row["full"] == 0.75 and row["compressed"] == 0.5


def test_boost_of_one_changes_nothing_and_of_four_changes_the_logits(byte_full):
    seed = random.SystemRandom().randrange(2**31)
    doc, question, keep = compressed_keep(byte_full, seed)
    evidence = [p for p in range(DOC) if keep[..., p].any()][:6]  # held somewhere: the boost has entries to touch
    model, plain = byte_full.source, masked.document(byte_full.source, doc)

    def logits(bias):
        reader = masked.MaskedModel(model, keep, plain, bias)
        with masked.masking(model):
            return [reader.prefill(question), reader.decode(question[:, :1])]

    one, _ = diagnose.boosts(keep, evidence, 1.0, torch.Generator().manual_seed(seed))
    assert not one.any()
    for a, b in zip(logits(None), logits(one)):
        assert (a - b).abs().max() < 1e-5, f"seed={seed}"
    four, _ = diagnose.boosts(keep, evidence, 4.0, torch.Generator().manual_seed(seed))
    assert torch.allclose(four[four != 0], torch.tensor(4.0).log())
    assert max(float((a - b).abs().max()) for a, b in zip(logits(None), logits(four))) > 1e-4, f"seed={seed}"


def test_sham_is_count_matched_held_and_off_the_evidence(byte_full):
    seed = random.SystemRandom().randrange(2**31)
    _, _, keep = compressed_keep(byte_full, seed, "tova")
    evidence = random.Random(seed).sample(range(DOC), 20)
    boost, sham = diagnose.boosts(keep, evidence, 4.0, torch.Generator().manual_seed(seed))
    real, fake = boost != 0, sham != 0
    assert real.any(), f"seed={seed}"
    assert torch.equal(real.sum(-1), fake.sum(-1)), f"seed={seed}"  # per (layer, KV head)
    assert not (fake & ~keep).any() and not fake[..., evidence].any()
    assert torch.equal(real, keep & torch.isin(torch.arange(DOC), torch.tensor(evidence)))
    _, again = diagnose.boosts(keep, evidence, 4.0, torch.Generator().manual_seed(seed + 1))
    assert torch.equal((again != 0).sum(-1), real.sum(-1))  # another draw, the same counts


def test_evidence_is_every_occurrence_of_the_answer_and_coverage_counts_it():
    text = "The pass key is 4711. Remember it. 4711 is the pass key."
    pos = diagnose.evidence_positions(byte_tokenizer(), text, ["4711"])
    assert [text[p] for p in pos] == list("47114711")
    keep = torch.zeros(2, 3, len(text), dtype=torch.bool)
    keep[0, 0, pos[:4]] = True
    keep[1] = True
    cov = diagnose.coverage(keep, pos)
    assert cov[0].tolist() == [0.5, 0.0, 0.0] and cov[1].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="no evidence positions"):
        diagnose.coverage(keep, [])
    with pytest.raises(ValueError, match="boost factor must be positive"):
        diagnose.boosts(keep, pos, 0.0, torch.Generator())


def test_cli_runs_the_diagnosis_and_writes_table_json_and_plot(byte_full, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["diagnose", "--recipes", "streamingllm", "--budgets", "0.1", "--tasks", "passkey", "--n-samples", "1",
            "--length", "600", "--out", str(tmp_path / "diagnosis")]
    assert run_analysis(byte_full, argv) == 0
    saved = json.loads((tmp_path / "diagnosis.json").read_text())
    (row,) = saved["samples"]
    assert row["outcome"] in diagnose.OUTCOMES and 0 <= row["coverage"] <= 1 and row["bytes_held"] > 0
    assert len(row["coverage_per_head"]) == byte_full.spec.num_layers and row["evidence"] > 0
    assert (tmp_path / "diagnosis.png").exists()
    assert "kvcompile analyze diagnose" in (tmp_path / "diagnosis.md").read_text()
    assert (tmp_path / "diagnosis.md").read_text() in capsys.readouterr().out
