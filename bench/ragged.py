"""Ragged decode at equal bytes: a per-head allocator (Ada-KV) against the uniform recipe with the same scorer.

A per-head allocator leaves heads of different lengths. The eager CPU decode reads each head in place only as far
as it holds (``kernels.cpu_native``); the PyTorch reference (``KVCOMPILE_DECODE_BACKEND=reference``) reads them
class by class (``kernels.ragged.page_classes``: heads grouped by pages owned, each class gathered only up to its
longest head). This script times, in one run and taking turns, ``snapkv`` (uniform) and ``adakv-snapkv`` under
both, and prints the pages each path reads per layer (held, as classes read them, as one gather would).

    python bench/ragged.py --contexts 4096 --batches 1,4 --budget 0.25

Writes ``bench/results/ragged/ragged.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from decode import interleaved, kv_steps
from record import Results

import kvcompile
from kvcompile.kernels import ragged
from kvcompile.model import RESERVE_AHEAD


def pages_read(cm) -> dict:
    """Head-pages a decode step reads, summed over layers: held, by length class, with one gather per layer."""
    P = cm.cache.page_size
    out = {"held": 0, "classes": 0, "one_gather": 0}
    for lengths, table in zip(cm.cache.held(), cm.cache.page_table):  # [B, Hkv] and [B, Hkv, W] per layer
        pages = (lengths.reshape(-1).long() + P - 1) // P
        out["held"] += int(pages.sum())
        out["one_gather"] += int(pages.max()) * pages.numel()
        out["classes"] += sum(width * len(heads) for heads, width in ragged.page_classes(table))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[4096])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    out = Results("ragged")
    model, _ = kvcompile.load_model("smollm2-135m")
    base = kvcompile.apply(model, budget=1.0, recipe="snapkv")
    room = max(RESERVE_AHEAD, args.rounds * args.steps * 2 + 1)
    rows = []
    for ctx in args.contexts:
        for batch in args.batches:
            ids = torch.randint(100, 40000, (batch, ctx), generator=torch.Generator().manual_seed(ctx + batch))
            base.reset()
            token = base.prefill(ids, compress=False, logits="last")[:, -1:].argmax(-1)
            row, steps_of, reserve = {"context": ctx, "batch": batch, "budget": args.budget}, {}, {}
            for name, recipe in (("uniform", "snapkv"), ("adakv", "adakv-snapkv")):
                cm = base.fork(recipe, args.budget)
                cm.compress()
                row[f"{name}_bytes_held"] = cm.cache_stats()["bytes_held"]
                row[f"{name}_pages"] = pages_read(cm)
                steps_of[name], reserve[name] = kv_steps(cm, token, room)
                steps_of[f"{name}_reference"], reserve[f"{name}_reference"] = kv_steps(cm, token, room, "reference")
            for name, times in interleaved(steps_of, args.rounds, args.steps).items():
                row[f"{name}_decode_ms"] = statistics.median([(t + reserve[name]) * 1e3 for t in times])
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "args": vars(args)}
    out.json({"meta": meta, "rows": rows})
    head = ["context", "batch", "budget", "uniform ms", "adakv ms", "adakv / uniform", "uniform ms (PyTorch)",
            "adakv ms (PyTorch, classes)", "adakv / uniform (PyTorch)", "head-pages held (adakv)", "read by classes",
            "read by one gather"]
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} rounds of "
             f"{args.steps} steps, variants taking turns; native decode unless marked PyTorch", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pg = r["adakv_pages"]
        ms = {k: r[f"{k}_decode_ms"] for k in ("uniform", "adakv", "uniform_reference", "adakv_reference")}
        cells = [r["context"], r["batch"], r["budget"], f"{ms['uniform']:.1f}", f"{ms['adakv']:.1f}",
                 f"{ms['adakv'] / ms['uniform']:.2f}", f"{ms['uniform_reference']:.1f}",
                 f"{ms['adakv_reference']:.1f}", f"{ms['adakv_reference'] / ms['uniform_reference']:.2f}",
                 pg["held"], pg["classes"], pg["one_gather"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    out.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
