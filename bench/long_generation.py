"""Long generation under a decode-time cap: speed, bytes held over time, and fidelity to the full cache, per policy.

SmolLM2 reads a short chat prompt and the full-cache model generates ``--tokens`` tokens (end-of-turn ignored),
greedily or sampled with a fixed seed (``--temperature``): that continuation is the reference. Each (decode
policy, cap in tokens per KV head) then reads the same prompt and is teacher-forced along the reference with
``CompressedModel.decode_many`` (the same caches as one ``decode`` call per token, at a fraction of the cost),
its decode schedule evicting as it goes. We measure:

* KL(full || policy) of the next-token distributions, averaged over all steps and over the steps after a full
  cache would pass the cap (before that nothing is evicted and the KL is 0);
* agreement length: the first step where the policy would pick another token than the reference, greedily or
  with the same uniform draw (inverse-CDF sampling). Up to that step the teacher-forced inputs are the policy's
  own choices, so this is exactly how long the policy's own generation (greedy, or sampled with the same seed)
  matches the full cache's; and the top-1 rate: how often its argmax is the full cache's argmax;
* bytes held after every eviction run (``cache_stats()["peak_bytes_held"]`` gives the peak between runs);
* decode tokens/s of ``--timed`` greedy ``decode`` steps at the cap (schedule runs included), against the full
  cache's last ``--timed`` steps (at the longest context), and the schedule's share of that time (the steps that
  ran it, beyond the median step). On a shared CPU the tokens/s are noisy; the share less so.

Writes JSON, a markdown table and a PNG (bytes held against generated tokens, one panel per cap) under
bench/results/long_generation/ (``--out``), updating them after every run so a partial run keeps what it measured.

    python bench/long_generation.py --tokens 2000 --caps 256,512,1024 --temperature 0.8
    python bench/long_generation.py --temperature 0.8 --policies random-attention --schedule '{"every": 16}' \
        --reference bench/results/long_generation/long_generation.json \
        --out bench/results/long_generation/long_generation_random16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from record import Results
from tqdm import tqdm

import kvcompile

POLICIES = ["random-attention", "inertiakv", "h2o-decode", "snapkv-decode", "inertiakv-lazy", "score-free", "growpage"]
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map hidden inside an old clock."


def prompt_ids(tokenizer) -> torch.Tensor:
    chat = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


def pick(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next tokens [n] from logits [n, V]: the argmax (temperature 0), else the sample that the uniform draws ``u``
    [n] pick by inverse CDF. Two models given the same ``u`` sample the same token until their distributions part."""
    if temperature == 0:
        return logits.argmax(-1)
    cdf = torch.softmax(logits.float() / temperature, -1).cumsum(-1)
    return torch.searchsorted(cdf, u[:, None].to(cdf.dtype)).squeeze(-1).clamp_max(logits.shape[-1] - 1)


def reference(base, ids, tokens, timed, temperature, u):
    """Full-cache generation: tokens [N], log-probabilities [N, V] and argmax tokens [N] at each step, (step, bytes
    held) pairs, and the decode tokens/s of its last ``timed`` steps (the longest context)."""
    cm = kvcompile.apply(base, budget=1.0, recipe="full")
    logits = cm.prefill(ids, logits="last")[:, -1]
    cm.cache.reserve(tokens)
    out, logps, top, held, seconds = [], [], [], [], []
    for step in tqdm(range(tokens), desc="full cache", mininterval=30):
        logps.append(torch.log_softmax(logits.float(), -1)[0])
        top.append(int(logits.argmax(-1)))
        out.append(int(pick(logits, u[step : step + 1], temperature)))
        t0 = time.perf_counter()
        logits = cm.decode(torch.tensor([[out[-1]]]))[:, -1]
        seconds.append(time.perf_counter() - t0)
        held.append((step + 1, int(cm.cache.bytes_held().sum())))
    return torch.tensor(out), torch.stack(logps), torch.tensor(top), held, timed / sum(seconds[-timed:])


def reread(base, ids, tokens):
    """Log-probabilities [N, V] and argmax tokens [N] of the full cache along a stored reference, in one pass."""
    cm = kvcompile.apply(base, budget=1.0, recipe="full")
    logits = torch.cat([cm.prefill(ids, logits="last")[0], cm.decode_many(tokens[:-1].view(1, -1))[0]])
    return torch.log_softmax(logits.float(), -1), logits.argmax(-1)


