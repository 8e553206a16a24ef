"""Speculative decoding with a compressed draft (inferred; docs/guide.md) on SmolLM2: acceptance, draft memory,
speed.

The target is SmolLM2 at budget 1.0 (its full cache); the draft is the same model over ``--recipe`` at ``--budget``
(``kvcompile.apply(target, ...)``: the same programs, its own compressed cache). The prompt is the first ``n``
tokens of a long document (Python's bundled ``pydoc_data`` topics: nothing is downloaded), and both generate
``--tokens`` tokens greedily (or at ``--temperature``), end-of-text ignored. Per context we measure, within one run:

* plain greedy decoding (``decode`` steps over the target's prefilled cache) against speculative decoding
  (``generate(..., draft=draft, draft_tokens=k)``) in seconds per new token, prefills left out (the speculative
  rounds' own time, ``SpeculationStats.seconds``), and whether the greedy outputs are identical;
* the acceptance rate (drafted tokens the target kept) and tokens emitted per target call;
* the draft's cache: bytes held (its budget's, plus the generated tokens) and allocated, against the target's;
* the cost model's inputs: one draft decode step and one target verification of k + 1 tokens, each over one target
  decode step (c and v), and the speed-up they predict, E / (k c + v) with E the measured tokens per target call.

Batch-1 decode is bound by reading the weights, and the draft has the target's weights: c is near 1 and
speculation is expected to lose here (``docs/guide.md`` works through what a smaller draft changes). Timings are
taken on a shared machine; only ratios within one run are compared.

    OMP_NUM_THREADS=1 python bench/speculative.py --contexts 2048,4096,8000 --tokens 32
    # bench/results/speculative/speculative.*

Under heavy contention two threads lose more to waiting for each other than they gain (SmolLM2's decode steps
measured 4 to 7 times slower with two threads than with one, minutes apart, on the loaded machine), so the committed
run uses one thread; ``bench/results/speculative/speculative_contended*`` keep the two-thread runs made while the
machine was loaded.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from record import Results

import kvcompile


def document(tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens [1, n] of the pydoc topics, one after another, in a fixed order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def median_time(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one untimed call (the first reserves room, packing the pool)."""
    fn()
    return statistics.median(timed(fn)[1] for _ in range(repeats))


def plain(target, ids, tokens: int) -> dict:
    """Plain greedy decoding over the target's freshly prefilled cache (what ``generate`` does without a draft):
    its output, its prefill seconds, seconds per new token (``tokens - 1`` decode steps) and per decode step."""
    logits, prefill = timed(lambda: target.prefill(ids, logits="last"))
    new = [logits[:, -1].argmax(-1, keepdim=True)]

    def decode():
        for _ in range(tokens - 1):
            new.append(target.decode(new[-1])[:, -1].argmax(-1, keepdim=True))

    _, seconds = timed(decode)
    return dict(out=torch.cat([ids, *new], 1), target_prefill_s=prefill, plain_s_per_token=seconds / tokens,
                target_step_s=seconds / (tokens - 1))


