"""A long soak of the public API, eager or compiled, with the process's memory sampled as it goes: does anything
leak, and if RSS grows, is it the compile caches or something else?

Each call applies a random recipe and budget (a fraction, tokens per head or a byte size) to one of two tiny random
models (a GQA Llama, a sliding-window Gemma-3) and generates after a left-padded batch of 1-3 random prompts, some
with the context apart. Every ``--every`` calls it samples RSS twice: as it is, and after ``gc.collect()`` and
glibc's ``malloc_trim(0)`` (what the process still holds rather than what the allocator kept in its free lists).

Attribution. The first ``--every`` calls are warm-up (captures, first kernels, Dynamo's first graphs); growth is
measured from there. Each sample also counts the graphs Dynamo has compiled so far: growth over an interval in which
something was compiled is put down to compilation (compiled code, its guards, the kernels Inductor loaded, which
stay mapped), growth over an interval that compiled nothing is "anything else" (a leak, or a cache that is not a
compile cache). At the end the compile caches are dropped (``torch._dynamo.reset()``, Inductor's code cache and
every compiled variant of the programs) and RSS is sampled again, to show how much of it Python can give back.

    python bench/soak.py --calls 1000                 # eager
    python bench/soak.py --calls 1000 --compiled      # every call compiled (Inductor)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import time

import torch
import transformers as tf
from record import Results

import kvcompile

VOCAB = 96


def tiny(family: str):
    """A 2-layer random model of ``family`` (nothing downloaded), 4096 positions."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2, eos_token_id=VOCAB - 1)
    torch.manual_seed(11)
    if family == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention"])
    else:
        cfg = tf.LlamaConfig(**common)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def rss_mib(trim: bool) -> float:
    if trim:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def random_call(rng: random.Random, bases, recipes, compiled: bool) -> str:
    base = rng.choice(bases)
    recipe = rng.choice(recipes)
    kind = rng.choice(["fraction", "tokens", "bytes"])
    budget = {"fraction": rng.choice([0.1, 0.25, 0.5, 1.0]), "tokens": rng.choice([16, 48, 128]),
              "bytes": rng.choice(["24KiB", "100KiB"])}[kind]
    rows = [rng.randint(2, 200) for _ in range(rng.randint(1, 3))]
    T = max(rows)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(2, VOCAB - 1, (len(rows), T), generator=g)
    mask = torch.stack([torch.arange(T) >= T - n for n in rows]).long()
    try:
        cm = kvcompile.apply(base, budget=budget, recipe=recipe, compile=compiled)
        if rng.random() < 0.5:  # the context apart, then a short question
            q = torch.randint(2, VOCAB - 1, (len(rows), rng.randint(1, 8)), generator=g)
            cm.generate(q, context_ids=ids, context_mask=mask, max_new_tokens=rng.randint(1, 24), eos_token_id=[])
        else:
            cm.generate(ids, mask, max_new_tokens=rng.randint(1, 24), eos_token_id=[])
    except ValueError:  # a budget the recipe refuses for these rows: refused before anything changed
        return "refused"
    return "ran"


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def drop_compile_caches(bases) -> None:
    torch._dynamo.reset()
    from torch._inductor.codecache import PyCodeCache

    PyCodeCache.cache_clear()
    for base in bases:
        base.programs._variants = {None: base.programs._variants[None]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="calls between RSS samples (the first: warm-up)")
    p.add_argument("--compiled", action="store_true", help="every call through torch.compile (Inductor)")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(2)
    out = Results("soak", args.out, name="compiled" if args.compiled else "eager")
    recipes = sorted(n for n, r in kvcompile.recipes().items()
                     if r.scorer is not None and not r.trained_for and n != "taskpress")
    bases = [kvcompile.apply(tiny(f), budget=1.0, recipe="full") for f in ("llama", "gemma3")]
    rng, start = random.Random(args.seed), time.perf_counter()
    sample = lambda call: dict(calls=call, rss_mib=rss_mib(False), rss_trimmed_mib=rss_mib(True),  # noqa: E731
                               seconds=round(time.perf_counter() - start, 1), compiled_graphs=compiled_graphs())
    samples = [sample(0)]
    outcomes = {"ran": 0, "refused": 0}
    for call in range(1, args.calls + 1):
        outcomes[random_call(rng, bases, recipes, args.compiled)] += 1
        if call % args.every == 0 or call == args.calls:
            samples.append(sample(call))
            print(samples[-1], flush=True)
    end = samples[-1]["rss_trimmed_mib"]
    drop_compile_caches(bases)
    dropped = rss_mib(True)
    after_warmup = samples[1:] if len(samples) > 2 else samples
    warm = after_warmup[0]["rss_trimmed_mib"]
    steps = list(zip(after_warmup, after_warmup[1:]))
    compiling = sum(b["rss_trimmed_mib"] - a["rss_trimmed_mib"] for a, b in steps
                    if b["compiled_graphs"] > a["compiled_graphs"])
    summary = dict(calls=args.calls, compiled=args.compiled, outcomes=outcomes, warm_mib=warm, end_mib=end,
                   growth_mib=end - warm, while_compiling_mib=compiling, anything_else_mib=end - warm - compiling,
                   after_dropping_compile_caches_mib=dropped)
    out.json(dict(summary=summary, samples=samples, recipes=recipes, seed=args.seed))
    rows = "\n".join(f"| {s['calls']} | {s['seconds']} | {s['compiled_graphs']} | {s['rss_mib']:.0f} | "
                     f"{s['rss_trimmed_mib']:.1f} |" for s in samples)
    out.markdown(
        f"Soak of {args.calls} {'compiled' if args.compiled else 'eager'} calls ({outcomes['ran']} ran, "
        f"{outcomes['refused']} refused), seed {args.seed}.\n\n"
        "| calls | s | graphs compiled | RSS MiB | RSS MiB after gc + malloc_trim |\n"
        f"|---|---|---|---|---|\n{rows}\n\nGrowth after the warm-up ({args.every} calls): {end - warm:+.1f} MiB, of "
        f"which {compiling:+.1f} MiB over intervals that compiled a graph and {end - warm - compiling:+.1f} MiB over "
        f"intervals that compiled nothing (anything else). Dropping the compile caches at the end gave back "
        f"{end - dropped:.1f} MiB (compiled kernels stay mapped).\n")
    print(summary)


if __name__ == "__main__":
    main()