def teacher_forced(base, ids, recipe, cap, ref, temperature, u, timed):
    """One policy along the reference with ``decode_many``, one call per schedule interval (so each call ends with
    an eviction run): per-step KL, top-1 hits against the full cache's argmax, and whether the policy would have
    picked the reference token with the same draw; (step, bytes held) after every run; then ``timed`` greedy
    ``decode`` steps at the cap for tokens/s."""
    ref_tokens, ref_logps, ref_top = ref
    cm = kvcompile.apply(base, budget=cap, recipe=recipe)
    kl, hits, same, held = [], [], [], []

    def score(logits, t):  # logits [n, V] predict ref_tokens[t : t + n]
        n = len(logits)
        logp, ref_logp = torch.log_softmax(logits.float(), -1), ref_logps[t : t + n]
        kl.extend((ref_logp.exp() * (ref_logp - logp)).sum(-1).tolist())
        hits.extend((logits.argmax(-1) == ref_top[t : t + n]).tolist())
        same.extend((pick(logits, u[t : t + n], temperature) == ref_tokens[t : t + n]).tolist())

    score(cm.prefill(ids, logits="last")[0], 0)
    N, every = len(ref_tokens), cm.recipe.decode["every"]
    starts = [0] + list(range(1, N - 1, every))  # the first run comes after the first decode step
    bar = tqdm(zip(starts, starts[1:] + [N - 1]), total=len(starts), desc=f"{recipe.name} @ {cap}", mininterval=30)
    for t, end in bar:
        score(cm.decode_many(ref_tokens[t:end].view(1, -1))[0], t + 1)
        held.append((end, int(cm.cache.bytes_held().sum())))
    token, seconds = ref_tokens[-1].view(1, 1), []
    for _ in range(timed):
        t0 = time.perf_counter()
        token = cm.decode(token)[:, -1].argmax(-1, keepdim=True)
        seconds.append(time.perf_counter() - t0)
    return kl, hits, same, held, torch.tensor(seconds), cm.cache_stats()


def summarize(label, cap, n_prompt, kl, hits, same, held, seconds, stats):
    kl_t = torch.tensor(kl)
    after = kl_t[max(cap - n_prompt, 0) :]  # steps where a full cache would be over the cap
    return {
        "recipe": label,
        "cap": cap,
        "tokens_per_s": len(seconds) / float(seconds.sum()),
        # the steps that ran the schedule cost more than a plain step (the median): their extra share of the time
        "run_share": max(0.0, 1 - len(seconds) * float(seconds.median()) / float(seconds.sum())),
        "kl_mean": float(kl_t.mean()),
        "kl_after_cap": float(after.mean()) if after.numel() else 0.0,
        "agree_len": same.index(False) if False in same else len(same),
        "top1": sum(hits) / len(hits),
        "peak_bytes_held": stats["peak_bytes_held"],
        "final_bytes_held": stats["bytes_held"],
        "bytes_allocated": stats["bytes_allocated"],
        "held": held,
        "kl": kl,
    }


