"""Eviction, quantization and both, at equal bytes: which spends a KV byte budget best, on a real model.

Every cell's budget is bytes of the model's dtype (fp32 here), so ``budget=0.25`` means a quarter of the full
cache's bytes whatever the cell stores: evict-only (``snapkv``: fewer fp32 tokens), quantize-only (``full+int4``:
every token, in fewer bits; only where every token fits), or both (``snapkv+int4``: as many int4 tokens as fit).
Cells run through ``kvcompile.eval.sweep`` (one shared prefill per context, every cell forked from it, the
question read after compression), on the offline needle and pass-key tasks with next-token KL against the full
cache.

    python bench/formats.py --samples 20 --length 1024

Writes ``bench/results/formats/formats.{json,md,png}`` (every mode below into ``bench/results/formats/``, or
``--out``). ``--speed`` instead times decode over each format at the same token count (every token kept: budget
1.0), eager and compiled, in one run on one machine, against the model-dtype pages: ``formats_speed.{json,md}``
(``--kernel``: ``formats_kernel.*``).

    python bench/formats.py --speed --batch 4 --context 8000 --steps 4 --rounds 3 --no-compile
    python bench/formats.py --speed --kernel --context 8192 --rounds 15     # one layer's attention op alone
    python bench/formats.py --speed --speed-recipes full,full+int4,anchorkv --batch 1 --context 4096 --no-compile

``--recent 16,64`` instead runs SnapKV over int4 pages with the newest 0 / 16 / 64 tokens kept in fp32
(``Recipe.precise_recent``, KIVI's hierarchy with eviction; the window paid for out of the same budget) at
``--budgets``: ``formats_recent.{json,md}``.

    python bench/formats.py --recent 16,64 --budgets 0.125,0.1 --samples 10

``--methods think,snapkv+think`` instead runs those recipes beside the plain references (snapkv, snapkv+int4,
full+int4, full+int8: quantize-only where every token fits) at ``--budgets``: ``formats_methods.*``.

    python bench/formats.py --methods think,snapkv+think,minima-kv --references "" --budgets 0.8,0.4,0.25 --samples 3

``--ablate-taskpress`` runs ``taskpress+int4`` beside each half of its score (the meta-query's attention alone, the
value scale alone) at ``--budgets``: ``formats_taskpress_ablation.*``.

    python bench/formats.py --ablate-taskpress --budgets 0.1 --samples 20
"""

from __future__ import annotations

import argparse
import dataclasses

from record import Results

import kvcompile
from kvcompile.budget import Budget
from kvcompile.eval import sweep
from kvcompile.kernels.formats import get_format
from kvcompile.recipes import in_format

EVICT = "snapkv"
FORMATS = ("int8", "int4", "int3", "int2")
QUANTIZE_ONLY = ("int4", "int3")  # int8 fits only at 0.5; int2 (per-token keys) fails everywhere: see the docs
BUDGETS = (0.5, 0.25, 0.125, 0.1, 0.0625)


def family(recipe: str) -> str:
    """reference, quantize (every token stored in a format), evict, or both; a variant run as an object
    (``--recent``, ``--ablate-taskpress``) is read from its name."""
    if recipe == "full":
        return "reference"
    known = kvcompile.recipes().get(recipe)
    fmt = known.format if known else recipe.rsplit("+", 1)[-1] if "+" in recipe else None
    keeps_all = known.scorer is None if known else recipe.startswith("full+")
    return "evict" if fmt is None else "quantize" if keeps_all else "both"


def cells(head_dim: int) -> list[tuple[str, float]]:
    """(recipe, budget) pairs: eviction and eviction + every format at every budget, quantize-only where every
    token fits (below the budget by a page of rounding's margin)."""
    out = [(EVICT, b) for b in BUDGETS]
    out += [(f"{EVICT}+{f}", b) for f in FORMATS for b in BUDGETS]
    for f in QUANTIZE_ONLY:
        share = get_format(f).token_bytes(head_dim, 16) / (2 * head_dim * 4)
        out += [(f"full+{f}", b) for b in BUDGETS if share <= 0.95 * b]
    return out


METHOD_REFERENCES = (EVICT, f"{EVICT}+int4", "full+int8", "full+int4")


