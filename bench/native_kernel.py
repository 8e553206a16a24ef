"""The native CPU decode kernel alone (``kernels.cpu_native.attend``), ns per token row for each page format, and
optionally against another build of it (``--against``: a ``cpu_decode-*.so`` built from other sources, e.g. the
last commit's), the two builds taking turns on the same pools.

One layer of SmolLM2's decode shape: batch 4, 3 KV heads of 64 with 3 query rows each, ``--tokens`` per head on
pages of 16, packed (each head's pages consecutive) or with ``--shuffle`` (pages anywhere in the pool).

    python bench/native_kernel.py --tokens 8192 [--shuffle] [--against /tmp/old.so]

Prints the table and writes it (``bench/results/native_kernel/native_kernel.{md,json}``, or ``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from record import Results

from kvcompile.kernels import cpu_native
from kvcompile.kernels.formats import FORMATS, encode_pool

B, HKV, G, D, P = 4, 3, 3, 64, 16


def pools(name: str, k, v):
    if name == "float32":
        return (None, k, None), (None, v, None)
    f = FORMATS[name]
    return (f.key, *encode_pool(f.key, k)), (f.value, *encode_pool(f.value, v))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--formats", default="float32,int8,int4,int2,fp8,kivi2")
    p.add_argument("--against", help="another build of the library, timed in turn with this one")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", help="path stem of what is written (default bench/results/native_kernel/native_kernel)")
    args = p.parse_args()
    results = Results("native_kernel", args.out)
    g = torch.Generator().manual_seed(0)
    n_pages = B * HKV * args.tokens // P
    order = 1 + (torch.randperm(n_pages, generator=g) if args.shuffle else torch.arange(n_pages))
    table = order.view(B, HKV, -1).to(torch.int32)
    lengths = torch.full((B, HKV), args.tokens, dtype=torch.int32)
    q = torch.randn(B, HKV, G, D, generator=g) * D**-0.5
    k, v = torch.randn(n_pages + 1, P, D, generator=g), torch.randn(n_pages + 1, P, D, generator=g)
    builds = {"this": cpu_native.library()}
    if args.against:
        builds["against"] = ctypes.CDLL(args.against)
        builds["against"].pool_attend.restype = None
    library, rows = cpu_native.library, B * HKV * args.tokens
    lines = [f"{args.tokens} tokens a head, {'shuffled' if args.shuffle else 'packed'} pages, "
             f"{torch.get_num_threads()} threads, median of {args.rounds} rounds of {args.calls} calls: ns per row", "",
             "| format | " + " | ".join(builds) + (" | this / against | max difference |" if args.against else " |"),
             "|---|" + "---|" * (len(builds) + 2 * bool(args.against))]
    print("\n".join(lines), flush=True)
    measured = []
    try:
        for name in args.formats.split(","):
            keys, values = pools(name, k, v)
            times, outs = {b: [] for b in builds}, {}
            for _ in range(args.rounds):
                for b, lib in builds.items():
                    cpu_native.library = lambda lib=lib: lib
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        outs[b] = cpu_native.attend(q, keys, values, table, lengths)[0]
                    times[b].append((time.perf_counter() - t0) / args.calls / rows * 1e9)
            ns = {b: statistics.median(t) for b, t in times.items()}
            cells = [f"{ns[b]:.1f}" for b in builds]
            measured.append({"format": name, "ns_per_row": ns})
            if args.against:
                differ = float((outs["this"] - outs["against"]).abs().max())
                cells += [f"{ns['this'] / ns['against']:.2f}", f"{differ:.1e}"]
                measured[-1]["max_difference"] = differ
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    finally:
        cpu_native.library = library
    results.json({"args": vars(args), "threads": torch.get_num_threads(), "rows": measured})
    results.markdown("\n".join(lines))


if __name__ == "__main__":
    main()
