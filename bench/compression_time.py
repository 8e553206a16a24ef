"""What compression costs beside the prefill it follows, for every prefill-time recipe and every page format.

For each (context, batch): one prefill of random tokens with ``compress=False`` (timed: the prefill), under the
recipe that observes the widest query window so every recipe can be served from it; then, for each recipe, a
``fork`` of that cache retargeted to the recipe at ``--budget`` and its ``compress()`` (timed: the compression,
what a sweep over recipes pays per cell, and what ``generate`` pays after its prefill); a recipe a fork cannot serve
(an adapter of its own, tables calibrated or encoded at ``apply``) prefills the same context itself first. Page
formats are measured as ``snapkv+<format>``. A recipe that needs an extra model pass (a reconstruction prompt,
gradients, hidden states: its scorer declares such a source) is bounded by 1.5x the prefill, any other by 0.5x
(issue 53's bounds); the table marks each. Each compression is timed twice and the better kept (once where it takes
over ``ONCE`` seconds). A recipe refused here (one that ranks by a question, which `generate` compresses with the
question apart) says so. A second row times the same context prefilled again after itself (on plain pages, the full
cache): the least a reconstruction pass costs (KVzip's repeats the context, its queries reading twice the keys).

    python bench/compression_time.py --contexts 1024,4096 --batches 1,4 --budget 0.25
"""

from __future__ import annotations

import argparse
import time

import torch
from record import Results

import kvcompile
from kvcompile.kernels.formats import FORMATS
from kvcompile.methods.learned import MissingWeights
from kvcompile.methods.sources import ExtraPass, Gradients, HiddenStates, Reconstruction

EXTRA_PASS = (Reconstruction, Gradients, HiddenStates, ExtraPass)
ONCE = 5.0  # seconds: a compression this slow is timed once (a one-time setup cost is lost in it)


def cells() -> list[str]:
    """Every named recipe that compresses at prefill, then every page format under snapkv."""
    named = sorted(n for n, r in kvcompile.recipes().items()
                   if (r.scorer is not None or r.format is not None) and r.decode is None and n != "full")
    return named + [f"snapkv+{f}" for f in sorted(FORMATS)]


def compressions(widest, cm, ids: torch.Tensor, budget: float) -> list[float]:
    """Seconds of two compressions of the prefilled context (the better is kept: a scorer's first call pays its
    one-time setup): forks of ``widest``'s cache, or, for a recipe a fork cannot serve (an adapter of its own,
    tables calibrated or encoded at ``apply``), its own prefill of the same context (not timed) each time."""
    try:
        cells = [lambda: widest.fork(cm.recipe, budget) for _ in range(2)]
        cells[0]()
    except ValueError:
        def own():
            cm.reset()
            cm.prefill(ids, compress=False, logits="last")
            return cm
        cells = [own, own]
    times = []
    for make in cells:
        cell = make()
        t0 = time.perf_counter()
        cell.compress()
        times.append(time.perf_counter() - t0)
        if times[0] > ONCE:
            break
    return times


def needs_pass(cm) -> bool:
    return cm.scorer is not None and any(isinstance(s, EXTRA_PASS) for s in cm.scorer.sources())


