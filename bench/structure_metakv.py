"""MetaKV (``kvcompile.metakv``) on SmolLM2: a training sweep of recipes x budgets over prompts of several lengths
into a results store, predictors fitted on 70% of the prompts, and on the other 30% the constrained success rate
(answer correct, and the cell's measured latency and KV bytes within the limits) of MetaKV's per-prompt choice
against the best static configuration (the one with the best rate on the training prompts) and the oracle.

    python bench/structure_metakv.py --samples 8 --lengths 512,1024,1536

Writes ``bench/results/structure_metakv/structure_metakv.{json,md}``, the predictors
``structure_metakv_predictors.json`` and the sweep's rows ``structure_metakv.sqlite`` (a rerun resumes it: stored
cells are not run again).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from record import Results

import kvcompile
from kvcompile.eval import sweep
from kvcompile.eval.decoding import encode
from kvcompile.eval.store import Store
from kvcompile.eval.synthetic import make_sample
from kvcompile.metakv import MetaKV, prompt_features

MODEL = "smollm2-135m"


def training_rows(store_rows: list[dict], tok, seed: int, lengths, recipes) -> dict:
    """{prompt: [row per configuration]} from the store's per-sample rows of these ``lengths`` and ``recipes``
    (and the full cache), with each prompt's features."""
    prompts: dict = {}
    for r in store_rows:
        wanted = r["length"] in lengths and r["recipe"] in {"full", *recipes} and r["seed"] == seed
        if r["error"] is not None or r["model"] != MODEL or not wanted:
            continue
        key = (r["task"], r["length"], r["sample"])
        if key not in prompts:
            sample = make_sample(r["task"], tok, r["length"], seed=seed, index=r["sample"])
            context, question = sample.prompt(tok)
            ids = encode(tok, context) + encode(tok, question)
            prompts[key] = {"features": prompt_features(context + question, len(ids), ids), "rows": []}
        prompts[key]["rows"].append({"config": f"{r['recipe']}/{float(r['budget']):g}",
                                     "latency_ms": 1000 * r["wall_s"], "memory": r["bytes_held"] / 2**20,
                                     "correct": float(r["score"] >= 1.0)})
    return prompts


def flat(prompts: dict, keys) -> list[dict]:
    return [{**row, "features": prompts[k]["features"]} for k in keys for row in prompts[k]["rows"]]


def success(row: dict, max_latency_ms: float, max_memory: float) -> bool:
    return bool(row["correct"]) and row["latency_ms"] <= max_latency_ms and row["memory"] <= max_memory


def auroc(p: list[float], y: list[float]) -> float:
    pos, neg = [a for a, b in zip(p, y) if b], [a for a, b in zip(p, y) if not b]
    if not pos or not neg:
        return float("nan")
    return sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))


def evaluate(meta: MetaKV, prompts: dict, train, test, limits) -> tuple[list[dict], dict]:
    """Constrained success per limit pair (MetaKV, best static, oracle) and the predictors' held-out error."""
    table = []
    configs = sorted({r["config"] for k in train for r in prompts[k]["rows"]})
    for max_latency_ms, max_memory in limits:
        def rate(keys, pick):
            hits = [success(next(r for r in prompts[k]["rows"] if r["config"] == pick(k)), max_latency_ms, max_memory)
                    for k in keys]
            return sum(hits) / len(hits)
        static = max(configs, key=lambda c: rate(train, lambda k: c))
        chosen = {k: meta.choose(prompts[k]["features"], max_latency_ms, max_memory) for k in test}
        oracle = sum(any(success(r, max_latency_ms, max_memory) for r in prompts[k]["rows"]) for k in test) / len(test)
        table.append({"max_latency_ms": max_latency_ms, "max_memory_mib": max_memory, "best_static": static,
                      "static_success": rate(test, lambda k: static), "metakv_success": rate(test, chosen.get),
                      "oracle_success": oracle,
                      "metakv_choices": {c: list(chosen.values()).count(c) for c in sorted(set(chosen.values()))}})
    errors = {"latency_mape": [], "memory_mape": [], "p": [], "y": []}
    for k in test:
        pred = meta.predict(prompts[k]["features"])
        for r in prompts[k]["rows"]:
            p = pred[r["config"]]
            errors["latency_mape"].append(abs(p["latency_ms"] - r["latency_ms"]) / max(r["latency_ms"], 1e-9))
            errors["memory_mape"].append(abs(p["memory"] - r["memory"]) / max(r["memory"], 1e-9))
            errors["p"].append(p["p_correct"])
            errors["y"].append(r["correct"])
    n = len(errors["p"])
    summary = {"latency_mape": sum(errors["latency_mape"]) / n, "memory_mape": sum(errors["memory_mape"]) / n,
               "correct_auroc": auroc(errors["p"], errors["y"]),
               "correct_brier": sum((p - y) ** 2 for p, y in zip(errors["p"], errors["y"])) / n, "test_rows": n}
    return table, summary


