"""What the cache allocates, against its budget: after prefill compression (every recipe) and over long decode-time
capped generation (every decode-time recipe), on SmolLM2-135M, batch 1.

    python bench/memory.py prefill     # every recipe at 0.25, 2,000 tokens: bench/results/memory/memory_prefill.*
    python bench/memory.py decode      # 300-token prompt, 1,000 decode steps: bench/results/memory/memory_decode.*

``--before`` adds the same measurement of an earlier commit (``bench/results/memory/memory_before_*.json``: commit
4aac37c, before the cache owned its state, measured by walking the cache object's tensors) as columns of the table.
Memory, not time: one thread, any load on the machine is fine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from record import Results

import kvcompile

FILLER = [  # the same deterministic context as the "before" measurement
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "A lighthouse keeper counted the ships that passed each night and wrote their names in a book.",
    "Rain fell on the old market square while the merchants packed their stalls and went home.",
    "In the library, a student read about the history of bridges, canals and the engineers who built them.",
    "The baker woke before dawn to knead the dough, light the oven and sweep the floor of the shop.",
    "Mountains to the north were covered in snow, and the valley below was green with early spring grass.",
    "An old clock in the hallway struck seven, and the family gathered around the table for supper.",
]


def context(tok, n: int) -> torch.Tensor:
    ids = tok(" ".join(FILLER[i % len(FILLER)] for i in range(400)), return_tensors="pt")["input_ids"]
    return ids[:, :n].contiguous()


def prefill(base, tok, args) -> list[dict]:
    ids = context(tok, args.context)
    rows = []
    for recipe in kvcompile.recipes().values():
        row = {"recipe": recipe.tag}
        try:
            cm = kvcompile.apply(base, budget=args.budget, recipe=recipe)
            cm.prefill(ids, logits="last")
            s = cm.cache_stats()
            tables = s["bytes"]["tables"]
            row |= {k: s[k] for k in ("bytes_held", "budget_bytes", "bytes_full", "bytes_allocated")}
            row |= {"bytes": s["bytes"], "ring_queries": s["ring_queries"], "decode_ring": cm.decode_window,
                    "alloc_over_budget": s["bytes_allocated"] / s["budget_bytes"],
                    "alloc_less_tables_ring_over_budget":
                        (s["bytes_allocated"] - tables - s["bytes"]["ring"]) / s["budget_bytes"]}
        except ValueError as e:
            row["error"] = str(e)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode(base, tok, args) -> list[dict]:
    ids = context(tok, 300)
    rows = []
    for recipe in kvcompile.recipes().values():
        if recipe.decode is None:
            continue
        for budget in (256, 0.25):
            row, t0 = {"recipe": recipe.tag, "budget": budget}, time.time()
            try:
                cm = kvcompile.apply(base, budget=budget, recipe=recipe)
                token = cm.prefill(ids, logits="last")[:, -1].argmax(-1, keepdim=True)
                worst = {"pool_over_cap": 0.0, "held_over_cap": 0.0, "budget_below_held": False}
                for step in range(args.steps):
                    token = cm.decode(token)[:, -1].argmax(-1, keepdim=True)
                    if step % 10 == 0 or step == args.steps - 1:
                        s = cm.cache_stats()
                        pool = s["bytes"]["payload"] + s["bytes"]["free_pages"] + s["bytes"]["positions"]
                        worst["pool_over_cap"] = max(worst["pool_over_cap"], pool / s["budget_bytes"])
                        worst["held_over_cap"] = max(worst["held_over_cap"], s["bytes_held"] / s["budget_bytes"])
                        worst["budget_below_held"] |= s["budget_bytes"] < s["bytes_held"]
                row |= worst | {"final_pool": pool, "final_cap": s["budget_bytes"], "final_bytes": s["bytes"],
                                "decode_schedule": s["decode_schedule"], "seconds": time.time() - t0}
            except ValueError as e:
                row["error"] = str(e)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def prefill_table(rows, before) -> str:
    old = {r["recipe"].split("@")[0]: r for r in before or []}
    head = ["recipe", "budget B", "held B", "allocated B", "ring B", "allocated / budget",
            "(allocated - tables - ring) / budget"]
    head += ["before: allocated B", "before: ring B", "before: allocated / budget"] if before else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['error']} |")
            continue
        cells = [r["recipe"], f"{r['budget_bytes']:,}", f"{r['bytes_held']:,}", f"{r['bytes_allocated']:,}",
                 f"{r['bytes']['ring']:,}", f"{r['alloc_over_budget']:.3f}",
                 f"{r['alloc_less_tables_ring_over_budget']:.3f}"]
        if before:
            b = old.get(r["recipe"].split("@")[0], {})
            cells += ([f"{b['allocated']:,}", f"{b['obs_ring_bytes']:,}", f"{b['alloc_over_budget']:.3f}"]
                      if "allocated" in b else ["-"] * 3)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(rows, before) -> str:
    old = {(r["recipe"].split("@")[0], r["budget"]): r for r in before or []}
    head = ["recipe", "budget", "max pool / cap", "max held / cap", "budget below held", "final pool B", "final cap B"]
    head += ["before: max pool / cap", "before: budget below held"] if before else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = old.get((r["recipe"].split("@")[0], r["budget"]), {})
        prev = ([f"{b['max_pool_over_cap']:.3f}", str(b["budget_below_held_any"])] if "max_pool_over_cap" in b
                else [b.get("error", "-")[:60], ""]) if before else []
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['budget']} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        cells = [r["recipe"], str(r["budget"]), f"{r['pool_over_cap']:.3f}", f"{r['held_over_cap']:.3f}",
                 str(r["budget_below_held"]), f"{r['final_pool']:,}", f"{r['final_cap']:,}"] + prev
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["prefill", "decode"])
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--before", default=None, help="JSON of the same part measured on an earlier commit")
    p.add_argument("--out", help="path stem of what is written (default bench/results/memory/memory_<part>)")
    args = p.parse_args()
    out = Results("memory", args.out, name=f"memory_{args.part}")
    torch.set_num_threads(1)
    model, tok = kvcompile.load_model("smollm2-135m")
    base = kvcompile.apply(model, budget=1.0, recipe="full")
    rows = (prefill if args.part == "prefill" else decode)(base, tok, args)
    before = None
    if args.before:
        before = json.loads(Path(args.before).read_text())["rows" if args.part == "prefill" else "runs"]
    table = (prefill_table if args.part == "prefill" else decode_table)(rows, before)
    out.json({"args": vars(args), "torch": torch.__version__, "rows": rows})
    out.markdown(table)
    print(table)


if __name__ == "__main__":
    main()
