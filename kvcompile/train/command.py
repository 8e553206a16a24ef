"""``kvcompile train METHOD --model NAME``: the command line of ``kvcompile.train.train`` (learned scorers),
``train.sparse_finetune.finetune`` (an adapter fine-tuned under a recipe), ``train.abstain.finetune`` (an adapter
that abstains when compression lost the evidence) and ``train.restorekv.finetune`` (RestoreKV's restore tokens)."""

from __future__ import annotations

import json
import sys

SCORERS = ("kvzap", "kvzap-hidden", "kvpop", "kvpop-delayed", "fastkvzip")
ADAPTERS = ("sparse-finetune", "abstain", "restorekv")
# what a flag left unset means, for the scorers and for each adapter
DEFAULTS = {"scorer": dict(steps=300, batch=512, lr=5e-3, lengths="256,512,1024", per_length=4, held_out=4),
            "sparse-finetune": dict(steps=100, batch=2, lr=2e-3, lengths="512", per_length=16, held_out=4, budget=0.25),
            "restorekv": dict(steps=150, batch=2, lr=2e-3, lengths="768", per_length=12, held_out=4,
                              budgets="0.05,0.1,0.25"),
            "abstain": dict(steps=100, batch=2, lr=2e-3, lengths="512", per_length=48, held_out=24)}


def add_parser(sub) -> None:
    tr = sub.add_parser("train", help=f"train a learned scorer ({', '.join(SCORERS)}) or an adapter "
                        f"({', '.join(ADAPTERS)}) on data generated offline; writes safetensors weights + a JSON card "
                        "where its recipe finds them")
    tr.add_argument("method", choices=(*SCORERS, *ADAPTERS))
    tr.add_argument("--model", default="smollm2-135m", help="a kvcompile.load_model name (also keys the weights)")
    tr.add_argument("--steps", type=int, help="default 300; sparse-finetune, abstain 100; restorekv 150")
    tr.add_argument("--batch", type=int, help="examples per step: default 512 tokens; sparse-finetune 2 contexts")
    tr.add_argument("--lr", type=float, help="default 5e-3; sparse-finetune 2e-3")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--hidden", type=int, default=0, help="0: linear surrogate; N: an MLP with N hidden units")
    tr.add_argument("--ridge", type=float, default=0.0, help="> 0: fit the linear surrogate of kvzap / kvzap-hidden "
                    "as a ridge regression with this penalty, in closed form (as kvpress fits KVzap's)")
    tr.add_argument("--lengths", help="context lengths in tokens, comma-separated (default 256,512,1024; "
                    "the adapters 512, restorekv 768; abstain takes the first)")
    tr.add_argument("--per-length", type=int, help="training contexts per length (default 4; sparse-finetune 16; "
                    "restorekv 12; abstain 48 samples)")
    tr.add_argument("--held-out", type=int, help="held-out contexts (the largest length, another seed; default 4, "
                    "abstain 24)")
    tr.add_argument("--per-context", type=int, default=256, help="tokens drawn from each context")
    tr.add_argument("--recipe", default="h2o", help="sparse-finetune: the compression the adapter learns to read")
    tr.add_argument("--budget", type=float, help="sparse-finetune: the recipe's budget while training (default 0.25)")
    tr.add_argument("--budgets", help="restorekv: the budgets each context is compressed at while training, "
                    "comma-separated (default 0.05,0.1,0.25)")
    tr.add_argument("--rank", type=int, default=8, help="the adapters: LoRA rank (q, k, v, o projections)")
    tr.add_argument("--control", action="store_true", help="abstain: train on random masks at the compressors' "
                    "retention instead (the random-mask control), written as abstain-control-<model>")
    tr.add_argument("--continuation", type=int, default=64, help="sparse-finetune, restorekv: tokens read after each "
                    "compressed context, where the loss is taken")
    tr.add_argument("--out", default=None, help="weights folder (default $KVCOMPILE_WEIGHTS or "
                    "~/.cache/kvcompile/weights)")
    tr.add_argument("--run-dir", default=None, help="data, checkpoint and loss curve (default OUT/runs/...); "
                    "rerunning the same command resumes from it")


def run(args) -> int:
    import kvcompile
    from kvcompile.train import METHODS, abstain, restorekv, sparse_finetune, train
    from kvcompile.train.loop import Schedule

    kind = args.method if args.method in ADAPTERS else "scorer"
    given = {k: getattr(args, k) for k in DEFAULTS[kind]}
    opts = {k: v if v is not None else DEFAULTS[kind][k] for k, v in given.items()}
    print(f"loading {args.model}...", file=sys.stderr)
    model, tok = kvcompile.load_model(args.model)
    schedule = Schedule(steps=opts["steps"], batch=opts["batch"], lr=opts["lr"], seed=args.seed)
    lengths = tuple(int(n) for n in opts["lengths"].split(","))
    common = dict(name=args.model, schedule=schedule, held_out=opts["held_out"], out=args.out, run_dir=args.run_dir)
    if kind == "abstain":
        card = abstain.finetune(model, tok, rank=args.rank, length=lengths[0], n=opts["per_length"],
                                control=args.control, **common)
    elif kind == "restorekv":
        budgets = tuple(float(b) for b in opts["budgets"].split(","))
        card = restorekv.finetune(model, tok, budgets=budgets, rank=args.rank, continuation=args.continuation,
                                  lengths=lengths, per_length=opts["per_length"], **common)
    elif kind == "sparse-finetune":
        card = sparse_finetune.finetune(model, tok, recipe=args.recipe, budget=opts["budget"], rank=args.rank,
                                        continuation=args.continuation, lengths=lengths,
                                        per_length=opts["per_length"], **common)
    else:
        print(f"collecting {METHODS[args.method].target} on {opts['per_length'] * len(lengths) + opts['held_out']} "
              "offline contexts (the slow part: minutes on 2 CPU cores)...", file=sys.stderr)
        card = train(args.method, model, tok, hidden=args.hidden, ridge=args.ridge, per_context=args.per_context,
                     lengths=lengths, per_length=opts["per_length"], **common)
    print(json.dumps(card, indent=1, sort_keys=True))
    return 0
