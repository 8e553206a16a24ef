"""ReCo's early stop (``kvcompile.early_stop``, inferred), reported apart from its compression: on the step tasks
and SmolLM2, how many generated tokens it saves and what it does to the answer's score.

Cells as in ``bench/steps.py`` (fork the shared full prefill, compress query-aware, read the answer prefix), then
greedy decoding of up to ``--max-new-tokens`` (the step tasks' own 12 mostly end at the model's eos before a rule
could fire). Each cell decodes once without the early stop; where ``EarlyStop.settled`` first fires on that
output (the prompt's open step, the answer prefix, as its head) is where ``generate(early_stop=...)`` stops
(greedy tokens before the stop are the same: tests/test_early_stop.py), so one decode gives both runs: tokens
generated with and without, and both scores. Steps end at "." here (``--step-end``): the answers are one line.

    nice python bench/steps_stop.py --samples 3     # bench/results/steps_stop/steps_stop.{md,json}
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from record import Results

import kvcompile
from kvcompile.budget import Budget
from kvcompile.early_stop import EarlyStop
from kvcompile.eval.decoding import answer, encode, ids_tensor, read_question
from kvcompile.eval.step_tasks import step_spans
from kvcompile.eval.sweep import shared_base
from kvcompile.eval.synthetic import make_sample
from kvcompile.recipes import get_recipe


def run_sample(base, tokenizer, grid, stop: EarlyStop, task: str, args, index: int) -> list[dict]:
    sample = make_sample(task, tokenizer, args.length, seed=args.seed, index=index)
    context, question = sample.prompt(tokenizer)
    question = question.removesuffix(sample.answer_prefix)
    spans = step_spans(tokenizer, context, sample.steps)
    base.reset()
    with torch.no_grad():
        base.prefill(ids_tensor(encode(tokenizer, context) + encode(tokenizer, question), base.device),
                     compress=False, logits="last", segments=spans)
    rows = []
    for recipe, budget in grid:
        model = base.fork(recipe, budget)
        model.compress()
        logits = read_question(model, encode(tokenizer, sample.answer_prefix))
        tokens = answer(model, tokenizer, logits, args.max_new_tokens)
        head = stop.open_step(encode(tokenizer, context + question + sample.answer_prefix))
        end = next((i + 1 for i in range(len(tokens)) if stop.settled(tokens[: i + 1], head)), len(tokens))
        text = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
        rows.append({"task": task, "index": index, "recipe": recipe.name, "budget": str(budget),
                     "tokens": len(tokens), "tokens_stop": end, "score": sample.score(text(tokens)),
                     "score_stop": sample.score(text(tokens[:end])), "answer": text(tokens)})
    return rows


def markdown(rows: list[dict], config: dict) -> str:
    lines = [f"SmolLM2-135M, step tasks at {config['length']} tokens, {config['samples']} samples per task, greedy "
             f"up to {config['max_new_tokens']} new tokens; early stop = EarlyStop(tokenizer, step_end="
             f"{config['step_end']!r}): stop after a step that repeats an earlier one or holds 'the answer is' / "
             "'answer:' (the prompt's answer prefix opens the first step). Tokens = mean generated per answer.", "",
             f"Command: `{config['command']}`; {config['wall_s'] / 60:.1f} min on a shared CPU.", "",
             "| task | recipe | budget | n | tokens without | tokens with early stop | stopped early | "
             "accuracy without | accuracy with |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["recipe"], r["budget"]), []).append(r)
    for (task, recipe, budget), rs in groups.items():
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        early = sum(r["tokens_stop"] < r["tokens"] for r in rs)
        lines.append(f"| {task} | {recipe} | {budget} | {len(rs)} | {mean('tokens'):.1f} | {mean('tokens_stop'):.1f} "
                     f"| {early}/{len(rs)} | {mean('score'):.2f} | {mean('score_stop'):.2f} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="steps_chain1,steps_agent")
    p.add_argument("--recipes", default="full:1.0,reco:0.25,reco:0.1")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-end", default=".", help="EarlyStop's step_end (its default, a line, never ends the "
                   "one-line answers here)")
    p.add_argument("--out", help="path stem of what is written (default bench/results/steps_stop/steps_stop)")
    args = p.parse_args()
    out = Results("steps_stop", args.out)
    t0 = time.perf_counter()
    model, tokenizer = kvcompile.load_model("smollm2-135m")
    grid = [(get_recipe(c.split(":")[0]), Budget.parse(float(c.split(":")[1]))) for c in args.recipes.split(",")]
    base = shared_base(kvcompile.apply(model, budget=1.0, recipe="full"), grid)
    stop, rows = EarlyStop(tokenizer, step_end=args.step_end), []
    for index in range(args.samples):
        for task in args.tasks.split(","):
            rows += run_sample(base, tokenizer, grid, stop, task, args, index)
            print(f"{task} {index}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        config = {"command": "python bench/steps_stop.py " + " ".join(sys.argv[1:]), "length": args.length,
                  "samples": index + 1, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                  "step_end": args.step_end,
                  "wall_s": time.perf_counter() - t0, "recipe_tags": {r.name: r.tag for r, _ in grid}}
        out.json({"config": config, "rows": rows})
        out.markdown(markdown(rows, config))
    print(out.path(".md").read_text())


if __name__ == "__main__":
    main()
