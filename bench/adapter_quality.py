"""Recipes that serve an adapted model (``Recipe.adapter``: sparse-finetune-h2o, abstain-kvzip) against their plain
recipe, on the sweep's protocol (``kvcompile.eval.sweep``: the context compressed before the question is read, a
greedy answer scored by the task, next-token KL over question + the full cache's answer against the plain model's
full cache), but every cell with its own prefill: a sweep forks all cells from one shared prefill of the plain
model, which an adapted model cannot share.

    python bench/adapter_quality.py --recipes h2o,sparse-finetune-h2o --budgets 1.0,0.25,0.1,0.05 \\
        --out bench/results/adapter_quality/sparse_finetune_quality
"""

from __future__ import annotations

import argparse

import torch
from record import Results
from tqdm import tqdm

import kvcompile
from kvcompile.eval.decoding import answer, encode, ids_tensor, read_question
from kvcompile.eval.fidelity import next_token_metrics, summarize
from kvcompile.eval.synthetic import get_task, make_sample


@torch.no_grad()
def run(model, tok, recipes: list[str], budgets: list[float], tasks: list[str], n: int, length: int) -> list[dict]:
    """One row per (task, recipe, budget): mean score, KL mean, top-1 agreement, bytes held."""
    served = {r: kvcompile.apply(model, budget=1.0, recipe=r) for r in ["full", *recipes]}
    cells: dict[tuple, list] = {}
    for task in tasks:
        for index in tqdm(range(n), desc=task):
            sample = make_sample(task, tok, length, seed=0, index=index)
            context, question = (encode(tok, part) for part in sample.prompt(tok))
            max_new, reference = get_task(task).max_new_tokens, {}
            for recipe in ["full", *recipes]:
                for budget in [1.0] if recipe == "full" else budgets:
                    cm = kvcompile.apply(served[recipe], budget=budget, recipe=recipe)
                    cm.prefill(ids_tensor(context, cm.device), logits="last")
                    held, probe = cm.cache_stats()["bytes_held"], cm.fork()  # held: after compressing the context
                    tokens = answer(cm, tok, read_question(cm, question), max_new)
                    ids = reference.setdefault("ids", question + tokens)
                    logits = probe.prefill(ids_tensor(ids, probe.device), compress=False)[0, :-1]
                    m = summarize([next_token_metrics(reference.setdefault("logits", logits), logits,
                                                      torch.tensor(ids[1:]))])
                    cells.setdefault((task, recipe, budget), []).append(
                        {"score": sample.score(tok.decode(tokens, skip_special_tokens=True)), "kl": m["kl_mean"],
                         "top1": m["top1"], "bytes_held": held})
    return [{"task": t, "recipe": r, "budget": b, "n": len(v),
             **{k: sum(x[k] for x in v) / len(v) for k in ("score", "kl", "top1", "bytes_held")}}
            for (t, r, b), v in cells.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipes", default="h2o,sparse-finetune-h2o")
    parser.add_argument("--budgets", default="1.0,0.25,0.1,0.05")
    parser.add_argument("--tasks", default="niah_single_1,passkey")
    parser.add_argument("--n-samples", type=int, default=3)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--out", help="path stem of what is written (default "
                        "bench/results/adapter_quality/adapter_quality)")
    args = parser.parse_args()
    out = Results("adapter_quality", args.out)
    model, tok = kvcompile.load_model(args.model)
    rows = run(model, tok, args.recipes.split(","), [float(b) for b in args.budgets.split(",")],
               args.tasks.split(","), args.n_samples, args.length)
    out.json({"config": vars(args) | {"out": str(out.stem)}, "rows": rows})
    lines = [f"{args.model} @ {args.length} tokens, {args.n_samples} samples per task, seed 0, query-agnostic; each "
             "cell its own prefill; KL against the plain model's full cache.", "",
             "| task | recipe | budget | n | score | KL mean | top-1 | KiB held |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['recipe']} | {r['budget']:g} | {r['n']} | {r['score']:.2f} | {r['kl']:.3f} | "
              f"{r['top1']:.2f} | {r['bytes_held'] / 1024:.0f} |" for r in rows]
    out.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