def markdown(result: dict) -> str:
    cfg, err = result["config"], result["predictor_error"]
    lines = [f"# MetaKV on {MODEL}: per-prompt configuration under latency and memory limits", "",
             f"`{cfg['command']}` ({cfg['sweep_s']:.0f} s sweep, {cfg['fit_s']:.2f} s fit). Configurations: "
             f"{', '.join(cfg['configs'])}. Prompts: {cfg['prompts']} ({', '.join(cfg['tasks'])} at lengths "
             f"{cfg['lengths']}), {cfg['train']} to fit, {cfg['test']} held out. Latency: the cell's compress + "
             "answer time after a shared prefill, on 2 shared CPU cores (noisy); memory: KV bytes held (MiB). "
             "Success: the answer is correct and the measured latency and memory are within the limits.", "",
             "| max latency (ms) | max KV (MiB) | best static (on train) | static success | MetaKV success | "
             "gain | oracle | MetaKV's choices |", "|---|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        choices = ", ".join(f"{c} x{n}" for c, n in r["metakv_choices"].items())
        lines.append(f"| {r['max_latency_ms']:.0f} | {r['max_memory_mib']:.2f} | {r['best_static']} | "
                     f"{r['static_success']:.3f} | {r['metakv_success']:.3f} | "
                     f"{r['metakv_success'] - r['static_success']:+.3f} | {r['oracle_success']:.3f} | {choices} |")
    mean = lambda k: sum(r[k] for r in result["table"]) / len(result["table"])  # noqa: E731
    lines += ["", f"Mean over the {len(result['table'])} limit pairs: best static {mean('static_success'):.3f}, "
              f"MetaKV {mean('metakv_success'):.3f} ({mean('metakv_success') - mean('static_success'):+.3f}), "
              f"oracle {mean('oracle_success'):.3f}."]
    lines += ["", f"Predictors' held-out error ({err['test_rows']} prompt x configuration rows): latency MAPE "
              f"{err['latency_mape']:.3f}, memory MAPE {err['memory_mape']:.3f}, correctness AUROC "
              f"{err['correct_auroc']:.3f}, Brier {err['correct_brier']:.3f}.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--lengths", default="512,1024,1536")
    ap.add_argument("--recipes", default="snapkv,streamingllm,knorm")
    ap.add_argument("--budgets", default="0.5,0.25,0.1")
    ap.add_argument("--tasks", default="niah_single_1,passkey")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="path stem of what is written (default "
                    "bench/results/structure_metakv/structure_metakv)")
    args = ap.parse_args()
    out = Results("structure_metakv", args.out)
    model, tok = kvcompile.load_model(MODEL)
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    lengths, tasks = [int(n) for n in args.lengths.split(",")], args.tasks.split(",")
    t0 = time.perf_counter()
    with Store(out.path(".sqlite")) as store:
        for n in lengths:
            sweep.run(cm, tok, args.recipes.split(","), [sweep.parse_budget(b) for b in args.budgets.split(",")],
                      tasks, n_samples=args.samples, length=n, seed=args.seed, store=store, model=MODEL)
        rows = store.rows()
    sweep_s = time.perf_counter() - t0
    prompts = training_rows(rows, tok, args.seed, lengths, args.recipes.split(","))
    complete = 1 + len(args.recipes.split(",")) * len(args.budgets.split(","))
    prompts = {k: p for k, p in prompts.items() if len(p["rows"]) == complete}  # every configuration measured
    keys = sorted(prompts)
    random.Random(args.seed).shuffle(keys)
    cut = int(0.7 * len(keys))
    train, test = keys[:cut], keys[cut:]
    t0 = time.perf_counter()
    meta = MetaKV.fit(flat(prompts, train))
    fit_s = time.perf_counter() - t0
    meta.save(out.path("_predictors.json"))
    full_mib = max(r["memory"] for k in keys for r in prompts[k]["rows"])
    latencies = sorted(r["latency_ms"] for k in train for r in prompts[k]["rows"])
    limits = [(latencies[int(q * (len(latencies) - 1))], f * full_mib) for q in (0.25, 0.5, 0.9) for f in (0.1, 0.3, 1)]
    table, error = evaluate(meta, prompts, train, test, limits)
    result = {"config": {"command": "python bench/structure_metakv.py " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if k != "out"), "sweep_s": sweep_s, "fit_s": fit_s,
                  "configs": sorted(meta.weights), "prompts": len(keys), "train": len(train), "test": len(test),
                  "tasks": tasks, "lengths": lengths},
              "table": table, "predictor_error": error}
    out.json(result)
    out.markdown(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
