"""Command line.

``kvcompile demo``: compress a real model's cache on a long prompt and report what it held.
``kvcompile eval``: a recipes x budgets x tasks sweep with one shared prefill per context (CSV, JSON, PNG, or a
results store that a rerun resumes); ``--executor ray`` runs its contexts on Ray workers.
``kvcompile report``: the tables (Markdown or CSV) and the score-against-bytes plot of a results store.
``kvcompile fidelity``: KL, top-1, perplexity, greedy agreement and per-layer attention errors against the full cache.
``kvcompile lm-eval ...``: lm-eval's own command line with the ``kvcompile`` model and the ``kvc_*`` tasks.
``kvcompile recipes``: the built-in recipes as a table: name@version, provenance, what is inferred, source.
``kvcompile analyze ceiling``: how far the best kept subset beats top-mass on a real model's attention rows.
``kvcompile analyze queryleak``: one method and budget with the question visible, restricted, or after compression.
``kvcompile analyze diagnose``: full-correct / compressed-wrong rows, evidence coverage, an evidence boost vs a sham.
``kvcompile analyze gap``: answer accuracy against the retention and restatement of its supporting chain.
``kvcompile train kvzap``: train a learned scorer on offline data (``kvcompile.train``).
``kvcompile doctor``: the CPU, its flags, its bandwidth, and which backend (native or PyTorch) each op uses and why.

A mistake on the command line (an unknown recipe, task or model, a budget out of range, a results store that is
not one, an output folder that cannot be written) is found before any model loads (``checks``) and ends in one line
on stderr, ``kvcompile <command>: <what is wrong>``, and exit status 2; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from ..eval.analysis.commands import add_parsers as add_analyses
from ..train.command import add_parser as add_train
from .checks import UsageError, check
from .checks import lm_eval as check_lm_eval
from .commands import RUN


def main(argv=None) -> int:
    """Run one command; a ``UsageError`` (from the checks, argparse, or the command) ends as one line on stderr and
    ``SystemExit(2)``, a bug as its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = "kvcompile"
    try:
        if argv[:1] == ["lm-eval"]:  # everything after it belongs to lm-eval's own parser
            from ..eval.lm_eval_cli import main as lm_eval_main

            command = "kvcompile lm-eval"
            check_lm_eval(argv[1:])
            return lm_eval_main(argv[1:])
        args, extra = _parser().parse_known_args(argv)
        command = " ".join(["kvcompile", args.command, *([args.analysis] if args.command == "analyze" else [])])
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see {command} --help)")
        args.argv = argv
        check(args)
        return RUN[args.command](args)
    except UsageError as e:
        e.command = e.command or command
        if debug:
            traceback.print_exc()
        print(e, file=sys.stderr)
        raise


