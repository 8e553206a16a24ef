"""Nominal vs enforced budgets (issue 20 item 3; ContourKV's abstract only: INFERRED): a per-head method's
score and bytes in three storage layouts of the same document, on the needle tasks.

- ``mask``: the method's own selection stored as a mask over the full cache (``masked``: the plain model attends
  to the kept entries only), as the shared pipeline kvpress does; the bytes held are the full document's.
- ``ragged``: kvcompile's storage: each (layer, KV head) holds its own count, the budget's bytes.
- ``rectangular``: one length for every head, the same byte budget (what a padded layout must do): the method's
  scorer with a uniform allocator (``rectangular``), each head's top tokens by the same scores; its bytes are the
  padded layout's, every head as long as the longest.

Mask and ragged attend to the same entries, so they answer alike (up to float rounding) and differ in bytes only;
the paper's "14-62 points" is the cost of enforcing the bytes on one rectangular selection. Inferred: the abstract
names the claims, not the protocol; the three layouts above are our reading of it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ...model import CompressedModel
from ...recipes import Recipe, get_recipe
from ..decoding import answer, ids_tensor, read_question
from ..sweep import grid, shared_base
from . import masked, tables

LAYOUTS = ("ragged", "mask", "rectangular")  # the mask layout masks the ragged one's selection
PAPER = "enforcing the nominal budget on one fixed (rectangular) selection costs 14-62 points (arXiv 2608.25230)"


def rectangular(recipe: str | Recipe) -> Recipe:
    """``recipe``'s scorer with one count for every (layer, KV head): the uniform allocator at the same budget."""
    recipe = get_recipe(recipe)
    return dataclasses.replace(recipe, name=f"{recipe.name}-rectangular", allocator="uniform", allocator_args={},
                               provenance="custom", inferred="one length for every head: an analysis layout")


def padded_bytes(model: CompressedModel, stats: dict) -> int:
    """Bytes of a rectangular layout of what ``model`` holds (``stats``: its ``cache_stats()``): every (layer, KV
    head) as long as the longest."""
    longest = int((model.held_positions() >= 0).sum(-1).max())
    return longest * stats["bytes_full"] // int(model.seen.sum())  # bytes_full: every token in every head


@torch.no_grad()
def sample_rows(base: CompressedModel, plain, cells: list, context: list[int],
                question: list[int], score, tokenizer, max_new_tokens: int) -> list[dict]:
    """Every cell in every layout on one sample; ``base`` holds the document uncompressed and observed, ``plain``
    is the plain model's cache of it."""
    rows, q = [], ids_tensor(question, base.device)
    for recipe, budget in cells:
        ragged = ragged_stats = selection = None  # the ragged layout's model, stats and selection: the mask reads them
        for layout in ("ragged",) if budget.is_full else LAYOUTS:
            t0 = time.perf_counter()
            row = {"recipe": recipe.tag, "budget": str(budget), "layout": layout}
            try:
                if layout == "mask":
                    if ragged is None:
                        raise RuntimeError("the ragged layout failed: no selection to mask")
                    stats, held = ragged_stats, ragged_stats["bytes_full"]
                    reader = masked.MaskedModel(base.source, selection, plain)
                    with masked.masking(base.source):
                        tokens = answer(reader, tokenizer, reader.prefill(q)[0, -1], max_new_tokens)
                else:
                    model = base.fork(rectangular(recipe) if layout == "rectangular" else recipe, budget)
                    model.compress()
                    stats = model.cache_stats()  # the document's, before the question is read
                    held = stats["bytes_held"] if layout == "ragged" else padded_bytes(model, stats)
                    if layout == "ragged":
                        ragged, ragged_stats = model, stats
                        selection = masked.kept(model.held_positions(), len(context))
                    tokens = answer(model, tokenizer, read_question(model, question), max_new_tokens)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                row.update(bytes_held=held, budget_bytes=stats["budget_bytes"], bytes_full=stats["bytes_full"],
                           score=score(text), tokens=tokens)
            except Exception as e:  # noqa: BLE001 - a failing cell is a result, not the end of the run
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row | {"wall_s": time.perf_counter() - t0})
    same = {r["budget"] + r["recipe"]: r.get("tokens") for r in rows if r["layout"] == "ragged"}
    for r in rows:  # whether the mask layout answered what the ragged one did (they attend to the same entries)
        r["same_as_ragged"] = (None if r.get("tokens") is None
                               else float(r["tokens"] == same.get(r["budget"] + r["recipe"])))
    return rows


