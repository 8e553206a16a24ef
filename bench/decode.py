"""Decode ms/token and prefill + compression time against context length and batch, in one run.

Compares, on the same machine and inputs: transformers with its own full cache (sdpa, DynamicCache) and, with
``--hf-static``, with the fastest path a transformers user would pick (a ``StaticCache`` and a compiled one-token
forward, gpt-fast style), kvcompile at budget 1.0 (once per mode: at 1.0 every recipe keeps every token, so the full
cache stands for all of them; and again with plain ``F.linear`` projections: what ``StreamWeightsLinear`` is worth
on this machine), and kvcompile's ``--recipes`` (a uniform one and a ragged one, e.g. ``snapkv,adakv-snapkv``) at
the budgets below 1.0. Modes: eager; compiled with ``--compiled``; and with ``--flex`` eager programs whose decode
attention is flex_attention compiled by Inductor (``KVCOMPILE_DECODE_BACKEND=flex``). Prefill is measured once
for kvcompile (compression runs after it); each budget then restores the prefilled cache and compresses (timed).
Then every variant decodes ``--steps`` tokens in turn, for ``--rounds`` rounds; a variant's ms/token is its median
round, including its share of reserving pages. Writes JSON (every round), Markdown and a PNG under
``bench/results/decode/`` (``--out``), with their record (``record.py``).

    python bench/decode.py --contexts 1024,2048,4096 --batches 1,4 --steps 8 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import time

import torch
from record import Results

import kvcompile
from kvcompile.programs import Programs

try:
    from kvcompile.model import RESERVE_AHEAD
except ImportError:  # a commit before kvcompile.request (bench/compare_commits.py runs this script against one)
    from kvcompile.steps import RESERVE_AHEAD


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def hf_full_cache(model, ids):
    """transformers' own path: one prefill forward with a DynamicCache -> (prefill seconds, one decode step)."""
    with torch.no_grad():
        out, t_prefill = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
    state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

    def step():
        with torch.no_grad():
            out = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
        state["token"] = out.logits[:, -1:].argmax(-1)

    step()  # warm-up
    return t_prefill, step


def hf_static_compiled(model, ids, room):
    """transformers' fastest decode a user would pick: a ``StaticCache`` sized for ``room`` more tokens and
    ``torch.compile`` of the one-token forward (fixed shapes) -> (prefill seconds, one decode step); the first step
    (compilation) is run here, untimed."""
    from transformers import StaticCache

    T = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=T + room)
    with torch.no_grad():
        out, t_prefill = timed(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True,
                                             cache_position=torch.arange(T), logits_to_keep=1))
    forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    state = {"token": out.logits[:, -1:].argmax(-1), "pos": T}

    def step():
        with torch.no_grad():
            out = forward(input_ids=state["token"], past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([state["pos"]]))
        state["token"], state["pos"] = out.logits[:, -1:].argmax(-1), state["pos"] + 1

    step()  # compiles
    return t_prefill, step


@contextlib.contextmanager
def decode_backend(name: str | None):
    """``KVCOMPILE_DECODE_BACKEND`` set to ``name`` (None: as it was) around a decode step."""
    saved = os.environ.get("KVCOMPILE_DECODE_BACKEND")
    if name is not None:
        os.environ["KVCOMPILE_DECODE_BACKEND"] = name
    try:
        yield
    finally:
        os.environ.pop("KVCOMPILE_DECODE_BACKEND", None)
        if saved is not None:
            os.environ["KVCOMPILE_DECODE_BACKEND"] = saved


def kv_steps(cm, token, room, backend: str | None = None):
    """(one decode step of ``cm``, seconds of reservation per token). Decoding reserves pages ahead (a reservation
    packs the pool: up to one copy of the cache), so each step is charged its share of reserving ``room`` tokens.
    ``backend``: the decode attention backend of its steps (``KVCOMPILE_DECODE_BACKEND``)."""
    _, t_reserve = timed(lambda: cm.cache.reserve(room))
    state = {"token": token}

    def step():
        with decode_backend(backend):
            state["token"] = cm.decode(state["token"])[:, -1].argmax(-1, keepdim=True)

    step()  # warm-up (and compilation, when compiled)
    return step, t_reserve / room


