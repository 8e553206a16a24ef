"""Query-leak decomposition (issue 20 item 2; ContourKV's abstract only: INFERRED): one method at one budget
run three ways on the same needle prompt (a document, then a question), as the ContourKV paper's Table 5:

- ``query-aware``: the whole prompt is prefilled, then compressed; the ranking reads the question's queries and
  the question's own tokens compete with the document's (``generate(prompt)`` without ``context_ids``). The
  budget counts the document and the question.
- ``restricted``: the same prefill, but only document tokens are candidates: the question is kept whole on top of
  the document's budget, while the scorer still reads the question's queries (``compress(keep_last=question)``).
- ``boundary``: the document is compressed before the question is read (``generate(q, context_ids=doc)``, the
  library's default): the ranking never saw the question.

Inferred: the paper's abstract gives the margin (87.6 points) and its two parts (-88.2 restricted, -87.6
boundary), not its definitions; the three conditions above are the brief's reading of them. Every condition forks
one shared prefill per sample (``sweep.shared_base``); bytes are the K/V pages held once the question is in the
cache, before the answer.
"""

from __future__ import annotations

import time

import torch

from ...model import CompressedModel
from ..decoding import answer, ids_tensor, read_question
from ..sweep import grid, shared_base
from . import tables

CONDITIONS = ("query-aware", "restricted", "boundary")
PAPER = {"restricted": -88.2, "boundary": -87.6}  # points against query-aware (abstract of arXiv 2608.25230)


@torch.no_grad()
def compressed(base: CompressedModel, asked: CompressedModel, asked_logits, recipe, budget, condition: str,
               question: list[int]):
    """(model, logits [V] after the question) for ``condition``: ``base`` holds the document, uncompressed and
    observed; ``asked`` the document and the question, ``asked_logits`` its last logits."""
    if condition == "boundary":
        model = base.fork(recipe, budget)
        model.compress()
        return model, read_question(model, question)
    if condition not in CONDITIONS:
        raise ValueError(f"unknown condition {condition!r}; known: {', '.join(CONDITIONS)}")
    model = asked.fork(recipe, budget)
    model.compress(keep_last=len(question) if condition == "restricted" else 0)
    return model, asked_logits


def question_kept(model: CompressedModel, start: int) -> float:
    """Share of the question's entries (positions from ``start`` on) every (layer, KV head) still holds."""
    pos = model.held_positions()[:, 0]
    asked = int(model.seen[0]) - start
    return float((pos >= start).sum()) / (asked * pos.shape[0] * pos.shape[1])


@torch.no_grad()
def sample_rows(base: CompressedModel, cells: list, context: list[int], question: list[int], score, tokenizer,
                max_new_tokens: int) -> list[dict]:
    """Every cell under every condition on one sample (the full cell once: its conditions coincide)."""
    base.reset()
    base.prefill(ids_tensor(context, base.device), compress=False, logits="last")
    asked = base.fork()
    asked_logits = asked.prefill(ids_tensor(question, base.device), compress=False, logits="last")[0, -1]
    rows = []
    for recipe, budget in cells:
        for condition in ("boundary",) if budget.is_full else CONDITIONS:
            t0 = time.perf_counter()
            row = {"recipe": recipe.tag, "budget": str(budget), "condition": condition}
            try:
                model, logits = compressed(base, asked, asked_logits, recipe, budget, condition, question)
                stats = model.cache_stats()
                row.update(bytes_held=stats["bytes_held"], bytes_full=stats["bytes_full"],
                           question_kept=question_kept(model, len(context)),
                           tokens=answer(model, tokenizer, logits, max_new_tokens))
                row["score"] = score(tokenizer.decode(row["tokens"], skip_special_tokens=True))
            except Exception as e:  # noqa: BLE001 - a failing cell is a result, not the end of the run
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row | {"wall_s": time.perf_counter() - t0})
    return rows


def run(cm: CompressedModel, tokenizer, recipes: list, budgets: list, tasks: list[str], *, n_samples: int = 10,
        length: int = 1024, seed: int = 0, progress: bool = True) -> dict:
    """Every (recipe, budget) under the three conditions on ``n_samples`` samples of each task; returns
    ``{"samples": [per (sample, cell, condition)], "summary": [...], "decomposition": [...], "config", "timing"}``."""
    start, cells = time.perf_counter(), grid(recipes, budgets)
    tables.check(tasks, n_samples)
    base, samples = shared_base(cm, cells), []
    for name, index, sample, context, question, max_new in tables.samples(tokenizer, tasks, n_samples, length, seed,
                                                                          "query leak", progress):
        for row in sample_rows(base, cells, context, question, sample.score, tokenizer, max_new):
            samples.append({"task": name, "sample": index, **row})
    summary = tables.means(samples, ("task", "recipe", "budget", "condition"),
                           ("score", "bytes_held", "bytes_full", "question_kept", "wall_s"))
    return {"samples": samples, "summary": summary, "decomposition": decomposition(summary),
            "config": {"recipes": [r.tag for r, _ in cells], "budgets": [str(b) for b in budgets], "tasks": tasks,
                       "n_samples": n_samples, "length": length, "seed": seed},
            "timing": {"total_s": time.perf_counter() - start}}


def decomposition(summary: list[dict]) -> list[dict]:
    """Per (task, recipe, budget): each condition's score and bytes, and the two deltas against query-aware in
    points (score x 100), as the paper reports them."""
    by = {(r["task"], r["recipe"], r["budget"], r["condition"]): r for r in summary}
    out = []
    for task, recipe, budget in dict.fromkeys(k[:3] for k in by if k[3] == "query-aware"):
        cond = {c: by.get((task, recipe, budget, c), {}) for c in CONDITIONS}
        aware = cond["query-aware"].get("score")
        row = {"task": task, "recipe": recipe, "budget": budget, "n": cond["query-aware"]["n"]}
        for c in CONDITIONS:
            row[c] = cond[c].get("score")
            row[f"{c} bytes"] = cond[c].get("bytes_held")
        for c in PAPER:
            row[f"{c} delta"] = None if aware is None or row[c] is None else 100 * (row[c] - aware)
        row["question kept (aware)"] = cond["query-aware"].get("question_kept")
        out.append(row)
    return out


def markdown(result: dict, model: str, command: str) -> str:
    explanation = ("Score: the task's string match, mean over samples; Δ: points against query-aware (paper: "
                   f"restricted {PAPER['restricted']}, boundary {PAPER['boundary']}); KiB: K/V pages held once the "
                   "question is read; question kept: share of the question's entries query-aware compression kept.")
    cols = [("task", "s"), ("recipe", "s"), ("budget", "s"), ("n", "d"), ("query-aware", ".2f"),
            ("restricted", ".2f"), ("boundary", ".2f"), ("restricted delta", "+.1f"), ("boundary delta", "+.1f"),
            ("query-aware bytes", "kib"), ("restricted bytes", "kib"), ("boundary bytes", "kib"),
            ("question kept (aware)", ".2f")]
    return tables.report(f"Query-leak decomposition: {model} (ABSTRACT-ONLY / INFERRED)", command,
                         result, explanation, result["decomposition"], cols)
