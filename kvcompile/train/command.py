"""``kvcompile train METHOD --model NAME``: the command line of ``kvcompile.train.train``."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    tr = sub.add_parser("train", help="train a learned scorer (kvzap, kvzap-hidden, kvpop, kvpop-delayed) on data generated offline; writes safetensors "
                        "weights + a JSON card where its recipe finds them")
    tr.add_argument("method", choices=("kvzap", "kvzap-hidden", "kvpop", "kvpop-delayed"))
    tr.add_argument("--model", default="smollm2-135m", help="a kvcompile.load_model name (also keys the weights)")
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--batch", type=int, default=512)
    tr.add_argument("--lr", type=float, default=5e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--hidden", type=int, default=0, help="0: linear surrogate; N: an MLP with N hidden units")
    tr.add_argument("--ridge", type=float, default=0.0, help="> 0: fit the linear surrogate of kvzap / kvzap-hidden "
                    "as a ridge regression with this penalty, in closed form (as kvpress fits KVzap's)")
    tr.add_argument("--lengths", default="256,512,1024", help="context lengths in tokens, comma-separated")
    tr.add_argument("--per-length", type=int, default=4, help="training contexts per length")
    tr.add_argument("--held-out", type=int, default=4, help="held-out contexts (the largest length, another seed)")
    tr.add_argument("--per-context", type=int, default=256, help="tokens drawn from each context")
    tr.add_argument("--out", default=None, help="weights folder (default $KVCOMPILE_WEIGHTS or "
                    "~/.cache/kvcompile/weights)")
    tr.add_argument("--run-dir", default=None, help="data, checkpoint and loss curve (default OUT/runs/...); "
                    "rerunning the same command resumes from it")


def run(args) -> int:
    import kvcompile
    from kvcompile.train import METHODS, train
    from kvcompile.train.loop import Schedule

    print(f"loading {args.model}...", file=sys.stderr)
    model, tok = kvcompile.load_model(args.model)
    schedule = Schedule(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    print(f"collecting {METHODS[args.method].target} on {args.per_length * len(lengths) + args.held_out} offline "
          "contexts (the slow part: minutes on 2 CPU cores)...", file=sys.stderr)
    card = train(args.method, model, tok, name=args.model, schedule=schedule, hidden=args.hidden, ridge=args.ridge,
                 lengths=lengths,
                 per_length=args.per_length, held_out=args.held_out, per_context=args.per_context, out=args.out,
                 run_dir=args.run_dir)
    print(json.dumps(card, indent=1, sort_keys=True))
    return 0
