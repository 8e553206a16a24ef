"""The accuracy-bytes frontier: each family's recipes against the bytes their cells really hold, from half of the
model-dtype cache down to a twentieth, with kvpress's best press beside them.

One run, two grids over the same model (one shared prefill per context, the question read after compression, so
every cell is query-agnostic): the retrieval tasks (``--tasks``: the needle and the pass key) at every budget of
``--budgets``, and the harder tasks (``--hard-tasks``: four keys, four values) at ``--hard-budgets``. A recipe that
stores every token (``full+<format>``) runs only at the budgets its tokens fit. Families: evict (a scorer, pages in
the model's dtype), quantize (every token in a page format), both (a scorer and a format: as many tokens as fit at
the format's cost). kvpress is read, not rerun: the best press per budget and task of the kvpress grid
(``bench/compare_kvpress.py``'s ``kvpress.json``: 10 samples a task, budgets 0.5 / 0.25 / 0.1, the same tasks and
length on SmolLM2), with the bytes its cache held (masks included).

    python bench/frontier.py --samples 40

``--merge a.json,b.json`` adds earlier runs' cells to this run's tables and plot (more recipes without running the
others again: the same tasks, samples and length; ``--recipes ""`` runs the full cache alone).

Writes ``bench/results/frontier/frontier.{json,md,png}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from formats import family, method_cells
from record import Results, default_stem

import kvcompile
from kvcompile.budget import Budget
from kvcompile.eval import sweep

RECIPES = ("keydiff", "twinkv", "full+int4", "full+rotk4v2", "full+rot3", "full+rotk3v2", "full+rot2", "twinkv+rot2",
           "twinkv+rotk3v2", "twinkv+rot3", "keydiff+rot3")
BUDGETS = (0.5, 0.25, 0.125, 0.1, 0.075, 0.05)
FITS = 1.02  # a kvpress cache within 2% of the budget fits it (its rounding)
KVPRESS = default_stem("compare_kvpress", "kvpress").with_suffix(".json")  # bench/compare_kvpress.py's grid


def kvpress_best(path: Path, tasks: list[str]) -> dict:
    """{budget: (press, mean score over ``tasks``, held / full)}: at each budget of the kvpress grid, the best press
    among those whose cache held at most the budget's bytes (``FITS``: a press that masks instead of freeing holds
    the full cache, and is not compared at equal bytes); only tasks the grid ran, {} without the file."""
    if not path.exists():
        return {}
    grid = json.loads(path.read_text())
    ran, n = grid["meta"]["tasks"].split(","), grid["meta"]["n_samples"]
    if not set(tasks) <= set(ran):
        return {}
    full = next(r for r in grid["rows"] if r["recipe"] == "full")["kvpress_bytes_held"]
    best = {}
    for row in grid["rows"]:
        if row["recipe"] == "full" or row.get("kvpress_error") or not row.get("kvpress_scores"):
            continue
        per_task = [row["kvpress_scores"][ran.index(t) * n:(ran.index(t) + 1) * n] for t in tasks]
        score = sum(sum(s) / len(s) for s in per_task) / len(per_task)
        key, held = str(Budget.parse(row["budget"])), row["kvpress_bytes_held"] / full
        if held > FITS * row["budget"]:
            continue
        if key not in best or score > best[key][1]:
            best[key] = (row["method"], score, held)
    return best


def run_grid(cm, tokenizer, model: str, recipes: list[str], budgets: list[float], tasks: list[str],
             samples: int, length: int) -> list[dict]:
    """Rows of the full cache and of every (recipe, budget) cell whose tokens fit (``formats.method_cells``); a
    recipe that stores every token holds the same bytes at every budget it fits, so it runs once, at the least."""
    fitting = method_cells(recipes, budgets, cm.spec.head_dim, references=())
    evicting = [(r, b) for r, b in fitting if family(r) in ("evict", "both")]
    stored = {r: min(b for r2, b in fitting if r2 == r) for r, _ in fitting if family(r) == "quantize"}
    result = sweep.run(cm, tokenizer, evicting + list(stored.items()), None, tasks, n_samples=samples,
                       length=length, kl=True, ledger_mass=False, model=model)
    return result["rows"]


def cell_table(rows: list[dict], title: str) -> list[str]:
    """Every cell: each task's score, their mean, the mean KL, and the bytes the cell really held."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by = {(r["recipe"], r["budget"], r["task"]): r for r in rows}
    keys = sorted(dict.fromkeys((r["recipe"], r["budget"]) for r in rows), key=lambda k: (-float(k[1]), k[0]))
    lines = [f"### {title}", "",
             "| family | recipe | budget | " + " | ".join(tasks) + " | mean | KL mean | held / full |",
             "|---|---|---|" + "---|" * (len(tasks) + 3)]
    for recipe, budget in keys:
        cells = [by.get((recipe, budget, t)) for t in tasks]
        scores = [c["score"] for c in cells if c and c["score"] is not None]
        kls = [c["kl_mean"] for c in cells if c and c.get("kl_mean") is not None]
        held = max(c["held_fraction"] for c in cells if c)
        mean = f"{sum(scores) / len(scores):.3f}" if scores else "-"
        kl = f"{sum(kls) / len(kls):.3f}" if kls else "-"
        lines.append(f"| {family(recipe)} | {recipe} | {budget} | "
                     + " | ".join("-" if c is None else f"{c['score']:.3f}" for c in cells)
                     + f" | {mean} | {kl} | {held:.3f} |")
    return lines


