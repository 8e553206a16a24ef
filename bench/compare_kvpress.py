"""kvcompile recipes against NVIDIA kvpress presses: same model, prompts, budgets; accuracy, KL, wall time, bytes held.

kvpress 0.5.5 needs transformers < 5.3 while kvcompile needs transformers 5.x, so the run has three steps in two
environments, joined by JSON files:

1. ``python bench/compare_kvpress.py prompts``  (kvcompile env): the task prompts as token ids, plus the
   full-budget answer each one is teacher-forced with for KL; also saves the model in HF format for step 2.
2. ``<kvpress venv>/bin/python bench/compare_kvpress.py kvpress``: every press x compression ratio on those
   prompts (compress the context, then read the question at its original positions and decode greedily, as
   kvpress's own pipeline does); bytes held = every tensor the cache keeps after compression plus the head masks
   AdaKV stores on the attention modules (kvpress masks evicted keys, it does not free them).
3. ``python bench/compare_kvpress.py kvcompile`` (kvcompile env): the matching recipes on the same prompts
   (``kvcompile.eval.sweep``), then the merged table ``bench/results/kvpress.{json,md}``.

Step 2 imports nothing from kvcompile, so it runs where kvcompile cannot be installed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PAIRS = [  # (kvpress press, kvcompile recipe); kvpress hyperparameters are set to the recipe's
    ("StreamingLLM", "streamingllm"),
    ("Knorm", "knorm"),
    ("SnapKV", "snapkv"),
    ("AdaKV(SnapKV)", "adakv-snapkv"),
    ("ExpectedAttention", "expected-attention"),
    ("TOVA", "tova"),
]
DEFAULT_DIR = Path("/tmp/kvc/kvpress")


def _prompts(args) -> None:
    import torch

    import kvcompile
    from kvcompile.eval.decoding import greedy, ids_tensor, read_question
    from kvcompile.eval.synthetic import get_task, make_sample

    model, tok = kvcompile.load_model(args.model)
    model.save_pretrained(args.dir / "model")
    tok.save_pretrained(args.dir / "model")
    config = json.loads((args.dir / "model" / "config.json").read_text())
    config.pop("quantization_config", None)  # a null entry left by the GGUF load breaks older transformers
    (args.dir / "model" / "config.json").write_text(json.dumps(config, indent=1))
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    rows = []
    for name in args.tasks.split(","):
        task = get_task(name)
        for index in range(args.n_samples):
            sample = make_sample(task, tok, args.length, seed=args.seed, index=index)
            context, question = (tok(t, add_special_tokens=False)["input_ids"] for t in sample.prompt(tok))
            cm.reset()
            with torch.no_grad():
                cm.prefill(ids_tensor(context, cm.device), logits="last")
            answer = greedy(cm, read_question(cm, question), task.max_new_tokens, eos_ids={tok.eos_token_id})
            rows.append({"task": name, "index": index, "context": context, "question": question,
                         "answers": list(sample.answers), "max_new_tokens": task.max_new_tokens,
                         "reference": question + answer})
    (args.dir / "prompts.json").write_text(json.dumps({"model": args.model, "length": args.length, "seed": args.seed,
                                                       "n_samples": args.n_samples, "tasks": args.tasks,
                                                       "prompts": rows}))


def _press(name: str, ratio: float):
    from kvpress import (AdaKVPress, ExpectedAttentionPress, KnormPress, SnapKVPress, StreamingLLMPress,
                         TOVAPress)

    return {
        "StreamingLLM": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "Knorm": lambda: KnormPress(compression_ratio=ratio),
        "SnapKV": lambda: SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7),
        "AdaKV(SnapKV)": lambda: AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)),
        "ExpectedAttention": lambda: ExpectedAttentionPress(compression_ratio=ratio),
        "TOVA": lambda: TOVAPress(compression_ratio=ratio),
    }[name]()


def _held_bytes(model, cache) -> int:
    """Bytes of every tensor the cache keeps, plus the eviction masks presses leave on attention modules."""
    import torch

    total = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    for module in model.modules():
        for key, value in vars(module).items():
            if "mask" in key and value is not None:
                tensors = value if isinstance(value, (tuple, list)) else (value,)
                total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return total


def _kvpress(args) -> None:
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    data = json.loads((args.dir / "prompts.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(args.dir / "model", attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(args.dir / "model")
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])

    def run(prompt, press):
        """(answer text, reference logits [T, V], bytes held, seconds) for one prompt under ``press`` (None: full)."""
        ctx = torch.tensor([prompt["context"]])
        n = ctx.shape[1]
        t0 = time.perf_counter()
        cache = DynamicCache()
        with torch.no_grad():
            if press is None:
                model.model(ctx, past_key_values=cache)
            else:
                with press(model):
                    model.model(ctx, past_key_values=cache)
            held = _held_bytes(model, cache)
            ref_cache = copy.deepcopy(cache)
            pos = torch.arange(n, n + len(prompt["question"]))[None]
            out = model(torch.tensor([prompt["question"]]), past_key_values=cache, position_ids=pos, logits_to_keep=1)
            tokens, p = [int(out.logits[0, -1].argmax())], int(pos[0, -1]) + 1
            while tokens[-1] not in eos and len(tokens) < prompt["max_new_tokens"]:
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[p]]))
                tokens.append(int(out.logits[0, -1].argmax()))
                p += 1
            seconds = time.perf_counter() - t0
            ref = prompt["reference"]
            pos = torch.arange(n, n + len(ref))[None]
            logits = model(torch.tensor([ref]), past_key_values=ref_cache, position_ids=pos).logits[0, :-1]
        return tok.decode(tokens, skip_special_tokens=True), logits, held, seconds

    results = []
    full = {}
    for i, prompt in enumerate(data["prompts"]):
        full[i] = run(prompt, None)
    cells = [("full", 1.0)] + [(name, b) for name, _ in PAIRS for b in args.budgets]
    for name, budget in cells:
        cell = {"press": name, "budget": budget, "scores": [], "kl": [], "top1": [], "held": [], "seconds": []}
        try:
            for i, prompt in enumerate(data["prompts"]):
                text, logits, held, seconds = full[i] if name == "full" else run(prompt, _press(name, 1 - budget))
                lp_full, lp = torch.log_softmax(full[i][1].float(), -1), torch.log_softmax(logits.float(), -1)
                cell["kl"] += (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0).tolist()
                cell["top1"] += (lp_full.argmax(-1) == lp.argmax(-1)).float().tolist()
                pred = text.lower()
                cell["scores"].append(sum(a.lower() in pred for a in prompt["answers"]) / len(prompt["answers"]))
                cell["held"].append(held)
                cell["seconds"].append(seconds)
        except Exception as e:  # noqa: BLE001 - a press that fails is a result
            cell["error"] = f"{type(e).__name__}: {e}"
        results.append(cell)
        print(name, budget, cell.get("error") or sum(cell["scores"]) / max(len(cell["scores"]), 1), flush=True)
    (args.dir / "kvpress_raw.json").write_text(json.dumps({"kvpress": _version("kvpress"),
                                                          "transformers": _version("transformers"),
                                                          "cells": results}))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _kvcompile(args) -> None:
    import kvcompile
    from kvcompile.eval import sweep

    data = json.loads((args.dir / "prompts.json").read_text())
    raw = json.loads((args.dir / "kvpress_raw.json").read_text())
    model, tok = kvcompile.load_model(data["model"])
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    known = kvcompile.recipes()
    recipes = [r for _, r in PAIRS if r in known]
    res = sweep.run(cm, tok, recipes, args.budgets, data["tasks"].split(","), n_samples=data["n_samples"],
                    length=data["length"], seed=data["seed"], kl=True)
    contexts = max(res["timing"]["contexts"], 1)
    prefill = res["timing"]["shared_prefill_s"] / contexts
    ours = {}
    for r in res["rows"]:  # aggregate over tasks, weighted by samples
        o = ours.setdefault((r["recipe"], float(r["budget"])), {"n": 0, "score": 0.0, "held": 0.0, "kl": 0.0,
                                                                  "top1": 0.0, "wall": 0.0, "error": r["error"]})
        if r["n"]:
            o["n"] += r["n"]
            for key, col in (("score", "score"), ("held", "bytes_held_mean"), ("kl", "kl_mean"), ("top1", "top1")):
                o[key] += r[col] * r["n"]
            o["wall"] += r["wall_s"]
    rows = []
    for press, recipe in [("full", "full")] + PAIRS:
        for budget in [1.0] if press == "full" else args.budgets:
            kp = next((c for c in raw["cells"] if c["press"] == press and c["budget"] == budget), None)
            o = ours.get((recipe, budget))
            row = {"method": press, "recipe": recipe, "budget": budget}
            if kp:
                row.update(kvpress_score=_mean(kp["scores"]), kvpress_kl=_mean(kp["kl"]), kvpress_top1=_mean(kp["top1"]),
                           kvpress_bytes_held=_mean(kp["held"]), kvpress_s_per_prompt=_mean(kp["seconds"]),
                           kvpress_error=kp.get("error"))
            if o and o["n"]:
                row.update(kvcompile_score=o["score"] / o["n"], kvcompile_kl=o["kl"] / o["n"],
                           kvcompile_top1=o["top1"] / o["n"], kvcompile_bytes_held=o["held"] / o["n"],
                           kvcompile_s_per_prompt=o["wall"] / o["n"] + prefill, kvcompile_error=o["error"])
            elif recipe not in known and press != "full":
                row["kvcompile_error"] = f"no recipe {recipe!r} in kvcompile.recipes()"
            rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": data["model"], "length": data["length"], "tasks": data["tasks"], "n_samples": data["n_samples"],
            "kvpress": raw["kvpress"], "transformers_for_kvpress": raw["transformers"],
            "kvcompile_shared_prefill_s": prefill}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"kvcompile vs kvpress {raw['kvpress']} on {data['model']}, {data['tasks']} @ {data['length']} tokens, "
             f"{data['n_samples']} samples per task, query-agnostic. Bytes: K/V held per prompt after compressing the "
             "context (kvpress: cache tensors + masks). Seconds: per prompt, prefill + compress + answer "
             "(kvcompile: its shared prefill counted once per cell).", "",
             "| method | budget | score kvc | score kvp | KL kvc | KL kvp | top-1 kvc | top-1 kvp | MiB kvc | MiB kvp "
             "| s kvc | s kvp | note |", "|" + "---|" * 13]
    for r in rows:
        mib = lambda v: None if v is None else v / 2**20  # noqa: E731
        note = "; ".join(e for e in (r.get("kvcompile_error"), r.get("kvpress_error")) if e)
        lines.append(
            f"| {r['method']} | {r['budget']:g} | {fmt(r.get('kvcompile_score'), '.2f')} | {fmt(r.get('kvpress_score'), '.2f')}"
            f" | {fmt(r.get('kvcompile_kl'), '.3f')} | {fmt(r.get('kvpress_kl'), '.3f')} | {fmt(r.get('kvcompile_top1'), '.2f')}"
            f" | {fmt(r.get('kvpress_top1'), '.2f')} | {fmt(mib(r.get('kvcompile_bytes_held')), '.2f')}"
            f" | {fmt(mib(r.get('kvpress_bytes_held')), '.2f')} | {fmt(r.get('kvcompile_s_per_prompt'), '.1f')}"
            f" | {fmt(r.get('kvpress_s_per_prompt'), '.1f')} | {note} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["prompts", "kvpress", "kvcompile"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the steps exchange files")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="niah_single_1,passkey")
    parser.add_argument("--n-samples", type=int, default=5)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="0.5,0.25,0.1")
    parser.add_argument("--out", default="bench/results/kvpress")
    args = parser.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.dir.mkdir(parents=True, exist_ok=True)
    {"prompts": _prompts, "kvpress": _kvpress, "kvcompile": _kvcompile}[args.step](args)


if __name__ == "__main__":
    main()
