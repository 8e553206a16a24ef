"""Prefill seconds against transformers, and where kvcompile's extra time goes, in one run.

For each context and batch, transformers' own prefill (sdpa, a fresh ``DynamicCache``, ``logits_to_keep=1``) and
kvcompile's (budget 1.0, ``prefill(..., logits="last")`` from an empty cache, uncompressed) run in turn for
``--rounds`` rounds on the same token ids; each is reported as its median round, with the ratio HF / kv (above 1:
kvcompile is faster). ``--profile`` then profiles one prefill of each at the first context and batch and lists the
operators by self time next to each other, so what kvcompile adds (page writes, the observation ring, reading
pages back) is a row of its own.

    python bench/prefill.py --contexts 1024,2048,4096,8192 --batches 1,4 --rounds 3 --profile

``--memory`` measures instead each side's prefill peak memory: one fresh process per side and cell (the model
loaded, kvcompile's programs applied, nothing run yet), whose resident high-water mark is reset right before the
prefill and read right after it (Linux ``/proc/self/clear_refs``); the peak above the resident memory before is the
prefill's (activations, the cache it fills, temporaries). Writes ``--out`` + ``_memory.{json,md}``.

Results go to ``bench/results/prefill/`` (``prefill.*``, ``prefill_memory.*``) unless ``--out`` says otherwise.

    python bench/prefill.py --memory --contexts 1024,4096 --batches 1,4
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from record import Results

import kvcompile


def prefills(model, cm, ids):
    """The two prefills being compared, each a no-argument call."""

    def hf():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    def kv():
        cm.reset()
        cm.prefill(ids, compress=False, logits="last")

    return {"hf": hf, "kv": kv}


def median_seconds(calls: dict, rounds: int) -> dict:
    """Each call's median over ``rounds``, the calls interleaved round by round (after one untimed warm-up each)."""
    times = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
        for _ in range(rounds):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def profile(calls: dict, rows: int = 12) -> dict:
    """Self CPU seconds per operator for one run of each call: {call: {operator: seconds}}, largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {}
    with torch.no_grad():
        for name, call in calls.items():
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                call()
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            out[name] = {e.key: e.self_cpu_time_total / 1e6 for e in ops[:rows]}
    return out


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB (VmRSS: resident now; VmHWM: resident high-water mark)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def one_peak(model_name: str, side: str, ctx: int, batch: int) -> float:
    """MiB resident at the peak of one ``side`` prefill above what this (fresh) process held before it."""
    model, _ = kvcompile.load_model(model_name)
    cm = kvcompile.apply(model, budget=1.0, recipe="full") if side == "kv" else None
    ids = torch.randint(100, 40000, (batch, ctx), generator=torch.Generator().manual_seed(ctx + batch))
    call = prefills(model, cm, ids)[side]
    with torch.no_grad():  # fault the (memory-mapped) weights in first: they are not the prefill's memory
        prefills(model, cm, ids[:1, :8])[side]()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory back to the system: resident = live now
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the resident size now
    before = _status_kib("VmRSS")
    with torch.no_grad():
        call()
    return (_status_kib("VmHWM") - before) / 1024


def peaks(args) -> list[dict]:
    """Each side's prefill peak per cell, each in its own process (so no allocator cache carries over)."""
    rows = []
    for ctx in args.contexts:
        for batch in args.batches:
            row = {"context": ctx, "batch": batch}
            for side in ("hf", "kv"):
                cmd = [sys.executable, __file__, "--one-peak", side, "--model", args.model, "--contexts", str(ctx),
                       "--batches", str(batch)]
                row[f"{side}_peak_mib"] = float(subprocess.run(cmd, check=True, capture_output=True,
                                                               text=True).stdout.split()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows, measure: str = "s", label: str = "prefill s") -> str:
    """Each cell's ``hf_<measure>`` and ``kv_<measure>`` and their ratio HF / kv (above 1: kvcompile is faster, or
    peaks lower)."""
    lines = [f"| context | batch | HF {label} | kv {label} | HF / kv |", "|---|---|---|---|---|"]
    for r in rows:
        hf, kv = r[f"hf_{measure}"], r[f"kv_{measure}"]
        lines.append(f"| {r['context']} | {r['batch']} | {hf:.2f} | {kv:.2f} | {hf / kv:.2f} |")
    return "\n".join(lines)


def profile_table(ops: dict) -> str:
    names = list(dict.fromkeys([*ops["hf"], *ops["kv"]]))
    lines = ["| operator | HF self s | kv self s |", "|---|---|---|"]
    for n in sorted(names, key=lambda n: -max(ops["hf"].get(n, 0), ops["kv"].get(n, 0))):
        cell = lambda side: f"{ops[side][n]:.3f}" if n in ops[side] else "-"  # noqa: E731
        lines.append(f"| {n} | {cell('hf')} | {cell('kv')} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also profile one prefill of each at the first cell")
    p.add_argument("--memory", action="store_true", help="measure each prefill's peak memory instead of its time")
    p.add_argument("--one-peak", choices=["hf", "kv"], help=argparse.SUPPRESS)  # one measurement (``peaks``)
    p.add_argument("--out", help="path stem of what is written (default bench/results/prefill/prefill)")
    args = p.parse_args()
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "args": vars(args)}
    if args.one_peak:  # a child of --memory: one measurement, printed for the parent, which writes the results
        print(one_peak(args.model, args.one_peak, args.contexts[0], args.batches[0]))
        return
    if args.memory:
        out = Results("prefill", args.out and args.out + "_memory", name="prefill_memory")
        rows = peaks(args)
        out.json({"meta": meta, "rows": rows})
        text = table(rows, "peak_mib", "prefill peak MiB")
        out.markdown(f"torch threads: {meta['threads']}\n\n" + text)
        print(text)
        return
    out = Results("prefill", args.out)
    model, _ = kvcompile.load_model(args.model)
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    rows = []
    for ctx in args.contexts:
        for batch in args.batches:
            ids = torch.randint(100, 40000, (batch, ctx), generator=torch.Generator().manual_seed(ctx + batch))
            seconds = median_seconds(prefills(model, cm, ids), args.rounds)
            rows.append({"context": ctx, "batch": batch, "hf_s": seconds["hf"], "kv_s": seconds["kv"]})
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows)
    ops = None
    if args.profile:
        ids = torch.randint(100, 40000, (args.batches[0], args.contexts[0]), generator=torch.Generator().manual_seed(0))
        ops = profile(prefills(model, cm, ids))
        text += (f"\n\nOperators by self time, one prefill of {args.contexts[0]} tokens x batch {args.batches[0]}:\n\n"
                 + profile_table(ops))
    out.json({"meta": meta, "rows": rows, "profile": ops})
    out.markdown(f"torch threads: {meta['threads']}\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
