"""Grid evaluation: recipes x budgets x synthetic tasks, one shared prefill per context.

Per context the full-budget model prefills once (``compress=False``: nothing evicted, the queries kept) with the
widest observation window any cell reads; each cell then forks that cache, compresses it
(``CompressedModel.fork`` + ``compress``), reads the question (query-agnostic) and decodes
greedily. A grid of K cells costs about one prefill plus K compress-and-decode steps per context instead of K
prefills. Scores are the task definitions' own (``Sample.score``). Optional columns: next-token KL(full ||
compressed) and top-1 agreement, teacher-forced on the question plus the full-budget answer.

A cell that fails records its error and the sweep goes on.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import kvcompile

from ..budget import Budget
from ..recipes import Recipe, get_recipe
from ..model import CompressedModel
from .decoding import greedy, ids_tensor, read_question
from .fidelity import next_token_metrics, summarize
from .synthetic import get_task, make_sample

COLUMNS = ["task", "recipe", "provenance", "budget", "score", "n", "bytes_held_mean", "bytes_full_mean",
           "held_fraction", "wall_s", "kl_mean", "kl_p99", "top1", "error"]


@dataclass
class _Cell:
    recipe: str
    budget: str
    scores: list = field(default_factory=list)
    held: list = field(default_factory=list)
    full: list = field(default_factory=list)
    wall: float = 0.0
    parts: list = field(default_factory=list)
    error: str | None = None


def parse_budget(text: str) -> float | int | str:
    """"0.25" -> 0.25 (fraction), "512" -> 512 (tokens per KV head), "64MiB" -> "64MiB" (bytes)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _answer(cm: CompressedModel, tokenizer, question: list[int], max_new_tokens: int) -> list[int]:
    ids = (tokenizer.eos_token_id, getattr(cm.generation_config, "eos_token_id", None))
    eos = {t for t in ids if isinstance(t, int)}
    return greedy(cm, read_question(cm, question), max_new_tokens, eos_ids=eos)


