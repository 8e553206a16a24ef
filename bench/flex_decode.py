"""One layer's decode attention over the page pool, three ways, at SmolLM2's shapes (Hkv 3, G 3, D 64, pages of 16)
and a pool holding ``--layers`` layers: the reference (``kernels.reference.paged_attention``: one gather per layer,
or length classes for ragged heads, or in place for a packed layer), and ``flex_attention`` compiled by Inductor
(``kernels.flex``; its C++ template on CPU). Heads hold ``--tokens`` each (uniform) or 0.25x..1.75x of it (ragged),
on packed or shuffled pages. Checks each against the reference, then times them taking turns.

    python bench/flex_decode.py --batch 4 --tokens 1024 --rounds 5

Writes ``bench/results/flex_decode/flex_decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from record import Results
from torch.nn.attention.flex_attention import flex_attention

from kvcompile.kernels import reference
from kvcompile.kernels.flex import flex_paged_decode

Hkv, G, D, P = 3, 3, 64, 16


def layer_inputs(batch: int, tokens: int, layers: int, ragged: bool, packed: bool, seed: int = 0):
    """(q, q_pos, k_pages, v_pages, page_pos, page_table, lengths, first_page) for layer 0 of a pool of ``layers``."""
    g = torch.Generator().manual_seed(seed)
    heads = batch * Hkv
    scale = torch.linspace(0.25, 1.75, heads)[torch.randperm(heads, generator=g)] if ragged else torch.ones(heads)
    lengths = (scale * tokens).long().clamp_min(1)
    width = int(-(-int(lengths.max()) // P))
    per_layer = heads * width
    N = 1 + layers * per_layer
    ids = torch.arange(1, per_layer + 1) if packed else torch.randperm(N - 1, generator=g)[:per_layer] + 1
    table = ids.view(batch, Hkv, width).int()
    k_pages, v_pages = torch.randn(N, P, D, generator=g), torch.randn(N, P, D, generator=g)
    page_pos = torch.arange(width * P).repeat(N // width + 1)[: N * P].view(N, P).int()
    q = torch.randn(batch, Hkv * G, 1, D, generator=g)
    q_pos = torch.full((batch, 1), width * P)
    first_page = 1 if packed and not ragged else None
    return q, q_pos, k_pages, v_pages, page_pos, table, lengths.view(batch, Hkv).int(), first_page


def timed(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    out = Results("flex_decode")
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    for ragged in (False, True):
        for packed in (True, False):
            q, qp, kp, vp, pos, table, lengths, first = layer_inputs(args.batch, args.tokens, args.layers, ragged,
                                                                     packed)
            scale = D**-0.5
            variants = {
                "reference": lambda: reference.paged_attention(q, qp, kp, vp, pos, table, lengths, scale,
                                                               first_page=first),
                "flex compiled": lambda: flex_paged_decode(q, qp, kp, vp, pos, table, lengths, scale,
                                                           attend=compiled),
            }
            expect = variants["reference"]()
            t0 = time.perf_counter()
            got = variants["flex compiled"]()
            first_call = time.perf_counter() - t0
            error = float((got - expect).abs().max())
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    times[name].append(timed(fn, args.steps))
            row = {"ragged": ragged, "packed": packed, "batch": args.batch, "tokens": args.tokens,
                   "held_tokens": int(lengths.sum()), "max_abs_error": error, "flex_first_call_s": first_call,
                   **{f"{name}_ms": statistics.median(t) for name, t in times.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    head = ["heads", "pages", "held tokens", "reference ms", "flex compiled ms", "flex / reference", "max |error|"]
    lines = [f"one layer's decode attention, batch {args.batch}, {args.tokens} tokens per head (ragged: 0.25x-1.75x), "
             f"pool of {args.layers} layers; torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
             f"{args.rounds} rounds of {args.steps} calls, taking turns", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {'ragged' if r['ragged'] else 'uniform'} | {'packed' if r['packed'] else 'shuffled'} | "
                     f"{r['held_tokens']} | {r['reference_ms']:.3f} | {r['flex compiled_ms']:.3f} | "
                     f"{r['flex compiled_ms'] / r['reference_ms']:.2f} | {r['max_abs_error']:.1e} |")
    out.json({"args": vars(args), "rows": rows})
    out.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