def interleaved(steps_of, rounds, steps):
    """Seconds per step of each variant in each round; the variants take turns within a round, so the machine's
    drift (large on a shared 2-core VM) falls on all of them alike."""
    times = {name: [] for name in steps_of}
    for _ in range(rounds):
        for name, step in steps_of.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def run(args):
    from kvcompile.eval.sweep import grid, shared_base

    model, _ = kvcompile.load_model(args.model)
    recipes = args.recipes.split(",")
    base = shared_base(kvcompile.apply(model, budget=1.0, recipe="full"), grid(recipes, args.budgets))  # observes
    # the widest window of the recipes, keeps everything
    plain = kvcompile.CompressedModel(Programs.rewrite(base.programs.captured, base.spec, stream_weights=False),
                                      base.spec, base.recipe, base.budget)  # the share of StreamWeightsLinear
    room = max(RESERVE_AHEAD, args.rounds * args.steps + 1)
    rows = []
    for ctx in args.contexts:
        for batch in args.batches:
            ids = torch.randint(100, 40000, (batch, ctx), generator=torch.Generator().manual_seed(ctx + batch))
            steps_of = None  # the last cell's variants and their caches go before this cell's are built
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            hf_prefill, hf_step = hf_full_cache(model, ids)
            row = {"context": ctx, "batch": batch, "hf_prefill_s": hf_prefill}
            steps_of, reserve = {"hf": hf_step}, {"hf": 0.0}
            if args.hf_static:
                row["hf_static_prefill_s"], steps_of["hf_static"] = hf_static_compiled(model, ids, room + 1)
                reserve["hf_static"] = 0.0
            base.reset()
            logits, row["kv_prefill_s"] = timed(lambda: base.prefill(ids, compress=False, logits="last"))
            token = logits[:, -1:].argmax(-1)
            modes = ["eager"] + ["compiled"] * args.compiled + ["flex"] * args.flex
            for mode in modes:  # at budget 1.0 every recipe keeps every token: its decode is the full cache's
                key = "kv_1.0" + ("" if mode == "eager" else "_" + mode)
                full = base.fork(compile=mode == "compiled")
                steps_of[key], reserve[key] = kv_steps(full, token, room, "flex" if mode == "flex" else None)
                row[f"{key}_bytes_held"] = full.cache_stats()["bytes_held"]
            plain.reset()
            plain.prefill(ids, logits="last")  # its own prefill: other programs than the base's (not timed)
            steps_of["kv_1.0_plain_linear"], reserve["kv_1.0_plain_linear"] = kv_steps(plain, token, room)
            for recipe, budget in ((r, b) for r in recipes for b in args.budgets if b != 1.0):
                for mode in modes:
                    cm = base.fork(recipe, budget, compile=mode == "compiled")
                    _, t_comp = timed(cm.compress)
                    key = f"kv_{recipe}_{budget}{'' if mode == 'eager' else '_' + mode}"
                    row[f"{key}_compress_s"] = t_comp
                    row[f"{key}_bytes_held"] = cm.cache_stats()["bytes_held"]
                    steps_of[key], reserve[key] = kv_steps(cm, token, room, "flex" if mode == "flex" else None)
            for name, times in interleaved(steps_of, args.rounds, args.steps).items():
                row[f"{name}_rounds_ms"] = [(t + reserve[name]) * 1e3 for t in times]
                row[f"{name}_decode_ms"] = statistics.median(row[f"{name}_rounds_ms"])
                row[f"{name}_reserve_ms"] = reserve[name] * 1e3  # its share of reserving pages, in every round
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows) -> str:
    """Markdown table: every variant's decode ms and its ratio against transformers' full cache in the same run,
    and each compression's time as a share of kvcompile's prefill."""
    variants = [k[: -len("_decode_ms")] for k in rows[0] if k.endswith("_decode_ms") and k != "hf_decode_ms"]
    compressed = [k[: -len("_compress_s")] for k in rows[0] if k.endswith("_compress_s")]
    head = ["context", "batch", "HF prefill s", "kv prefill s", "HF decode ms"]
    head += [c for v in variants for c in (f"{v} ms", f"HF / {v}")] + [f"compress {v} / kv prefill" for v in compressed]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        hf = r["hf_decode_ms"]
        cells = [r["context"], r["batch"], f"{r['hf_prefill_s']:.1f}", f"{r['kv_prefill_s']:.1f}", f"{hf:.0f}"]
        cells += [c for v in variants for c in (f"{r[f'{v}_decode_ms']:.0f}", f"{hf / r[f'{v}_decode_ms']:.2f}")]
        cells += [f"{r[f'{v}_compress_s'] / r['kv_prefill_s']:.1%}" for v in compressed]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows):
    """Decode ms/token against context, one panel per batch, a line per variant (a figure to save)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == batch]
        ctx = [r["context"] for r in sel]
        for key in [k for k in sel[0] if k.endswith("decode_ms")]:
            ax.plot(ctx, [r[key] for r in sel], marker="o", label=key.replace("_decode_ms", ""))
        ax.set(title=f"batch {batch}", xlabel="context tokens", ylabel="decode ms/token", xscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipes", default="snapkv", help="comma-separated: a uniform and a ragged recipe, e.g. "
                   "snapkv,adakv-snapkv")
    p.add_argument("--hf-static", action="store_true", help="also time transformers' StaticCache + compiled decode "
                   "(compiles once per context and batch: minutes on CPU)")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.1])
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the table reports each variant's median round")
    p.add_argument("--compiled", action="store_true", help="also time the compiled decode (slow to compile on CPU)")
    p.add_argument("--flex", action="store_true", help="also time eager programs over the flex_attention backend")
    p.add_argument("--out", help="path stem of what is written (default bench/results/decode/decode)")
    args = p.parse_args()
    out = Results("decode", args.out)
    torch.manual_seed(0)
    rows = run(args)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "args": vars(args)}
    out.json({"meta": meta, "rows": rows})
    out.markdown(f"{args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads\n\n" + table(rows))
    out.figure(plot(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