def run(
    cm: CompressedModel,
    tokenizer,
    recipes: list,
    budgets: list,
    tasks: list[str],
    *,
    n_samples: int = 10,
    length: int = 1024,
    seed: int = 0,
    kl: bool = False,
    measure_separate: int = 0,
    progress: bool = True,
) -> dict:
    """Run the grid; returns ``{"rows": [...], "timing": {...}, "config": {...}}`` (rows follow ``COLUMNS``).

    ``recipes``: names from ``kvcompile.recipes()`` or ``Recipe`` objects; ``budgets``: anything ``apply`` takes.

    ``cm`` is any ``CompressedModel`` of the model (it is re-targeted, never modified). The full-budget cell is
    always run first (it is the reference for KL). ``measure_separate``: for that many contexts, also run every
    cell as a separate prefill + compress + decode, to time the shared prefill against K separate runs and check
    that both give the same answer.
    """
    task_objs = [get_task(t) for t in tasks]
    chosen = [get_recipe(r) for r in recipes]
    cells = [(get_recipe("full"), Budget.parse(1.0))] + [
        (r, Budget.parse(b)) for r in chosen for b in budgets if r.name != "full"
    ]
    widest = max(_observation_window(cm, r, b) for r, b in cells)
    shared = Recipe("shared-prefill", "snapkv", scorer_args={"window": max(widest, 1)})  # observes, keeps everything
    base = kvcompile.apply(cm, budget=1.0, recipe=shared)
    table = {(t.name, r.name, str(b)): _Cell(r.name, str(b)) for t in task_objs for r, b in cells}
    timing = {"shared_prefill_s": 0.0, "cells_s": 0.0, "contexts": 0, "separate_s": 0.0, "separate_contexts": 0,
              "separate_shared_s": 0.0, "separate_mismatches": 0}
    bar = tqdm(total=len(task_objs) * n_samples * len(cells), disable=not progress, desc="sweep")
    for task in task_objs:
        for index in range(n_samples):
            sample = make_sample(task, tokenizer, length, seed=seed, index=index)
            context, question = (_encode(tokenizer, t) for t in sample.prompt(tokenizer))
            t0 = time.perf_counter()
            base.reset()
            with torch.no_grad():
                base.prefill(ids_tensor(context, base.device), compress=False, logits="last")
            prefill_s = time.perf_counter() - t0
            timing["shared_prefill_s"] += prefill_s
            timing["contexts"] += 1
            reference, ref_logits, answers, context_cells_s = None, None, {}, 0.0
            for recipe, budget in cells:
                cell = table[(task.name, recipe.name, str(budget))]
                t0 = time.perf_counter()
                try:
                    model = base.fork(recipe, budget)
                    model.compress()
                    stats = model.cache_stats()
                    probe = model.fork() if kl else None
                    tokens = _answer(model, tokenizer, question, task.max_new_tokens)
                    cell.wall += time.perf_counter() - t0
                    answers[(recipe.name, str(budget))] = tokens
                    cell.scores.append(sample.score(tokenizer.decode(tokens, skip_special_tokens=True)))
                    cell.held.append(stats["bytes_held"])
                    cell.full.append(stats["bytes_full"])
                    if reference is None:
                        reference = question + tokens
                    if kl:
                        with torch.no_grad():
                            logits = probe.prefill(ids_tensor(reference, probe.device), compress=False)[0, :-1]
                        if ref_logits is None:
                            ref_logits = logits
                        cell.parts.append(next_token_metrics(ref_logits, logits, torch.tensor(reference[1:])))
                except Exception as e:  # noqa: BLE001 - a failing recipe is a result, not the end of the sweep
                    cell.error = f"{type(e).__name__}: {e}"
                    cell.wall += time.perf_counter() - t0
                context_cells_s += time.perf_counter() - t0
                bar.update(1)
            if timing["separate_contexts"] < measure_separate:
                _separate(base, cells, context, question, tokenizer, task.max_new_tokens, answers, timing)
                timing["separate_shared_s"] += prefill_s + context_cells_s
    bar.close()
    rows, provenance = [], {r.name: r.provenance for r, _ in cells}
    for (task, recipe, budget), cell in table.items():
        row = {"task": task, "recipe": recipe, "provenance": provenance[recipe], "budget": budget,
               "n": len(cell.scores), "wall_s": cell.wall, "error": cell.error}
        if cell.scores:
            held, full = sum(cell.held) / len(cell.held), sum(cell.full) / len(cell.full)
            row.update(score=sum(cell.scores) / len(cell.scores), bytes_held_mean=held, bytes_full_mean=full,
                       held_fraction=held / full)
        if cell.parts:
            s = summarize(cell.parts)
            row.update(kl_mean=s["kl_mean"], kl_p99=s["kl_p99"], top1=s["top1"])
        rows.append({c: row.get(c) for c in COLUMNS})
    timing["cells_s"] = sum(c.wall for c in table.values())
    if timing["separate_contexts"]:
        timing["shared_over_separate"] = timing["separate_shared_s"] / timing["separate_s"]
    config = {"recipes": list(dict.fromkeys(r.name for r, _ in cells)), "budgets": [str(b) for b in budgets],
              "tasks": tasks, "n_samples": n_samples, "length": length, "seed": seed, "query_aware": False,
              "recipe_tags": {r.name: r.tag for r, _ in cells}, "recipe_provenance": provenance}
    return {"rows": rows, "timing": timing, "config": config}


def _observation_window(cm: CompressedModel, recipe, budget) -> int:
    """Queries a cell reads; 0 for a cell that cannot be built (its error is recorded when it runs)."""
    try:
        return kvcompile.apply(cm, budget=budget, recipe=recipe).observation_window
    except ValueError:
        return 0