def measure(target, draft, ids, args) -> dict:
    target.reset(), draft.reset()  # a prefill on a non-empty cache would append to it
    base = plain(target, ids, args.tokens)
    verify = median_time(lambda: target.decode_many(ids[:, -(args.k + 1):]), args.repeats)  # on that cache
    _, draft_prefill = timed(lambda: draft.prefill(ids, logits="last"))
    draft_step = median_time(lambda: draft.decode(ids[:, -1:]), args.repeats)
    sampling = dict(do_sample=args.temperature > 0, temperature=args.temperature or 1.0, eos_token_id=[],
                    max_new_tokens=args.tokens, generator=torch.Generator().manual_seed(0))
    spec = target.generate(ids, draft=draft, draft_tokens=args.k, **sampling)
    stats, held, drafted = target.speculation, target.cache_stats(), draft.cache_stats()
    new = spec.shape[1] - ids.shape[1]
    spec_s = stats.seconds / new  # the rounds alone, as plain's decode steps alone
    c, v = draft_step / base["target_step_s"], verify / base["target_step_s"]
    per_call = new / (stats.rounds + 1)  # the first token comes from the prefill's logits
    identical = bool(torch.equal(base.pop("out"), spec)) if args.temperature == 0 else None
    return dict(
        context=ids.shape[1], new_tokens=new, identical=identical, acceptance=stats.acceptance_rate,
        rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted, tokens_per_call=per_call,
        spec_s_per_token=spec_s, speedup=base["plain_s_per_token"] / spec_s, c=c, v=v,
        predicted_speedup=per_call / (args.k * c + v),
        small_draft_speedup=per_call / (args.k * 0.1 + v),  # the same acceptance, a draft 10x cheaper per step
        draft_bytes_held=drafted["bytes_held"], draft_bytes_allocated=drafted["bytes_allocated"],
        draft_budget_bytes=drafted["budget_bytes"], target_bytes_held=held["bytes_held"],
        target_bytes_allocated=held["bytes_allocated"], draft_prefill_s=draft_prefill, verify_s=verify,
        draft_step_s=draft_step, **base,
    )


MiB = 2**20
COLUMNS = [
    ("context", "{context}"), ("identical", "{identical}"), ("acceptance", "{acceptance:.3f}"),
    ("tokens / target call", "{tokens_per_call:.2f}"), ("plain s/token", "{plain_s_per_token:.3f}"),
    ("speculative s/token", "{spec_s_per_token:.3f}"), ("speed-up", "{speedup:.2f}x"), ("c", "{c:.2f}"),
    ("v", "{v:.2f}"), ("predicted", "{predicted_speedup:.2f}x"), ("c = 0.1 would give", "{small_draft_speedup:.2f}x"),
    ("draft held MiB", "{draft_held:.1f}"), ("draft allocated MiB", "{draft_allocated:.1f}"),
    ("target held MiB", "{target_held:.1f}"),
]


def table(result) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in result["rows"]:
        mib = dict(draft_held=r["draft_bytes_held"] / MiB, draft_allocated=r["draft_bytes_allocated"] / MiB,
                   target_held=r["target_bytes_held"] / MiB)
        lines.append("| " + " | ".join(f.format(**r, **mib) for _, f in COLUMNS) + " |")
    a = result["args"]
    head = (f"# Speculative decoding with a compressed draft (inferred)\n\n"
            f"{a['model']}: target budget 1.0, draft {a['recipe']} at {a['budget']} (the same model and programs), "
            f"k = {a['k']}, {a['tokens']} new tokens, temperature {a['temperature']}; {result['machine']}. "
            "The machine was shared with other engineers' jobs while this ran: compare ratios within a row, not "
            "seconds across rows or runs. c: a draft decode step over a target decode step; v: a target "
            "verification of k + 1 tokens over a target decode step; predicted: tokens per target call / "
            "(k c + v).\n\n")
    return head + "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", default="2048,4096,8000")
    parser.add_argument("--recipe", default="snapkv")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per step cost (median, after a warm-up)")
    parser.add_argument("--out", help="path stem of what is written (default bench/results/speculative/speculative)")
    args = parser.parse_args()
    out = Results("speculative", args.out)
    torch.manual_seed(0)
    model, tokenizer = kvcompile.load_model(args.model)
    target = kvcompile.apply(model, budget=1.0, recipe="full")
    draft = kvcompile.apply(target, budget=args.budget, recipe=args.recipe)
    result = {"args": vars(args), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
              f"torch {torch.__version__}, eager", "rows": []}
    for n in map(int, args.contexts.split(",")):
        result["rows"].append(measure(target, draft, document(tokenizer, n), args))
        print(json.dumps(result["rows"][-1]), flush=True)
        out.json(result)
        out.markdown(table(result))


if __name__ == "__main__":
    main()