def means(rows: list[dict]) -> dict:
    """{(recipe, budget): (mean score over the tasks, held / full)}."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["recipe"], r["budget"]), []).append(r)
    return {k: (sum(r["score"] for r in v) / len(v), max(r["held_fraction"] for r in v)) for k, v in out.items()}


def best_table(rows: list[dict], kvpress: dict, title: str) -> list[str]:
    """Per budget: the best kvcompile cell of the grid that holds at most it (run at that budget or a smaller one;
    mean score, bytes held; ties to the fewer bytes) against the full cache and kvpress's best press."""
    m = means(rows)
    full = m[("full", "1")][0]
    lines = [f"### {title}", "", "| budget | best kvcompile recipe | mean | held / full | full cache | kvpress best | "
             "kvpress mean | kvpress held / full |", "|---|---|---|---|---|---|---|---|"]
    for budget in sorted({b for _, b in m if b != "1"}, key=float, reverse=True):  # any cell run at this budget or less
        recipe, (score, held) = max(((r, v) for (r, b), v in m.items() if b != "1" and float(b) <= float(budget)),
                                    key=lambda x: (x[1][0], -x[1][1]))
        press = kvpress.get(budget)
        kvp = f"{press[0]} | {press[1]:.3f} | {press[2]:.3f}" if press else "- | - | -"
        lines.append(f"| {budget} | {recipe} | {score:.3f} | {held:.3f} | {full:.3f} | {kvp} |")
    return lines


def plot(grids: list[tuple[str, list[dict], dict]]):
    """Mean score against bytes held, one panel per task group: a line per recipe styled by family, kvpress's best
    press per budget as black crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grids), figsize=(6.5 * len(grids), 4.5), squeeze=False)
    for ax, (title, rows, kvpress) in zip(axes[0], grids):
        m = means(rows)
        for recipe in sorted({r for r, _ in m}):
            xy = sorted((held, score) for (r, _), (score, held) in m.items() if r == recipe)
            style = {"evict": "-o", "quantize": "--s", "both": ":^", "reference": "k*"}[family(recipe)]
            ax.plot(*zip(*xy), style, label=recipe, markersize=5)
        if kvpress:
            ax.plot([v[2] for v in kvpress.values()], [v[1] for v in kvpress.values()], "kx", markersize=8,
                    label="kvpress best press")
        ax.set_xscale("log")
        ax.set_xlabel("K/V bytes held / full model-dtype cache")
        ax.set_ylabel("score (mean of the tasks)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="'' to skip the retrieval tasks")
    parser.add_argument("--tasks", default="niah_single_1,passkey")
    parser.add_argument("--hard-tasks", default="niah_multikey_1,niah_multivalue")
    parser.add_argument("--hard-budgets", default="0.1", help="'' to skip the harder tasks")
    parser.add_argument("--kvpress", default=str(KVPRESS), help="the kvpress grid's json ('' for none)")
    parser.add_argument("--merge", default="", help="earlier runs' json files (comma-separated) whose cells join this "
                        "run's in the tables and the plot (the same tasks, samples and length; this run's full cache "
                        "is kept)")
    parser.add_argument("--out", default=None, help="path stem of what is written (default "
                        "bench/results/frontier/frontier)")
    args = parser.parse_args()
    out = Results("frontier", args.out)
    model, tokenizer = kvcompile.load_model(args.model)
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    recipes = [r for r in args.recipes.split(",") if r]
    groups = [("retrieval", args.tasks.split(","), [float(b) for b in args.budgets.split(",")])] if args.budgets else []
    if args.hard_budgets:
        groups.append(("harder", args.hard_tasks.split(","), [float(b) for b in args.hard_budgets.split(",")]))
    grids, text = [], [f"# The accuracy-bytes frontier ({args.model}, {args.length} tokens, {args.samples} samples "
                       "per task, query-agnostic)", "",
                       "Budget = bytes of the model-dtype cache; held / full = the K/V bytes a cell really held "
                       "(codes, scales, page rounding) over the full cache's. kvpress: the best press of the kvpress "
                       "grid at that budget among those holding at most its bytes (10 samples per task; its bytes "
                       "include its masks).", ""]
    earlier: dict = {}  # a group's name in the json: "retrieval: <tasks>"
    for path in filter(None, args.merge.split(",")):
        for g in json.loads(Path(path).read_text())["groups"]:
            earlier.setdefault(g["name"].split(":")[0], []).extend(g["rows"])
    for name, tasks, budgets in groups:
        rows = run_grid(cm, tokenizer, args.model, recipes, budgets, tasks, args.samples, args.length)
        ran = {(r["recipe"], r["budget"]) for r in rows}
        for r in earlier.get(name, []):
            if (r["recipe"], r["budget"]) not in ran:
                rows.append(r)
                ran.add((r["recipe"], r["budget"]))
        kvpress = kvpress_best(Path(args.kvpress), tasks) if args.kvpress and args.model == "smollm2-135m" else {}
        title = f"{name}: {', '.join(tasks)}"
        grids.append((title, rows, kvpress))
        text += best_table(rows, kvpress, f"Best per budget, {title}") + [""]
        text += cell_table(rows, f"Every cell, {title}") + [""]
        out.json({"config": vars(args), "groups": [{"name": g[0], "rows": g[1], "kvpress": g[2]} for g in grids]})
    print(out.markdown("\n".join(text)).read_text())
    out.figure(plot(grids))


if __name__ == "__main__":
    main()