def _separate(base, cells, context, question, tokenizer, max_new_tokens, answers, timing) -> None:
    """Time every cell as its own prefill + compress + decode from an empty cache (making the model is not timed)
    and count answers that differ from the shared-prefill ones."""
    cell_times = 0.0
    for recipe, budget in cells:
        if (recipe.name, str(budget)) not in answers:  # failed in the shared run: its error is already recorded
            continue
        model = base.fork(recipe, budget)  # same programs as a re-targeted apply(), without rewriting them
        model.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.prefill(ids_tensor(context, model.device), logits="last")
        tokens = _answer(model, tokenizer, question, max_new_tokens)
        cell_times += time.perf_counter() - t0
        timing["separate_mismatches"] += int(tokens != answers.get((recipe.name, str(budget))))
    timing["separate_s"] += cell_times
    timing["separate_contexts"] += 1


def markdown(result: dict, model: str = "") -> str:
    """The table as Markdown: one row per (task, recipe, budget), then the shared-prefill timing."""
    cfg, t = result["config"], result["timing"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"{model} @ {cfg['length']} tokens, {cfg['n_samples']} samples per task, seed {cfg['seed']}, "
             "query-agnostic (context compressed before the question is read). Bytes: K/V pages held per request "
             "after compressing the context; wall: seconds per cell (compress + answer, all samples), the shared "
             "prefill excluded.", "",
             "| task | recipe | provenance | budget | score | KiB held | held / full | wall s | KL mean | KL p99 "
             "| top-1 | error |", "|" + "---|" * 12]
    tags, provenance = cfg["recipe_tags"], cfg["recipe_provenance"]
    for r in result["rows"]:
        kib = None if r["bytes_held_mean"] is None else r["bytes_held_mean"] / 1024
        recipe = f"{tags[r['recipe']]} | {provenance[r['recipe']]}"
        lines.append(f"| {r['task']} | {recipe} | {r['budget']} | {fmt(r['score'], '.2f')} | {fmt(kib, '.0f')} | "
                     f"{fmt(r['held_fraction'], '.3f')} | {r['wall_s']:.1f} | {fmt(r['kl_mean'], '.3f')} | "
                     f"{fmt(r['kl_p99'], '.2f')} | {fmt(r['top1'], '.2f')} | {r['error'] or ''} |")
    lines += ["", f"Shared prefill: {t['shared_prefill_s']:.1f} s for {t['contexts']} contexts, cells "
              f"{t['cells_s']:.1f} s."]
    if t.get("separate_contexts"):
        lines.append(f"On {t['separate_contexts']} context(s) every cell was also run separately: shared "
                     f"{t['separate_shared_s']:.1f} s vs separate {t['separate_s']:.1f} s (ratio "
                     f"{t['shared_over_separate']:.3f}); answers that differ: {t['separate_mismatches']}.")
    return "\n".join(lines) + "\n"


def write(result: dict, out: str | Path, model: str = "") -> list[Path]:
    """``out``.csv, ``out``.json, ``out``.md and ``out``.png (score against bytes held, one panel per task, one
    line per recipe)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(result["rows"])
    out.with_suffix(".json").write_text(json.dumps({**result, "model": model}, indent=1))
    out.with_suffix(".md").write_text(markdown(result, model))
    paths = [out.with_suffix(".csv"), out.with_suffix(".json"), out.with_suffix(".md")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    tasks = list(dict.fromkeys(r["task"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in result["rows"] if r["task"] == task and r["score"] is not None]
        for k, recipe in enumerate(dict.fromkeys(r["recipe"] for r in rows)):
            pts = sorted((r["bytes_held_mean"] / 2**20, r["score"]) for r in rows if r["recipe"] == recipe)
            style = dict(marker="*", markersize=12) if recipe == "full" else dict(  # overlapping points stay visible
                marker="osD^vP<>"[k % 8], markersize=max(12 - 1.5 * k, 4), fillstyle="none", linestyle="-:--"[k % 3])
            ax.plot(*zip(*pts), label=recipe, **style)
        ax.set_title(task)
        ax.set_xlabel("KV bytes held per request (MiB)")
        ax.set_ylabel("score")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"{model} @ {cfg['length']} tokens, {cfg['n_samples']} samples per task (query-agnostic)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return paths + [out.with_suffix(".png")]