def method_cells(methods: list[str], budgets: list[float], head_dim: int,
                 references=METHOD_REFERENCES) -> list[tuple[str, float]]:
    """Each of ``methods`` and of ``references`` at every budget its tokens fit (a recipe that evicts
    nothing stores every token: left out below its share, anchor pages at fp32, with a page of rounding's
    margin)."""
    out = []
    for recipe in [*references, *methods]:
        r = kvcompile.recipes()[recipe] if recipe in kvcompile.recipes() else in_format(*recipe.rsplit("+", 1))
        share = 0.0 if r.scorer else get_format(r.format).token_bytes(head_dim, 16) / (2 * head_dim * 4)
        share += (1 - share) / r.precise_anchors if r.precise_anchors else 0.0  # anchor pages in fp32
        out += [(recipe, b) for b in budgets if share <= 0.95 * b]
    return out


def ablation_cells(budgets: list[float]) -> list[tuple]:
    """``taskpress+int4`` and its two halves: the meta-query's attention alone, the value scale alone."""
    base = in_format("taskpress", "int4")
    halves = [dataclasses.replace(base, name=f"taskpress-{half}+int4", scorer_args={**base.scorer_args, **change})
              for half, change in (("attention", {"scaled": False}), ("scale", {"meta_query": ""}))]
    return [(r, b) for r in (base, *halves) for b in budgets]


def recent_cells(windows: list[int], budgets: list[float]) -> list[tuple]:
    """SnapKV over int4 pages with each precise recent window (0: none), at every budget."""
    base = in_format(EVICT, "int4")
    recipes = [dataclasses.replace(base, name=f"{base.name}-r{w}", precise_recent=w) if w else base
               for w in [0, *windows]]
    return [(r, b) for r in recipes for b in budgets]


