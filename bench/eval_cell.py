"""What one evaluation cell costs over compressed pages against the same cell over the full cache (issue 49).

A cell is what an evaluator runs per prompt: prefill a context, compress it, read a question, generate a few tokens
(``generate(question, context_ids=...)``). Each recipe runs the same prompts (random tokens, one process, no
warm-up cell counted), the full cache first; the table gives each recipe's seconds a prompt and its ratio to the full
cache's, measured in the same run. Issue 49 asks the cells over int3, int4 and kivi2 pages for at most 1.2x.

    python bench/eval_cell.py --context 1024 --prompts 8
"""

from __future__ import annotations

import argparse
import time

import torch
from record import Results

import kvcompile

RECIPES = "full,snapkv,snapkv+int3,snapkv+int4,snapkv+kivi2,kvzip,kvzip+int3"


def cell_seconds(cm, prompts: list[tuple[torch.Tensor, torch.Tensor]], new_tokens: int) -> float:
    """Seconds a prompt over ``prompts`` (context, question), after one untimed cell (first calls load kernels)."""
    context, question = prompts[0]
    cm.generate(question, context_ids=context, max_new_tokens=new_tokens, eos_token_id=[])
    t0 = time.perf_counter()
    for context, question in prompts:
        cm.generate(question, context_ids=context, max_new_tokens=new_tokens, eos_token_id=[])
    return (time.perf_counter() - t0) / len(prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--question", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--recipes", default=RECIPES, help="comma-separated; the full cache is always measured first")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Results("eval_cell", args.out)
    model, _ = kvcompile.load_model(args.model)
    g = torch.Generator().manual_seed(args.context)
    vocab = model.config.vocab_size
    prompts = [(torch.randint(100, vocab - 100, (1, args.context), generator=g),
                torch.randint(100, vocab - 100, (1, args.question), generator=g)) for _ in range(args.prompts)]
    names = ["full"] + [n for n in args.recipes.split(",") if n != "full"]
    rows = []
    for name in names:
        cm = kvcompile.apply(model, budget=1.0 if name == "full" else args.budget, recipe=name)
        seconds = cell_seconds(cm, prompts, args.new_tokens)
        rows.append(dict(recipe=name, seconds=round(seconds, 3), bytes_held=int(cm.cache_stats()["bytes_held"])))
        print(f"{name}: {seconds:.2f} s a prompt", flush=True)
    full = rows[0]["seconds"]
    for row in rows:
        row["ratio"] = round(row["seconds"] / full, 3)
    out.json(dict(rows=rows, **vars(args)))
    lines = ["| recipe | s a prompt | x full cache | bytes held after the cell |", "|---|---|---|---|"]
    lines += [f"| {r['recipe']} | {r['seconds']:.2f} | {r['ratio']:.2f} | {r['bytes_held']:,} |" for r in rows]
    out.markdown(f"One evaluation cell ({args.model}, context {args.context}, question {args.question}, "
                 f"{args.new_tokens} new tokens, budget {args.budget}, {args.prompts} prompts of random tokens; the "
                 f"full cache measured in the same run).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