def measure(base, tokenizer, recipes: list[str], context: int, batch: int, budget: float, progress,
            rows: list[dict]) -> None:
    """Append a row per recipe to ``rows``, calling ``progress(message)`` after each (a process killed for memory
    keeps what was written before it)."""
    g = torch.Generator().manual_seed(context * 10 + batch)
    ids = torch.randint(100, base.programs.vocab_size - 100, (batch, context), generator=g)
    models = {}
    for name in recipes:
        try:  # text a recipe names (a meta-query, anchor patterns) as this tokenizer's ids
            recipe = kvcompile.recipes.anchors.resolve(name, tokenizer)
            models[name] = kvcompile.apply(base, budget=budget, recipe=recipe)
        except (ValueError, MissingWeights) as e:  # not for this setting, or weights not trained here
            models[name] = str(e)
    widest = max((m for m in models.values() if not isinstance(m, str)), key=lambda m: m.observation_window)
    widest = kvcompile.apply(base, budget=1.0, recipe=widest.recipe)
    widest.prefill(ids[:, :64], compress=False, logits="last")  # warm-up: first calls load kernels
    widest.reset()
    t0 = time.perf_counter()
    widest.prefill(ids, compress=False, logits="last")
    prefill = time.perf_counter() - t0
    again = kvcompile.apply(base, budget=1.0, recipe="full")  # plain pages: no recipe's window or weights
    again.prefill(ids, compress=False, logits="last")
    t0 = time.perf_counter()
    again.prefill(ids, compress=False, logits="last")  # what a reconstruction pass costs at least
    again_s = time.perf_counter() - t0
    del again
    for name, cm in models.items():
        row = dict(recipe=name, context=context, batch=batch, prefill_s=round(prefill, 3), again_s=round(again_s, 3))
        if isinstance(cm, str):
            rows.append(row | dict(refused=cm[:160]))
            continue
        try:
            row["compress_s"] = round(min(compressions(widest, cm, ids, budget)), 3)
        except (ValueError, NotImplementedError) as e:
            rows.append(row | dict(refused=str(e)[:160]))
            continue
        row["extra_pass"] = needs_pass(cm)
        row["ratio"] = round(row["compress_s"] / prefill, 3)
        row["bound"] = 1.5 if row["extra_pass"] else 0.5
        row["within"] = row["ratio"] <= row["bound"]
        rows.append(row)
        progress(f"{context}x{batch} {name}: {row['compress_s']:.2f} s, {row['ratio']:.2f}x prefill")


def table(rows: list[dict], settings: list[tuple[int, int]]) -> str:
    head = "| recipe | " + " | ".join(f"{c}x{b} compress s (x prefill)" for c, b in settings) + " | bound |"
    lines = [head, "|---|" + "---|" * len(settings) + "---|"]
    prefill = {(r["context"], r["batch"]): r["prefill_s"] for r in rows}
    lines.append("| *prefill* | " + " | ".join(f"{prefill[s]:.2f}" for s in settings) + " | |")
    again = {(r["context"], r["batch"]): r.get("again_s") for r in rows}
    lines.append("| *the context read again after itself* | " + " | ".join(
        "-" if again[s] is None else f"{again[s]:.2f} ({again[s] / prefill[s]:.2f}x)" for s in settings) + " | |")
    by = {(r["recipe"], r["context"], r["batch"]): r for r in rows}
    for name in dict.fromkeys(r["recipe"] for r in rows):
        cellv, bound = [], ""
        for c, b in settings:
            r = by.get((name, c, b))
            if r is None:
                cellv.append("not measured")
                continue
            if "refused" in r:
                cellv.append("refused")
                continue
            bound = f"{r['bound']}x" + (" (extra pass)" if r["extra_pass"] else "")
            cellv.append(f"{r['compress_s']:.2f} ({r['ratio']:.2f}x)" + ("" if r["within"] else " **over**"))
        lines.append(f"| {name} | " + " | ".join(cellv) + f" | {bound} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--recipes", default=None, help="comma-separated (default: every prefill recipe and format)")
    p.add_argument("--skip", default="", help="comma-separated recipes left out (one this machine cannot hold)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Results("compression_time", args.out)
    model, tokenizer = kvcompile.load_model(args.model)
    base = kvcompile.apply(model, budget=1.0, recipe="full")
    recipes = [r for r in (args.recipes.split(",") if args.recipes else cells()) if r not in args.skip.split(",")]
    settings = [(int(c), int(b)) for c in args.contexts.split(",") for b in args.batches.split(",")]
    rows = []

    def progress(message: str) -> None:
        print(message, flush=True)
        out.json(dict(rows=rows, budget=args.budget, model=args.model))

    for context, batch in settings:
        measure(base, tokenizer, recipes, context, batch, args.budget, progress, rows)
        out.json(dict(rows=rows, budget=args.budget, model=args.model))
    over = sorted({r["recipe"] for r in rows if r.get("within") is False})
    out.markdown(f"Compression time against the prefill of the same context ({args.model}, budget {args.budget}, "
                 f"random tokens; fork of one prefilled cache, then `compress()`).\n\n{table(rows, settings)}\n\n"
                 f"Over their bound: {', '.join(over) or 'none'}.\n")


if __name__ == "__main__":
    main()