def run(cm: CompressedModel, tokenizer, recipes: list, budgets: list, tasks: list[str], *, n_samples: int = 10,
        length: int = 1024, seed: int = 0, progress: bool = True) -> dict:
    """Every (recipe, budget) in the three layouts on ``n_samples`` samples of each task; returns ``{"samples",
    "summary", "table", "config", "timing"}``. ``cm``'s ``source`` (the plain model) runs the mask layout."""
    if cm.source is None:
        raise ValueError("the mask layout runs the plain model: pass a CompressedModel applied to one (not loaded)")
    start, cells = time.perf_counter(), grid(recipes, budgets)
    tables.check(tasks, n_samples)
    base, samples = shared_base(cm, cells), []
    for name, index, sample, context, question, max_new in tables.samples(tokenizer, tasks, n_samples, length, seed,
                                                                          "nominal vs enforced", progress):
        base.reset()
        with torch.no_grad():
            base.prefill(ids_tensor(context, base.device), compress=False, logits="last")
        plain = masked.document(base.source, ids_tensor(context, base.device))
        for row in sample_rows(base, plain, cells, context, question, sample.score, tokenizer, max_new):
            samples.append({"task": name, "sample": index, **row})
    summary = tables.means(samples, ("task", "recipe", "budget", "layout"),
                           ("score", "bytes_held", "budget_bytes", "bytes_full", "same_as_ragged", "wall_s"))
    return {"samples": samples, "summary": summary, "table": table(summary),
            "config": {"recipes": [r.tag for r, _ in cells], "budgets": [str(b) for b in budgets], "tasks": tasks,
                       "n_samples": n_samples, "length": length, "seed": seed},
            "timing": {"total_s": time.perf_counter() - start}}


def table(summary: list[dict]) -> list[dict]:
    """Per (task, recipe, budget): each layout's score and bytes, rectangular minus ragged in points, and how often
    the mask layout answered as the ragged one."""
    by = {(r["task"], r["recipe"], r["budget"], r["layout"]): r for r in summary}
    out = []
    for task, recipe, budget in dict.fromkeys(k[:3] for k in by if k[3] == "mask"):
        lay = {x: by.get((task, recipe, budget, x), {}) for x in LAYOUTS}
        row = {"task": task, "recipe": recipe, "budget": budget, "n": lay["ragged"].get("n"),
               "budget bytes": lay["ragged"].get("budget_bytes"), "mask = ragged": lay["mask"].get("same_as_ragged")}
        for x in LAYOUTS:
            row[x], row[f"{x} bytes"] = lay[x].get("score"), lay[x].get("bytes_held")
        row["rectangular delta"] = None if None in (row["rectangular"], row["ragged"]) else \
            100 * (row["rectangular"] - row["ragged"])
        out.append(row)
    return out


def markdown(result: dict, model: str, command: str) -> str:
    explanation = ("Score: the task's string match, mean over samples. KiB: the document's K/V bytes each layout "
                   "holds (mask: the full cache; ragged: pages held; rectangular: every head padded to the longest); "
                   "Δ: rectangular minus ragged in points; mask = ragged: share of samples whose answers are "
                   f"identical. Paper: {PAPER}.")
    cols = [("task", "s"), ("recipe", "s"), ("budget", "s"), ("n", "d"), ("mask", ".2f"), ("ragged", ".2f"),
            ("rectangular", ".2f"), ("rectangular delta", "+.1f"), ("mask bytes", "kib"), ("ragged bytes", "kib"),
            ("rectangular bytes", "kib"), ("budget bytes", "kib"), ("mask = ragged", ".2f")]
    return tables.report(f"Nominal vs enforced budgets: {model} (ABSTRACT-ONLY / INFERRED)", command,
                         result, explanation, result["table"], cols)
