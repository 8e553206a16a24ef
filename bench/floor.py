"""Decode against its bandwidth floor: every variant of ``bench/decode.py`` as a multiple of the time it would take
to read its bytes once at this machine's measured memory bandwidth.

A decode step has to read every weight once and every K/V byte it attends over, so
floor = (weight bytes + KV bytes read) / read bandwidth. Read bandwidth is measured here, before the decode runs,
as the best of several ``sum`` passes over a tensor far larger than the caches (``record.bandwidth``, the figure
every result's record carries; reported with the copy bandwidth, read + write bytes, for reference). KV bytes
read: the bytes held (kvcompile) or the full cache (transformers).

    python bench/floor.py --contexts 4096 --batches 1,4 --budgets 0.25 --compiled

Writes ``bench/results/floor/floor.{json,md,png}`` (``--out``): the run's ratios against transformers
(``decode.table``) and every variant against its floor; ``--render`` writes them again from a run's JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from decode import plot, run, table
from record import Results, machine

import kvcompile


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipes", default="snapkv", help="comma-separated (bench/decode.py)")
    p.add_argument("--hf-static", action="store_true", help="also transformers' StaticCache + compiled decode")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[4096])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.25])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--flex", action="store_true", help="also eager programs over the flex_attention backend")
    p.add_argument("--out", help="path stem of what is written (default bench/results/floor/floor)")
    p.add_argument("--render", help="write the tables and plot again from this run's JSON, without running")
    args = p.parse_args()
    out = Results("floor", args.out)  # measures the bandwidth, once for the process
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        meta, rows = saved["meta"], saved["rows"]
    else:
        bw = machine()["bandwidth_gbs"]
        print(f"bandwidth: read {bw['read']:.1f} GB/s, copy {bw['copy']:.1f} GB/s", flush=True)
        rows = run(args)
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "bandwidth_gbs": bw,
                "args": vars(args)}
    model, _ = kvcompile.load_model(meta["args"]["model"])
    meta["weight_bytes"] = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
    cfg = model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    text = report(rows, meta, token_bytes)
    out.json({"meta": meta, "rows": rows})
    out.markdown(text)
    out.figure(plot(rows))
    print(text)


def key(recipe: str, budget: float, mode: str) -> str:
    """The row key of a kvcompile variant (``decode.run``): budget 1.0 is the full cache, whatever the recipe."""
    return ("kv_1.0" if budget == 1.0 else f"kv_{recipe}_{budget}") + ("" if mode == "eager" else f"_{mode}")


def grid(rows, args) -> str:
    """The grid as two tables: decode ms of every variant, then the ratios its targets are stated in (above 1 is
    kvcompile faster; the second recipe over the first at the same bytes; multiples of the floor; prefill)."""
    recipes, budgets = args["recipes"].split(","), args["budgets"]
    modes = ["eager"] + [m for m in ("compiled", "flex") if args.get(m)]
    cols = {"HF dynamic": "hf", "HF static+compile": "hf_static"}
    for b, m in ((b, m) for b in budgets for m in modes):
        cols.update({f"kv 1.0 {m}": key("", b, m)} if b == 1.0 else {f"{r} {b} {m}": key(r, b, m) for r in recipes})
    ratios = {"HF / kv 1.0 eager": ("hf", "kv_1.0"), "HF static / kv 1.0 compiled": ("hf_static", "kv_1.0_compiled"),
              "HF / kv 1.0 compiled": ("hf", "kv_1.0_compiled")}
    for b, m in ((b, m) for b in budgets if b != 1.0 for m in modes):
        ratios.update({f"{r} / {recipes[0]} {b} {m}": (key(r, b, m), key(recipes[0], b, m)) for r in recipes[1:]})
    fastest = modes[min(1, len(modes) - 1)]  # compiled where it ran
    floors = {f"{v} x floor": v for v in ["hf", "kv_1.0"] + [key(recipes[0], b, fastest) for b in budgets if b < 1]}

    def ms(r, k, what="decode_ms"):
        return r.get(f"{k}_{what}")

    def render(head, cells):
        out = ["| " + " | ".join(["context", "batch"] + head) + " |", "|" + "---|" * (len(head) + 2)]
        out += ["| " + " | ".join([str(r["context"]), str(r["batch"])] + cells(r)) + " |" for r in rows]
        return "\n".join(out)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    decode = render(list(cols), lambda r: [fmt(ms(r, k), ".0f") for k in cols.values()])
    head = list(ratios) + list(floors) + ["HF prefill s", "kv prefill s", "HF / kv prefill"]
    ratio = render(head, lambda r: [fmt(ms(r, a) / ms(r, b) if ms(r, a) and ms(r, b) else None, ".2f")
                                    for a, b in ratios.values()]
                   + [fmt(ms(r, v) / ms(r, v, "floor_ms") if ms(r, v) else None, ".2f") for v in floors.values()]
                   + [f"{r['hf_prefill_s']:.1f}", f"{r['kv_prefill_s']:.1f}",
                      f"{r['hf_prefill_s'] / r['kv_prefill_s']:.2f}"])
    return "Decode ms per token:\n\n" + decode + "\n\nRatios, multiples of the floor, prefill:\n\n" + ratio


def report(rows, meta, token_bytes) -> str:
    """The run's header (model, torch, threads, bandwidth), the grid's two tables (``grid``), every variant against
    its floor (adds ``<variant>_floor_ms`` to the rows), and ``decode.table``'s every column."""
    bw, weights, a = meta["bandwidth_gbs"], meta["weight_bytes"], meta["args"]
    lines = ["| context | batch | variant | decode ms | KV MiB read | floor ms | x floor |", "|---" * 7 + "|"]
    for r in rows:
        for v in [k[: -len("_decode_ms")] for k in r if k.endswith("_decode_ms")]:
            kv = r["context"] * r["batch"] * token_bytes if v.startswith("hf") else r.get(f"{v}_bytes_held",
                                                                                 r.get("kv_1.0_bytes_held"))
            floor = (weights + kv) / (bw["read"] * 1e9) * 1e3
            r[f"{v}_floor_ms"] = floor
            lines.append(f"| {r['context']} | {r['batch']} | {v} | {r[f'{v}_decode_ms']:.1f} | {kv / 2**20:.0f} | "
                         f"{floor:.1f} | {r[f'{v}_decode_ms'] / floor:.2f} |")
    header = (f"{a['model']}, torch {meta['torch']}, {meta['threads']} threads; read bandwidth {bw['read']:.1f} GB/s "
              f"(copy {bw['copy']:.1f} GB/s); weights {weights / 2**20:.0f} MiB; median of {a['rounds']} rounds of "
              f"{a['steps']} steps")
    return "\n\n".join([header, grid(rows, a), "Every variant against its floor:", "\n".join(lines),
                         "Every column:", table(rows)])


if __name__ == "__main__":
    main()
