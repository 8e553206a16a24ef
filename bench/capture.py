"""Capture time, cold and warm: ``kvcompile.apply`` in a fresh process with an empty capture cache, then in another
fresh process on the same model (the programs come from the cache), in one run on one machine.

    python bench/capture.py --model smollm2-135m --rounds 3 --out bench/results/capture/capture_cache

Each round uses a new, empty cache folder; the table gives the seconds of ``apply`` itself (the model is loaded
before the clock starts) and warm / cold. Writes ``bench/results/capture/capture.{json,md}`` by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from record import Results

_CHILD = """
import json, sys, time, torch
torch.set_num_threads({threads})
import kvcompile
model, _ = kvcompile.load_model({model!r})
start = time.perf_counter()
kvcompile.apply(model, budget=0.25, recipe="snapkv", capture_cache={cache!r})
print(json.dumps({{"seconds": time.perf_counter() - start}}))
"""


def apply_seconds(model: str, cache: str, threads: int) -> float:
    code = _CHILD.format(model=model, cache=cache, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", help="write OUT.md and OUT.json (default bench/results/capture/capture)")
    args = parser.parse_args(argv)
    out = Results("capture", args.out)
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            cold = apply_seconds(args.model, cache, args.threads)
            warm = apply_seconds(args.model, cache, args.threads)
            size = sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file())
        rows.append({"round": r, "cold_s": cold, "warm_s": warm, "ratio": warm / cold, "cache_bytes": size})
        print(f"round {r}: cold {cold:.2f} s, warm {warm:.2f} s, warm/cold {warm / cold:.3f}, "
              f"cache {size / 2**20:.2f} MiB")
    med = {k: statistics.median(row[k] for row in rows) for k in ("cold_s", "warm_s", "ratio")}
    lines = [
        f"# Capture time cold and warm ({args.model}, {args.threads} torch threads)", "",
        f"Command: `python bench/capture.py --model {args.model} --rounds {args.rounds}`", "",
        "| round | cold apply (s) | warm apply (s) | warm / cold | cache MiB |", "|---|---|---|---|---|",
        *[f"| {r['round']} | {r['cold_s']:.2f} | {r['warm_s']:.2f} | {r['ratio']:.3f} | "
          f"{r['cache_bytes'] / 2**20:.2f} |" for r in rows],
        f"| median | {med['cold_s']:.2f} | {med['warm_s']:.2f} | {med['ratio']:.3f} | |",
    ]
    print("\n".join(lines))
    out.markdown("\n".join(lines))
    out.json({"model": args.model, "threads": args.threads, "rounds": rows, "median": med})


if __name__ == "__main__":
    main()