def table(result) -> str:
    ref = result["reference"]
    agree = "greedy agree len" if result["meta"]["temperature"] == 0 else "same-draw agree len"
    head = ["policy", "cap (tok/head)", "decode tok/s", "schedule share", "KL mean", "KL after cap", agree,
            "top-1 agree", "peak MiB", "final MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    top = max(b for _, b in ref["held"]) / 2**20
    lines.append(f"| full cache | - | {ref['tokens_per_s']:.1f} | - | 0 | 0 | {len(ref['tokens'])} | 1.000 | "
                 f"{top:.1f} | {top:.1f} |")
    lines += [row(r) for r in sorted(result["runs"], key=lambda r: (r["cap"], r["recipe"]))]
    return "\n".join(lines)


def row(r) -> str:
    return (f"| {r['recipe']} | {r['cap']} | {r['tokens_per_s']:.1f} | {r['run_share']:.0%} | {r['kl_mean']:.4f} | "
            f"{r['kl_after_cap']:.4f} | "
            f"{r['agree_len']} | {r['top1']:.3f} | {r['peak_bytes_held'] / 2**20:.1f} | "
            f"{r['final_bytes_held'] / 2**20:.1f} |")


def plot(result):
    """Bytes held against generated tokens, one panel per cap, the full cache's beside each policy's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({r["cap"] for r in result["runs"]})
    fig, axes = plt.subplots(1, len(caps), figsize=(5.5 * len(caps), 4), squeeze=False, sharey=True)
    for ax, cap in zip(axes[0], caps):
        step, held = zip(*result["reference"]["held"])
        ax.plot(step, [b / 2**20 for b in held], color="black", lw=1, label="full cache")
        for r in sorted((r for r in result["runs"] if r["cap"] == cap), key=lambda r: r["recipe"]):
            step, held = zip(*r["held"])
            ax.plot(step, [b / 2**20 for b in held], lw=1, label=r["recipe"])
        ax.set(title=f"cap {cap} tokens per KV head", xlabel="generated tokens", ylabel="KV MiB held (after each run)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def save(result, out: Results) -> None:
    out.json(result, indent=None)
    if result["runs"]:
        out.markdown(table(result))
        out.figure(plot(result))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--caps", type=lambda s: [int(x) for x in s.split(",")], default=[256, 512, 1024])
    p.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy reference; > 0: sampled with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", type=json.loads, default={}, help='decode schedule overrides, e.g. \'{"every": 16}\'')
    p.add_argument("--reference", help="reuse the reference of an earlier result JSON (same model, prompt, sampling)")
    p.add_argument("--timed", type=int, default=32, help="greedy decode steps timed at the cap, per run")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is steadiest on a shared machine)")
    p.add_argument("--out", help="path stem of what is written (default bench/results/long_generation/long_generation)")
    args = p.parse_args()
    out = Results("long_generation", args.out)
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcompile.load_model(args.model)
    base = kvcompile.apply(model, budget=1.0, recipe="full")
    ids = prompt_ids(tokenizer)
    u = torch.rand(args.tokens, generator=torch.Generator().manual_seed(args.seed))  # one draw per step, shared
    with torch.no_grad():
        if args.reference:
            earlier = json.loads(Path(args.reference).read_text())["reference"]
            tokens, held, tokens_per_s = torch.tensor(earlier["tokens"]), earlier["held"], earlier["tokens_per_s"]
            logps, top = reread(base, ids, tokens)
        else:
            tokens, logps, top, held, tokens_per_s = reference(base, ids, args.tokens, args.timed, args.temperature, u)
    text = tokenizer.decode(tokens)
    words = text.split()
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    result = {
        "meta": {"threads": args.threads, "torch": torch.__version__, "args": vars(args), "prompt": PROMPT,
                 "prompt_tokens": ids.shape[1],
                 "temperature": args.temperature,
                 "decoding": ("greedy" if args.temperature == 0 else f"sampled (temperature {args.temperature}, "
                              f"seed {args.seed})") + " full-cache reference; policies teacher-forced (decode_many)",
                 "tokens_per_s": "greedy decode() steps: the full cache's last --timed steps; a policy's --timed "
                                 "steps right after the reference, at its cap (schedule runs included)"},
        "reference": {"tokens": tokens.tolist(), "tokens_per_s": tokens_per_s, "held": held,
                      "distinct_4grams": len(set(grams)) / max(len(grams), 1), "text_head": text[:600]},
        "runs": [],
    }
    save(result, out)
    for name in args.policies:  # every cap of a policy first: a cut-short run still compares whole policies
        recipe = kvcompile.recipes()[name]
        recipe = dataclasses.replace(recipe, decode={**recipe.decode, **args.schedule})
        label = recipe.tag + "".join(f" {k}={v}" for k, v in args.schedule.items())
        for cap in args.caps:
            with torch.no_grad():
                run = teacher_forced(base, ids, recipe, cap, (tokens, logps, top), args.temperature, u, args.timed)
            result["runs"].append(summarize(label, cap, ids.shape[1], *run))
            save(result, out)
            print(row(result["runs"][-1]), flush=True)
    print(table(result))


if __name__ == "__main__":
    main()