class _Parser(argparse.ArgumentParser):
    """argparse's own usage errors as one line as well, naming the command whose ``--help`` explains it."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)", self.prog)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcompile", description=__doc__)
    # main takes --debug out wherever it stands, before parsing: declared here for --help
    parser.add_argument("--debug", action="store_true", help="on an error, also print the traceback (anywhere on "
                        "the command line)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compress SmolLM2's cache on a long pass-key prompt and report bytes and speed")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--recipe", default="adakv-snapkv")
    demo.add_argument("--budget", default="0.5", help="a fraction, tokens per KV head, or a size like 64MiB")
    demo.add_argument("--tokens", type=int, default=2000, help="context length in the model's tokens")
    demo.add_argument("--depth", type=float, default=0.9, help="where the pass key sits (0 = start, 1 = end)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--max-new-tokens", type=int, default=12)
    ev = sub.add_parser("eval", help="sweep recipes x budgets over the synthetic tasks (shared prefill per context)")
    ev.add_argument("--model", default="smollm2-135m")
    ev.add_argument("--recipes", default="streamingllm,knorm,snapkv,adakv-snapkv,random", help="comma-separated")
    ev.add_argument("--budgets", default="0.5,0.25,0.1", help="fractions, tokens per KV head, or sizes like 64MiB")
    ev.add_argument("--tasks", default="niah_single_1,passkey", help="comma-separated task names, or 'all'")
    ev.add_argument("--n-samples", type=int, default=10)
    ev.add_argument("--length", type=int, default=1024, help="prompt plus answer tokens per sample")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--kl", action="store_true", help="add next-token KL and top-1 agreement against the full cache")
    ev.add_argument("--measure-separate", type=int, default=0, metavar="N",
                    help="also run every cell separately on the first N contexts and report the time ratio")
    ev.add_argument("--out", default=None, help="output path without extension (default bench/results/sweep, "
                    "none with --store)")
    ev.add_argument("--store", default=None, metavar="PATH", help="write the rows to this results store (SQLite; "
                    "created if missing) and skip the cells it holds already")
    ev.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="local: this process; ray: one unit per context on Ray workers (pip install 'kvcompile[ray]')")
    ev.add_argument("--address", default=None, help="with --executor ray: a running cluster (auto or HOST:PORT); "
                    "default: start one on this machine")
    ev.add_argument("--workers", type=int, default=None, help="with --executor ray: actors (default: CPUs / "
                    "--cpus-per-worker)")
    ev.add_argument("--cpus-per-worker", type=int, default=1, help="with --executor ray: CPUs (torch threads) each")
    rep = sub.add_parser("report", help="render a results store: tables (Markdown or CSV) and a score-against-bytes "
                         "plot")
    rep.add_argument("--store", required=True, metavar="PATH")
    rep.add_argument("--format", choices=("md", "csv"), default="md")
    rep.add_argument("--plot", default=None, metavar="OUT.png", help="also write the plot here")
    fi = sub.add_parser("fidelity", help="KL / top-1 / PPL / greedy agreement and per-layer attention errors")
    fi.add_argument("--model", default="smollm2-135m")
    fi.add_argument("--recipes", default="streamingllm,knorm,snapkv,adakv-snapkv,random")
    fi.add_argument("--budgets", default="0.5,0.25,0.1")
    fi.add_argument("--context", type=int, default=1024)
    fi.add_argument("--scored", type=int, default=512, help="teacher-forced tokens per window")
    fi.add_argument("--windows", type=int, default=4)
    fi.add_argument("--greedy-tokens", type=int, default=64)
    fi.add_argument("--seed", type=int, default=0)
    fi.add_argument("--out", default=None, help="JSON output path")
    fi.add_argument("--store", default=None, help="also write one row per (cell, window) to this results store")
    sub.add_parser("lm-eval", help="lm-eval's command line (kvcompile lm-eval --help) with the kvcompile model "
                   "and tasks registered")
    sub.add_parser("recipes", help="list the built-in recipes: name@version, provenance, what is inferred, source")
    an = sub.add_parser("analyze", help="analysis tools of the field (kvcompile.eval.analysis)")
    add_analyses(an.add_subparsers(dest="analysis", required=True))
    add_train(sub)
    doc = sub.add_parser("doctor", help="this machine: CPU, ISA flags, read bandwidth, and the backend each op uses "
                         "(measured on first use) and why")
    doc.add_argument("--hidden-size", type=int, default=576, help="the model's shapes (default: SmolLM2-135M's)")
    doc.add_argument("--intermediate-size", type=int, default=1536)
    doc.add_argument("--heads", type=int, default=9, help="query heads")
    doc.add_argument("--kv-heads", type=int, default=3)
    doc.add_argument("--head-dim", type=int, default=64)
    doc.add_argument("--formats", default="fp32,int8,int4,fp8,kivi2", help="page formats of the decode rows "
                     "(fp32: model-dtype pages)")
    doc.add_argument("--remeasure", action="store_true", help="forget this machine's kept choices and measure again "
                     "(a choice measured while the machine was busy may be wrong)")
    return parser
