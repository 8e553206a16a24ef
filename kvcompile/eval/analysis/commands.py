"""``kvcompile analyze ...``: the analyses' command lines (``add_parsers``) and what each runs (``run``)."""

from __future__ import annotations

import sys


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_parsers(sub) -> None:
    """Add ``ceiling``, ``queryleak``, ``nominal``, ``diagnose`` and ``gap`` to ``sub`` (the ``analyze`` command's
    subparsers)."""
    ce = sub.add_parser(
        "ceiling", help="top-mass vs the exact best subset, balancing selector and certificate on attention rows")
    ce.add_argument("--model", default="smollm2-135m")
    ce.add_argument("--rows", type=int, default=480, help="attention rows, spread over contexts and layers")
    ce.add_argument("--contexts", type=int, default=2, help="prose windows (pydoc_data, offline)")
    ce.add_argument("--length", type=int, default=1024, help="tokens per window")
    ce.add_argument("--window", type=int, default=64, help="rows come from the last this many queries")
    ce.add_argument("--budgets", default="4,8,16,32,64,128,256", help="kept keys s, comma-separated")
    ce.add_argument("--max-swaps", type=int, default=16, help="swap-search limit of the balancing selector")
    ce.add_argument("--seed", type=int, default=0)
    ce.add_argument("--out", default="bench/results/ceiling", help="output path without extension")
    ql = sub.add_parser("queryleak", help="query-aware vs ranking restricted to the document vs compression at "
                        "the document boundary, on the needle tasks (ContourKV's Table 5)")
    _grid_arguments(ql, "snapkv,adakv-snapkv,tova,keydiff,expected-attention", "bench/results/queryleak")
    no = sub.add_parser("nominal", help="a per-head method's selection as a mask over the full cache vs ragged "
                        "storage vs one length for every head, at the same bytes")
    _grid_arguments(no, "adakv-snapkv,adakv-expected-attention,kvzip", "bench/results/nominal")
    di = sub.add_parser("diagnose", help="full-correct / compressed-wrong rows: evidence coverage, likelihood drift "
                        "and a 4x evidence-attention boost against a count-matched sham (KVDiagnosis, inferred)")
    _grid_arguments(di, "snapkv,tova,streamingllm", "bench/results/diagnosis")
    di.add_argument("--factor", type=float, default=4.0, help="the boost: ln(factor) on the evidence's logits")
    ga = sub.add_parser("gap", help="answer accuracy vs the supporting chain's retention and restatement on a "
                        "variable-chain task (answer-evidence gap, inferred)")
    _grid_arguments(ga, "snapkv,tova,streamingllm", "bench/results/gap", tasks=False)
    ga.add_argument("--hops", type=int, default=3, help="copies after the chain's root assignment")


def _grid_arguments(parser, recipes: str, out: str, tasks: bool = True) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipes", default=recipes, help="comma-separated")
    parser.add_argument("--budgets", default="0.25,0.1", help="fractions, tokens per KV head, or sizes like 64MiB")
    if tasks:
        parser.add_argument("--tasks", default="niah_single_1,passkey", help="comma-separated task names")
    parser.add_argument("--n-samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=1024, help="prompt plus answer tokens per sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out, help="output path without extension (.json and .md)")


def run(args, load) -> int:
    """Run ``args.analysis`` on ``load(args.model)`` -> (a full-budget ``CompressedModel``, its tokenizer)."""
    from ..sweep import parse_budget

    command = "kvcompile " + " ".join(args.argv)
    cm, tok = load(args.model)
    if args.analysis == "ceiling":
        from . import ceiling_report

        result = ceiling_report.run(cm, tok, rows=args.rows, contexts=args.contexts, length=args.length,
                                    window=args.window, budgets=[int(b) for b in _csv(args.budgets)],
                                    max_swaps=args.max_swaps, seed=args.seed)
        paths, text = ceiling_report.write(result, args.out, args.model, command), None
    elif args.analysis == "gap":
        from . import gap, tables

        result = gap.run(cm, tok, _csv(args.recipes), [parse_budget(b) for b in _csv(args.budgets)],
                         n_samples=args.n_samples, length=args.length, hops=args.hops, seed=args.seed)
        text = gap.markdown(result, args.model, command)
        paths = tables.write(result, args.out, text, model=args.model, command=command)
    elif args.analysis == "diagnose":
        from . import diagnose, tables

        result = diagnose.run(cm, tok, _csv(args.recipes), [parse_budget(b) for b in _csv(args.budgets)],
                              _csv(args.tasks), n_samples=args.n_samples, length=args.length, seed=args.seed,
                              factor=args.factor)
        text = diagnose.markdown(result, args.model, command)
        paths = tables.write(result, args.out, text, model=args.model, command=command)
        paths += [p for p in [diagnose.plot(result, f"{args.out}.png")] if p]
    else:
        from . import nominal, queryleak, tables

        analysis = queryleak if args.analysis == "queryleak" else nominal

        result = analysis.run(cm, tok, _csv(args.recipes), [parse_budget(b) for b in _csv(args.budgets)],
                              _csv(args.tasks), n_samples=args.n_samples, length=args.length, seed=args.seed)
        text = analysis.markdown(result, args.model, command)
        paths = tables.write(result, args.out, text, model=args.model, command=command)
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    print(text or ceiling_report.markdown(result, args.model, command))
    return 0