def markdown(rows: list[dict], config: dict) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by = {(r["recipe"], r["budget"], r["task"]): r for r in rows}
    keys = list(dict.fromkeys((r["recipe"], r["budget"]) for r in rows))
    lines = [f"# Eviction vs quantization at equal bytes ({config['model']}, {config['length']} tokens, "
             f"{config['n_samples']} samples per task)", "",
             "Budget = bytes of the fp32 cache. held/full = K/V bytes held (codes, scales and zero points) over the "
             "full cache's.", "",
             "| family | recipe | budget | " + " | ".join(tasks) + " | mean | KL mean | held / full |",
             "|---|---|---|" + "---|" * (len(tasks) + 3)]
    for recipe, budget in sorted(keys, key=lambda k: (-float(k[1]), family(k[0]), k[0])):
        cells_ = [by.get((recipe, budget, t)) for t in tasks]
        scores = [c["score"] for c in cells_ if c and c["score"] is not None]
        kls = [c["kl_mean"] for c in cells_ if c and c["kl_mean"] is not None]
        held = [c["held_fraction"] for c in cells_ if c and c["held_fraction"] is not None]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {family(recipe)} | {recipe} | {budget} | "
                     + " | ".join(fmt(c and c["score"]) for c in cells_)
                     + f" | {fmt(sum(scores) / len(scores) if scores else None)}"
                     + f" | {fmt(sum(kls) / len(kls) if kls else None)} | {fmt(max(held) if held else None)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict]):
    """Score against bytes held, a line per recipe, styled by family (a figure to save)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(r["recipe"], []).append(r)
    for recipe, rs in sorted(series.items()):
        points = {}
        for r in rs:
            points.setdefault(r["budget"], []).append(r)
        xy = sorted((max(x["held_fraction"] or 0 for x in v), sum(x["score"] or 0 for x in v) / len(v))
                    for v in points.values())
        style = {"evict": "-o", "quantize": "--s", "both": ":^", "reference": "k*"}[family(recipe)]
        ax.plot(*zip(*xy), style, label=recipe)
    ax.set_xscale("log")
    ax.set_xlabel("K/V bytes held / full fp32 cache")
    ax.set_ylabel("score (mean of tasks)")
    ax.set_title("Score against bytes: evict, quantize, both")
    ax.legend(fontsize=7, ncol=2, loc="center right")
    fig.tight_layout()
    return fig


SPEED_RECIPES = ("full", "full+fp8", "full+int8", "full+int4", "kivi2")


def speed(model_name: str, batch: int, context: int, steps: int, rounds: int, compiled: bool,
          recipes=SPEED_RECIPES) -> dict:
    """Decode ms/token of every recipe of ``recipes`` (the first the reference) forked from one shared prefill of
    ``batch`` random rows of ``context`` tokens: the median over ``rounds`` of ``steps`` decode steps each."""
    import statistics
    import time

    import torch

    model, _ = kvcompile.load_model(model_name)
    base = kvcompile.apply(model, budget=1.0, recipe="snapkv")  # keeps the last 32 queries, which anchorkv reads
    ids = torch.randint(10, 1000, (batch, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base.prefill(ids, compress=False, logits="last")
    rows = []
    for mode in ("eager", "compiled") if compiled else ("eager",):
        for recipe in recipes:
            cm = base.fork(recipe, 1.0, compile=mode == "compiled")
            cm.compress()
            held = cm.cache_stats()["bytes_held"]
            nxt = torch.full((batch, 1), 42)
            with torch.no_grad():
                t0 = time.perf_counter()
                cm.decode(nxt)  # warm-up (compiles)
                first_s, times = time.perf_counter() - t0, []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        cm.decode(nxt)
                    times.append((time.perf_counter() - t0) / steps * 1e3)
            rows.append({"mode": mode, "recipe": recipe, "ms_per_token": statistics.median(times),
                         "rounds_ms": times, "first_call_s": first_s, "bytes_held": held})
            print(rows[-1])
    for row in rows:
        ref = next(r for r in rows if r["mode"] == row["mode"] and r["recipe"] == recipes[0])
        row["vs_model_dtype"] = row["ms_per_token"] / ref["ms_per_token"]
    return {"config": {"model": model_name, "batch": batch, "context": context, "steps": steps, "rounds": rounds,
                       "threads": torch.get_num_threads()}, "rows": rows}


def kernel_speed(context: int, rounds: int) -> dict:
    """One layer's decode attention (SmolLM2's shape: batch 4, 9 query and 3 KV heads of 64) over ``context``
    random tokens per head: fp32 pages read in place (the packed run, by a matmul; and by the native one-pass
    decode, as shuffled or ragged heads are), and each format read by the native one-pass decode
    (``kernels.cpu_native``), by the PyTorch two-pass decode (``reference.stored_decode`` with the native path off)
    and by the tile-by-tile merged attention (``reference.merged_attention``); median of ``rounds`` interleaved
    calls."""
    import statistics
    import time

    import torch
    from decode import decode_backend

    from kvcompile.kernels import reference
    from kvcompile.kernels.formats import encode_pool

    def pytorch_only(call):
        def run():
            with decode_backend("reference"):
                return call()
        return run

    g = torch.Generator().manual_seed(0)
    B, Hkv, G, D, P = 4, 3, 3, 64, 16
    n = B * Hkv * context // P
    k, v = torch.randn(n + 1, P, D, generator=g), torch.randn(n + 1, P, D, generator=g)
    pos = torch.cat([torch.zeros(P), torch.arange(context).repeat(B * Hkv)]).view(-1, P).int()
    table, lengths = (1 + torch.arange(n)).view(B, Hkv, -1).int(), torch.full((B, Hkv), context, dtype=torch.int32)
    q, q_pos = torch.randn(B, Hkv * G, 1, D, generator=g), torch.full((B, 1), context)
    empty = (torch.zeros(2, P, D),) * 2 + (torch.zeros(2, P, dtype=torch.int32),
                                          torch.zeros(B, Hkv, 2, dtype=torch.int32),
                                          torch.zeros(B, Hkv, dtype=torch.int32))
    dense = reference.gather_dense(*empty)
    fp32 = (q, q_pos, k, v, pos, table, lengths, 0.125)
    calls = {("float32", "in place (matmul)"): lambda: reference.paged_attention(*fp32, first_page=1),
             ("float32", "native, one pass"): lambda: reference.paged_attention(*fp32)}
    for name in ("int8", "int4", "kivi2", "fp8"):
        f = get_format(name)
        stored = reference.FormatPages(*encode_pool(f.key, k), *encode_pool(f.value, v), pos, table, lengths)
        calls[(name, "native, one pass")] = lambda s=stored: reference.stored_decode(q, dense, s, 0.125)
        calls[(name, "PyTorch, two passes")] = pytorch_only(
            lambda s=stored: reference.stored_decode(q, dense, s, 0.125))
        calls[(name, "merged tiles")] = lambda s=stored: reference.merged_attention(
            q, q_pos, dense, s, 0.125, 0, 1 << 26)
    times = {key: [] for key in calls}
    with torch.no_grad():
        for _ in range(rounds):
            for key, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[key].append((time.perf_counter() - t0) * 1e3)
    ref = statistics.median(times[("float32", "in place (matmul)")])
    rows = [{"format": f, "path": path, "ms": statistics.median(t), "vs_float32": statistics.median(t) / ref}
            for (f, path), t in times.items()]
    return {"config": {"context": context, "rounds": rounds, "threads": torch.get_num_threads()}, "rows": rows}


def kernel_markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# One layer's decode attention over page formats (batch 4, 9/3 heads of 64, {c['context']} tokens per "
             f"head, {c['threads']} threads, median of {c['rounds']})", "",
             "| format | path | ms | vs float32 pages in place (matmul) |", "|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['path']} | {r['ms']:.1f} | {r['vs_float32']:.2f}x |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def speed_markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# Decode over page formats ({c['model']}, batch {c['batch']}, {c['context']} tokens kept, "
             f"{c['threads']} threads)", "",
             "| mode | recipe | ms / token | vs model-dtype pages | K/V bytes held (MiB) | first call s |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['recipe']} | {r['ms_per_token']:.1f} | {r['vs_model_dtype']:.2f}x "
                     f"| {r['bytes_held'] / 2**20:.0f} | {r.get('first_call_s', float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--tasks", default="niah_single_1,passkey")
    parser.add_argument("--out", default=None, help="path stem of what is written (default: the mode's file in "
                        "bench/results/formats/)")
    parser.add_argument("--speed", action="store_true", help="time decode over each format instead")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="with --speed: eager only")
    parser.add_argument("--speed-recipes", default=",".join(SPEED_RECIPES), help="with --speed: the first is 1.00x")
    parser.add_argument("--kernel", action="store_true", help="with --speed: one layer's attention op, not the model")
    parser.add_argument("--recent", default=None, help="precise recent windows beside snapkv+int4, e.g. 16,64")
    parser.add_argument("--ablate-taskpress", action="store_true", help="taskpress+int4 and each half of its score")
    parser.add_argument("--budgets", default="0.125,0.1", help="with --recent or --methods")
    parser.add_argument("--methods", default=None, help="recipes beside the references, e.g. think,snapkv+think")
    parser.add_argument("--references", default=",".join(METHOD_REFERENCES), help="with --methods ('' for none)")
    args = parser.parse_args()
    default = ("formats_kernel" if args.speed and args.kernel else "formats_speed" if args.speed
               else "formats_recent" if args.recent else "formats_taskpress_ablation" if args.ablate_taskpress
               else "formats_methods" if args.methods else "formats")
    out = Results("formats", args.out, name=default)
    if args.speed and args.kernel:
        result = kernel_speed(args.context, args.rounds)
        out.json(result)
        out.markdown(kernel_markdown(result))
        print(kernel_markdown(result))
        return
    if args.speed:
        result = speed(args.model, args.batch, args.context, args.steps, args.rounds, not args.no_compile,
                       args.speed_recipes.split(","))
        out.json(result)
        out.markdown(speed_markdown(result))
        print(speed_markdown(result))
        return
    model, tokenizer = kvcompile.load_model(args.model)
    cm = kvcompile.apply(model, budget=1.0, recipe="full")
    own = args.recent or args.ablate_taskpress  # grids of Recipe objects, not names
    budgets = [float(b) for b in args.budgets.split(",")] if own or args.methods else list(BUDGETS)
    if args.methods:
        grid = method_cells(args.methods.split(","), budgets, cm.spec.head_dim,
                            [r for r in args.references.split(",") if r])
    elif args.recent:
        grid = recent_cells([int(w) for w in args.recent.split(",")], budgets)
    elif args.ablate_taskpress:
        grid = ablation_cells(budgets)
    else:
        grid = cells(cm.spec.head_dim)
    recipes = list({r.name: r for r, _ in grid}.values()) if own else sorted({r for r, _ in grid})
    # the sweep runs every recipe at every budget; a quantize-only cell whose tokens do not fit fails fast
    # (``apply`` refuses it) and is left out of the table
    result = sweep.run(cm, tokenizer, recipes, budgets, args.tasks.split(","),
                       n_samples=args.samples, length=args.length, kl=True, model=args.model)
    name = lambda r: r if isinstance(r, str) else r.name  # noqa: E731
    wanted = {(name(r), str(Budget.parse(b))) for r, b in grid} | {("full", "1")}
    rows = [r for r in result["rows"] if (r["recipe"], r["budget"]) in wanted]
    config = {**result["config"], "model": args.model}
    out.json({"config": config, "rows": rows, "timing": result["timing"]})
    print(out.markdown(markdown(rows, config)).read_text())
    out.figure(plot([r for r in rows if r["recipe"] != "full"]))


if __name__ == "__main__":
    main()
