"""How much of the SnapKV family's gap to kvpress is SnapKV's smoothing: kvcompile's recipes that score with SnapKV
(as the scorer or a wrapper's base), run again with kvpress's average-pool smoothing (``smoothing="avg"``) instead
of the paper's max-pool, on the prompts of ``bench/compare_kvpress.py`` (after its ``prompts`` step, with its
kvpress step's cells and a ``save`` of kvcompile's rows in ``--keep``), against both sides' cells:

    python bench/snapkv_smoothing.py --dir D --budgets 0.25,0.1

For each press: score and next-token KL of kvcompile as shipped (max-pool), with the average pool, and kvpress;
and on how many prompts each kvcompile variant's score equals kvpress's. Rows of the variants are kept in
``D/smoothing.sqlite`` (a cut run resumes). Writes ``bench/results/snapkv_smoothing/snapkv_smoothing.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
from pathlib import Path

import compare_kvpress
from record import Results, default_stem

PRESSES = ["SnapKV", "AdaKV(SnapKV)", "CriticalKV(SnapKV)", "CriticalAdaKV(SnapKV)", "ChunkPress(SnapKV)",
           "ChunkKV(SnapKV)", "EntropyGatedChunkKV(SnapKV)", "KeyRerotation(SnapKV)", "Merging(SnapKV)",
           "PerLayerCompression(SnapKV)", "Composed(Knorm+SnapKV)"]


def averaged(recipe):
    """``recipe`` with SnapKV smoothing by an average pool, wherever SnapKV scores (its scorer or a base)."""
    args = dict(recipe.scorer_args)
    if recipe.scorer == "snapkv":
        args["smoothing"] = "avg"
    elif args.get("base") == "snapkv":
        args["base_args"] = {**args.get("base_args", {}), "smoothing": "avg"}
    else:
        raise ValueError(f"{recipe.name}: SnapKV does not score it")
    return dataclasses.replace(recipe, name=f"{recipe.name}~avg", scorer_args=args)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/kvc/kvpress"), help="compare_kvpress.py's --dir")
    p.add_argument("--keep", type=Path, default=default_stem("compare_kvpress", "kvpress_grid"),
                   help="where kvcompile's rows were saved (compare_kvpress.py save)")
    p.add_argument("--budgets", default="0.25,0.1")
    p.add_argument("--presses", default=",".join(PRESSES), help="comma-separated, from PRESSES (default: all)")
    p.add_argument("--out", help="path stem of what is written (default "
                   "bench/results/snapkv_smoothing/snapkv_smoothing)")
    args = p.parse_args()
    presses = args.presses.split(",")
    if set(presses) - set(PRESSES):
        p.error(f"not in the SnapKV family here: {sorted(set(presses) - set(PRESSES))}; known: {PRESSES}")
    out = Results("snapkv_smoothing", args.out)
    import torch

    import kvcompile
    from kvcompile.eval import sweep
    from kvcompile.eval.store import Store

    torch.set_num_threads(1)
    budgets = [float(b) for b in args.budgets.split(",")]
    data = json.loads((args.dir / "prompts.json").read_text())
    raw = json.loads((args.dir / "kvpress_raw.json").read_text())
    with gzip.open(args.keep / "kvcompile_rows.json.gz", "rt") as f:
        shipped = json.load(f)
    model, tok = kvcompile.load_model(data["model"])
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    names = dict(compare_kvpress.PAIRS)
    recipes = {press: compare_kvpress._recipe(names[press], model.config.num_hidden_layers, args.dir)
               for press in presses}
    variants = {press: averaged(r) for press, r in recipes.items()}
    with Store(args.dir / "smoothing.sqlite") as store:
        sweep.run(cm, tok, list(variants.values()), budgets, data["tasks"].split(","), n_samples=data["n_samples"],
                  length=data["length"], seed=data["seed"], kl=True, store=store, model=data["model"],
                  ledger_mass=False)
        rows = store.rows()
    table = []
    for press in presses:
        for budget in budgets:
            cell = next(c for c in raw["cells"] if c["press"] == press and c["budget"] == budget)
            ours = compare_kvpress.per_prompt(shipped, data, recipes[press].name, budget, recipes[press].version)
            avg = compare_kvpress.per_prompt(rows, data, variants[press].name, budget)
            row = {"press": press, "budget": budget, "score_kvpress": sum(cell["scores"]) / len(cell["scores"]),
                   "kl_kvpress": sum(cell["kl"]) / len(cell["kl"])}
            for key, got in (("max", ours), ("avg", avg)):
                n_tokens = sum(t for _, _, t in got.values())
                row[f"score_{key}"] = sum(s for s, _, _ in got.values()) / max(len(got), 1)
                row[f"kl_{key}"] = sum(k * t for _, k, t in got.values()) / max(n_tokens, 1)
                row[f"same_{key}"] = sum(got[i][0] == cell["scores"][i] for i in got)
                row[f"n_{key}"] = len(got)
            table.append(row)
            print(row, flush=True)
    out.json({"budgets": budgets, "prompts": len(data["prompts"]), "rows": table})
    lines = [f"# SnapKV's smoothing: kvcompile with the max-pool (as shipped) and with kvpress's average pool, against "
             f"kvpress ({len(data['prompts'])} prompts of {data['tasks']}, {data['length']} tokens)", "",
             "| press | budget | score max | score avg | score kvpress | KL max | KL avg | KL kvpress | "
             "prompts scored as kvpress: max | avg |", "|" + "---|" * 10]
    lines += [f"| {r['press']} | {r['budget']:g} | {r['score_max']:.2f} | {r['score_avg']:.2f} | "
              f"{r['score_kvpress']:.2f} | {r['kl_max']:.3f} | {r['kl_avg']:.3f} | {r['kl_kvpress']:.3f} | "
              f"{r['same_max']}/{r['n_max']} | {r['same_avg']}/{r['n_avg']} |" for r in table]
    out.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
