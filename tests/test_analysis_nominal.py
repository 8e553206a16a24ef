"""Nominal vs enforced budgets (issue 20 item 3): the mask path (the plain model over the full cache, evicted entries
masked per (layer, KV head)) against the plain model and against kvcompile's attention over the kept entries; the
three layouts' bytes."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import byte_tokenizer, run_analysis

import kvcompile
from kvcompile.eval.analysis import masked, nominal
from kvcompile.eval.sweep import grid, shared_base

DOC, QUESTION = 200, 12


def prompt(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 258, (1, DOC), generator=g), torch.randint(2, 258, (1, QUESTION), generator=g)


def test_mask_path_keeping_everything_is_the_plain_model(byte_full):
    seed = random.SystemRandom().randrange(2**31)
    doc, question = prompt(seed)
    model = byte_full.source
    with torch.no_grad():
        ref = model(input_ids=torch.cat([doc, question], 1)).logits[:, DOC:]
    keep = torch.ones(byte_full.spec.num_layers, byte_full.spec.num_kv_heads, DOC, dtype=torch.bool)
    with masked.masking(model):
        out = masked.MaskedModel(model, keep, masked.document(model, doc)).prefill(question)
    assert (out - ref).abs().max() < 1e-5, f"seed={seed}"
    with torch.no_grad():  # restored: the plain model answers as before the block
        again = model(input_ids=torch.cat([doc, question], 1)).logits[:, DOC:]
    assert torch.equal(again, ref), f"seed={seed}"


@pytest.mark.parametrize("recipe", ["adakv-snapkv", "kvzip"])
def test_mask_path_equals_attention_over_the_kept_entries(byte_full, recipe):
    """The selection kvcompile keeps, as a mask over the plain model's full cache: the question's logits and a
    decode step equal those of the compressed model, which holds only the kept entries."""
    seed = random.SystemRandom().randrange(2**31)
    doc, question = prompt(seed)
    cm = kvcompile.apply(byte_full, budget=0.25, recipe=recipe)
    cm.prefill(doc)
    keep = masked.kept(cm.held_positions(), DOC)
    assert keep.sum() < keep.numel() // 2  # something was evicted
    model = byte_full.source
    with masked.masking(model):
        reader = masked.MaskedModel(model, keep, masked.document(model, doc))
        ours = [reader.prefill(question), reader.decode(question[:, :1])]
    ref = [cm.prefill(question, compress=False), cm.decode(question[:, :1])]
    for a, b in zip(ours, ref):
        assert (a - b).abs().max() < 1e-4, f"seed={seed} {recipe}"
    with torch.no_grad():  # and the mask matters: the plain model over every entry answers otherwise
        plain = model(input_ids=torch.cat([doc, question], 1)).logits[:, DOC:]
    assert (plain - ref[0]).abs().max() > 1e-3


def test_rectangular_layout_has_one_length_for_every_head(byte_full):
    seed = random.SystemRandom().randrange(2**31)
    doc, _ = prompt(seed)
    base = shared_base(byte_full, grid(["kvzip"], [0.25]))
    base.prefill(doc, compress=False)
    ragged, rect = base.fork("kvzip", 0.25), base.fork(nominal.rectangular("kvzip"), 0.25)
    for m in (ragged, rect):
        m.compress()
    count = lambda m: (m.held_positions() >= 0).sum(-1)  # noqa: E731
    page = 4
    assert int(count(rect).max() - count(rect).min()) < page, f"seed={seed}"  # equal up to page rounding
    # (kvzip's own counts usually differ by more, but not on every prompt: seed 1204442591 gave 46..48)
    assert int(count(ragged).sum()) >= int(count(rect).sum()) - page * count(rect).numel(), f"seed={seed}"
    stats = rect.cache_stats()
    assert nominal.padded_bytes(rect, stats) <= stats["budget_bytes"]
    assert rect.recipe.allocator == "uniform" and rect.recipe.scorer == "kvzip"


def test_sample_rows_report_three_layouts_with_their_bytes(byte_full):
    tok = byte_tokenizer()
    result = nominal.run(byte_full, tok, ["adakv-snapkv"], [0.25], ["passkey"], n_samples=1, length=600,
                         progress=False)
    (row,) = result["table"]
    assert row["mask = ragged"] == 1.0  # the same entries attended: the same answer
    assert row["mask bytes"] == result["summary"][0]["bytes_full"]  # every byte of the document held
    assert row["ragged bytes"] <= row["budget bytes"] and row["rectangular bytes"] <= row["budget bytes"]
    assert "| passkey | adakv-snapkv@3 | 0.25 | 1 |" in nominal.markdown(result, "byte-llama", "cmd")


def test_cli_writes_the_table_and_the_samples(byte_full, tmp_path, capsys):
    """``kvcompile analyze nominal`` through its own parser, on the tiny model (the loader is the one thing swapped)."""
    import json

    argv = ["nominal", "--recipes", "snapkv", "--budgets", "0.25", "--tasks", "passkey", "--n-samples", "1",
            "--length", "600", "--out", str(tmp_path / "nominal")]
    assert run_analysis(byte_full, argv) == 0
    saved = json.loads((tmp_path / "nominal.json").read_text())
    assert saved["command"].startswith("kvcompile analyze nominal") and len(saved["samples"]) == 4  # full + 3 layouts
    assert (tmp_path / "nominal.md").read_text() in capsys.readouterr().out
