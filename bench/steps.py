"""Steps as retention units (inferred; docs/methods_scorers.md) against token-level recipes at equal bytes, on
SmolLM2 and the
multi-step tasks (``kvcompile.eval.step_tasks``: a reasoning chain and an agent trace).

Per sample the full-budget model prefills the whole prompt (context, question and chat markers; the answer prefix
left out) once with ``compress=False`` and the sample's step spans as ``segments=``; every cell forks that cache,
compresses it to its budget (query-aware: the question's queries are among the observed ones, as the latest turn of
a trace is), then reads the answer prefix and decodes greedily. Per cell: the share of the needed steps' tokens held
over every layer and KV head (step retention), the answer's score (the reference string found), and the bytes held
against the budget's (checked: held <= budget in every cell). ``reco+reflect`` is ReCo with its reflection penalty
(0.5 on steps holding "Wait", "let me re-check"...), reported apart from ``reco``'s compression.

    nice python bench/steps.py --samples 10     # bench/results/steps/steps.{md,json,png}
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from record import Results

import kvcompile
from kvcompile.budget import Budget
from kvcompile.eval.decoding import answer, encode, ids_tensor, read_question
from kvcompile.eval.step_tasks import needed_retention, step_spans
from kvcompile.eval.sweep import shared_base
from kvcompile.eval.synthetic import get_task, make_sample
from kvcompile.recipes import get_recipe, reflection

RECIPES = ["stepkv", "commitkv", "reco", "snapkv", "tova", "streamingllm"]


def cells(tokenizer, recipes, budgets):
    chosen = [reflection.resolve("reco", tokenizer) if r == "reco+reflect" else get_recipe(r) for r in recipes]
    return [(get_recipe("full"), Budget.parse(1.0))] + [(r, Budget.parse(b)) for r in chosen for b in budgets]


def run_sample(base, tokenizer, grid, task: str, length: int, seed: int, index: int) -> list[dict]:
    sample = make_sample(task, tokenizer, length, seed=seed, index=index)
    context, question = sample.prompt(tokenizer)
    question = question.removesuffix(sample.answer_prefix)  # the answer prefix is read after compression
    spans = step_spans(tokenizer, context, sample.steps)
    prompt = encode(tokenizer, context) + encode(tokenizer, question)
    base.reset()
    with torch.no_grad():
        base.prefill(ids_tensor(prompt, base.device), compress=False, logits="last", segments=spans)
    rows = []
    for recipe, budget in grid:
        t0 = time.perf_counter()
        model = base.fork(recipe, budget)
        model.compress()
        stats = model.cache_stats()
        retention = needed_retention(model.held_positions(), spans, sample.needed)
        logits = read_question(model, encode(tokenizer, sample.answer_prefix))
        tokens = answer(model, tokenizer, logits, get_task(task).max_new_tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        held, allowed = stats["bytes_held"], stats["budget_bytes"]
        if allowed is not None and held > allowed:
            raise AssertionError(f"{recipe.name} at {budget}: {held} bytes held over the budget's {allowed}")
        rows.append({"task": task, "index": index, "recipe": recipe.name, "budget": str(budget),
                     "retention": retention, "score": sample.score(text), "bytes_held": held,
                     "budget_bytes": allowed, "bytes_full": stats["bytes_full"], "answer": text, "tokens": tokens,
                     "wall_s": time.perf_counter() - t0})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["recipe"], r["budget"]), []).append(r)
    out = []
    for (task, recipe, budget), rs in groups.items():
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        out.append({"task": task, "recipe": recipe, "budget": budget, "n": len(rs), "retention": mean("retention"),
                    "accuracy": mean("score"), "kib_held": mean("bytes_held") / 1024,
                    "kib_budget": None if rs[0]["budget_bytes"] is None else mean("budget_bytes") / 1024,
                    "kib_full": mean("bytes_full") / 1024})
    return out


def markdown(summary: list[dict], config: dict) -> str:
    lines = [f"SmolLM2-135M, step tasks at {config['length']} tokens, {config['samples']} samples per task, seed "
             f"{config['seed']}; query-aware (the question is compressed with the trace); step retention = share of "
             "the needed steps' tokens held over every layer and KV head; accuracy = reference string in the answer; "
             "KiB = K/V bytes held per request (budget's in brackets).", "",
             f"Command: `{config['command']}`; {config['wall_s'] / 60:.1f} min on {config['machine']}.", ""]
    for task in dict.fromkeys(s["task"] for s in summary):
        lines += [f"### {task}", "", "| recipe | budget | step retention | accuracy | KiB held (budget) |",
                  "|---|---|---|---|---|"]
        for s in (s for s in summary if s["task"] == task):
            budget = "" if s["kib_budget"] is None else f" ({s['kib_budget']:.0f})"
            lines.append(f"| {s['recipe']} | {s['budget']} | {s['retention']:.3f} | {s['accuracy']:.2f} | "
                         f"{s['kib_held']:.0f}{budget} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: list[dict]):
    """Step retention and accuracy against KiB held, a panel per task and metric (a figure to save)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(s["task"] for s in summary))
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    for col, task in enumerate(tasks):
        rows = [s for s in summary if s["task"] == task and s["recipe"] != "full"]
        for row, metric in enumerate(("retention", "accuracy")):
            ax = axes[row][col]
            for recipe in dict.fromkeys(s["recipe"] for s in rows):
                pts = sorted((s["kib_held"], s[metric]) for s in rows if s["recipe"] == recipe)
                ax.plot(*zip(*pts), marker="o", label=recipe)
            full = next(s for s in summary if s["task"] == task and s["recipe"] == "full")
            ax.axhline(full[metric], color="grey", ls="--", lw=1, label="full")
            ax.set(title=f"{task}: {metric}", xlabel="KiB held", ylabel=metric)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="steps_chain1,steps_agent")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--budgets", default="0.25,0.1")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="path stem of what is written (default bench/results/steps/steps)")
    args = p.parse_args()
    out = Results("steps", args.out)
    t0 = time.perf_counter()
    model, tokenizer = kvcompile.load_model("smollm2-135m")
    grid = cells(tokenizer, args.recipes.split(","), [float(b) for b in args.budgets.split(",")])
    base = shared_base(kvcompile.apply(model, budget=1.0, recipe="full"), grid)
    rows = []
    for index in range(args.samples):  # every task at each index, the outputs rewritten after each sample
        for task in args.tasks.split(","):
            rows += run_sample(base, tokenizer, grid, task, args.length, args.seed, index)
            print(f"{task} {index}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        write(out, rows, args, index + 1, time.perf_counter() - t0, grid)
    print(out.path(".md").read_text())


def write(out: Results, rows: list[dict], args, samples: int, wall_s: float, grid) -> None:
    summary = summarize(rows)
    config = {"command": "python bench/steps.py " + " ".join(sys.argv[1:]), "length": args.length,
              "samples": samples, "seed": args.seed, "wall_s": wall_s,
              "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads (shared)",
              "recipe_tags": {r.name: r.tag for r, _ in grid}}
    out.json({"config": config, "summary": summary, "rows": rows})
    out.markdown(markdown(summary, config))
    out.figure(plot(summary), dpi=110)


if __name__ == "__main__":
    main()
