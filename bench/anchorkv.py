"""Where AnchorKV's bytes go and what its rows keep (docs/guide.md, page formats), against the integer formats, on a
real model.

On prose windows of ``--lengths`` tokens, each cell prefills one window through ``kvcompile.apply`` (AnchorKV at
each ``--budgets``; ``full+int3`` and ``full+int2`` beside it) and reads every layer's keys and values back from the
cache: their error relative to the full cache's (||x' - x|| / ||x||, averaged over tokens, heads and layers), and
the share of the fp32 bytes held, split into rows, anchor tables and residual slots for AnchorKV. "anchors only"
is the budget that leaves no residual slot: each token is its nearest anchor scaled. Writes
``bench/results/anchorkv/anchorkv.{json,md}`` (``--out``).

    python bench/anchorkv.py --lengths 1024,4096 --budgets 0.25,0.125,0.1,0.0625
"""

from __future__ import annotations

import argparse
import time

import torch
from record import Results

import kvcompile
from kvcompile.anchoring import base_bytes
from kvcompile.eval.fidelity import calibration_windows


def _errors(cm, full) -> tuple[float, float]:
    """Mean relative error of the held keys and of the held values against ``full``'s, over every layer."""
    out = []
    for part in (0, 1):
        err = []
        for layer in range(cm.spec.num_layers):
            got, want = cm.cache.dense(layer), full.cache.dense(layer)
            S = int(want[3].sum(-1).max())
            x, y = got[part][:, :, :S].float(), want[part][:, :, :S].float()
            err.append(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-6))[want[3][:, :, :S]].mean())
        out.append(float(torch.stack(err).mean()))
    return out[0], out[1]


def _cell(model, ids, full, recipe: str, budget: float) -> dict:
    cm = kvcompile.apply(model, budget=budget, recipe=recipe)
    start = time.perf_counter()
    cm.prefill(ids)
    seconds = time.perf_counter() - start
    stats = cm.cache_stats()
    pool = stats["formats"][cm.recipe.format]
    k_err, v_err = _errors(cm, full)
    residual = int(cm.cache.fmt_residuals.nbytes)
    return {"recipe": recipe, "budget": budget, "held": stats["bytes_held"] / stats["bytes_full"],
            "rows": (pool["codes"] + pool["meta"]) / stats["bytes_full"],
            "anchors": (pool["tables"] - residual) / stats["bytes_full"], "residuals": residual / stats["bytes_full"],
            "key_error": k_err, "value_error": v_err, "prefill_s": seconds}


def markdown(rows: list[dict], config: dict) -> str:
    lines = [f"# AnchorKV's bytes and rows ({config['model']}, fp32, prose windows)", "",
             "Shares of the fp32 cache's bytes; errors relative to the full cache's keys and values (mean over tokens, "
             "heads and layers).", "",
             "| tokens | recipe | budget | held / full | rows | anchors | residuals | key error | value error | "
             "prefill s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['recipe']} | {r['label']} | {r['held']:.3f} | {r['rows']:.3f} | "
                     f"{r['anchors']:.3f} | {r['residuals']:.3f} | {r['key_error']:.3f} | {r['value_error']:.3f} | "
                     f"{r['prefill_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--budgets", default="0.25,0.125,0.1,0.0625")
    parser.add_argument("--out", default=None, help="path stem of what is written (default "
                        "bench/results/anchorkv/anchorkv)")
    args = parser.parse_args()
    out = Results("anchorkv", args.out)
    model, tokenizer = kvcompile.load_model(args.model)
    rows = []
    for length in map(int, args.lengths.split(",")):
        ids = calibration_windows(tokenizer, 0, 1, length)[1][0]
        full = kvcompile.apply(model, budget=1.0, recipe="full")
        full.prefill(ids)
        probe = kvcompile.apply(model, budget=1.0, recipe="anchorkv")
        held = torch.full((probe.spec.num_layers, 1, probe.spec.num_kv_heads), length)
        probe.cache.setup(1)
        floor = float(base_bytes(probe.cache, held)) / (length * probe.spec.num_layers * probe.spec.num_kv_heads
                                                         * probe.cache.token_bytes)
        cells = [("anchorkv", b, str(b)) for b in map(float, args.budgets.split(","))]
        cells += [("anchorkv", floor + 1e-4, "anchors only"), ("full+int3", 1.0, "1 (all int3)"),
                  ("full+int2", 1.0, "1 (all int2)")]
        for recipe, budget, label in cells:
            if budget < floor:
                continue
            row = _cell(model, ids, full, recipe, budget) | {"tokens": length, "label": label}
            rows.append(row)
            print(row, flush=True)
    config = {"model": args.model, "lengths": args.lengths, "budgets": args.budgets}
    out.json({"config": config, "rows": rows})
    out.markdown(markdown(rows, config))
    print(markdown(rows, config))


if __name__ == "__main__":
    main()
