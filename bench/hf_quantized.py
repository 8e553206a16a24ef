"""transformers' ``QuantizedCache`` (the quanto backend) as a row of the formats table: quality, bytes and speed.

The cache a transformers user picks to quantize KV: KIVI-style groups (``q_group_size`` along the channels), the
newest ``residual_length`` tokens kept in the model's dtype, and at every step the whole quantized cache
dequantized into a fresh dense copy for attention. Same protocol as ``bench/formats.py`` (the offline needle and
pass-key tasks, the context read first, then the question, greedy answer; KL of the teacher-forced full-cache
answer), but through transformers' own forward, since this cache is not a kvcompile format. Bytes held: every
tensor the cache keeps after the context (quantized payload, scales, shifts, residual tokens), against the fp32
``DynamicCache``; the transient dense copy each step makes is not counted. Speed: decode ms/token after the same
context, against ``DynamicCache``, in the same run.

    pip install -e ".[bench,quanto]"
    python bench/hf_quantized.py --samples 20 --length 1024

Writes ``bench/results/hf_quantized/hf_quantized.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import Results
from transformers import DynamicCache, QuantizedCache

import kvcompile
from kvcompile.eval.synthetic import get_task, make_sample


def held_bytes(cache) -> int:
    """Bytes of every tensor ``cache`` keeps, the inner tensors of quanto's quantized ones included."""
    def size(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()
    return sum(size(v) for layer in cache.layers for v in vars(layer).values())


def new_cache(model, nbits: int | None, residual: int):
    if nbits is None:
        return DynamicCache()
    return QuantizedCache(backend="quanto", config=model.config, nbits=nbits, residual_length=residual,
                          q_group_size=64, axis_key=0, axis_value=0)


@torch.no_grad()
def read_context(model, context, nbits, residual):
    """A new cache holding ``context``, and the bytes it holds (quanto's tensors cannot be deep-copied, so each
    use of a context cache reads the context again)."""
    cache = new_cache(model, nbits, residual)
    model(torch.tensor([context]), past_key_values=cache)
    return cache, held_bytes(cache)


@torch.no_grad()
def answer(model, cache, start: int, question, max_new_tokens: int, eos) -> list[int]:
    """Greedy answer ids to ``question`` read after ``cache`` at positions from ``start``."""
    pos = torch.arange(start, start + len(question))[None]
    out = model(torch.tensor([question]), past_key_values=cache, position_ids=pos, logits_to_keep=1)
    tokens, p = [int(out.logits[0, -1].argmax())], start + len(question)
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[p]]))
        tokens.append(int(out.logits[0, -1].argmax()))
        p += 1
    return tokens


@torch.no_grad()
def forced(model, cache, start: int, reference) -> torch.Tensor:
    """Log-probabilities [T - 1, V] of ``reference`` teacher-forced after ``cache`` (positions from ``start``)."""
    pos = torch.arange(start, start + len(reference))[None]
    logits = model(torch.tensor([reference]), past_key_values=cache, position_ids=pos).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


@torch.no_grad()
def decode_ms(model, nbits, residual, context: int, steps: int, rounds: int) -> float:
    """Median decode ms/token over ``rounds`` of ``steps`` steps after a random ``context``-token prompt."""
    cache = new_cache(model, nbits, residual)
    ids = torch.randint(10, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    model(ids, past_key_values=cache)
    model(torch.tensor([[42]]), past_key_values=cache)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            model(torch.tensor([[42]]), past_key_values=cache)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--tasks", default="niah_single_1,passkey")
    parser.add_argument("--bits", default="4,2")
    parser.add_argument("--residual", type=int, default=128, help="newest tokens kept in the model's dtype")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="path stem of what is written (default bench/results/hf_quantized/hf_quantized)")
    args = parser.parse_args()
    out = Results("hf_quantized", args.out)
    model, tok = kvcompile.load_model(args.model)
    eos = {tok.eos_token_id}
    variants = [None] + [int(b) for b in args.bits.split(",")]
    acc = {v: {"score": [], "kl": [], "top1": [], "held": []} for v in variants}
    for name in args.tasks.split(","):
        task = get_task(name)
        for index in range(args.samples):
            sample = make_sample(task, tok, args.length, seed=0, index=index)
            context, question = (tok(t, add_special_tokens=False)["input_ids"] for t in sample.prompt(tok))
            n = len(context)
            reference = question + answer(model, read_context(model, context, None, 0)[0], n, question,
                                          task.max_new_tokens, eos)
            lp_full = forced(model, read_context(model, context, None, 0)[0], n, reference)
            for v in variants:
                cache, held = read_context(model, context, v, args.residual)
                tokens = answer(model, cache, n, question, task.max_new_tokens, eos)
                lp = forced(model, read_context(model, context, v, args.residual)[0], n, reference)
                acc[v]["kl"] += (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0).tolist()
                acc[v]["top1"] += (lp_full.argmax(-1) == lp.argmax(-1)).float().tolist()
                acc[v]["score"].append(sample.score(tok.decode(tokens, skip_special_tokens=True)))
                acc[v]["held"].append(held)
            print(name, index, {v: acc[v]["score"][-1] for v in variants}, flush=True)
    rows = []
    for v in variants:
        a = acc[v]
        rows.append({"cache": "DynamicCache (fp32)" if v is None else f"QuantizedCache quanto int{v}",
                     "nbits": v, "score": statistics.mean(a["score"]), "kl_mean": statistics.mean(a["kl"]),
                     "top1": statistics.mean(a["top1"]), "bytes_held": statistics.mean(a["held"]),
                     "decode_ms": decode_ms(model, v, args.residual, args.length, args.steps, args.rounds)})
    for r in rows:
        r["bytes_share"], r["speed_vs_dynamic"] = (r[k] / rows[0][k] for k in ("bytes_held", "decode_ms"))
    config = {**{k: v for k, v in vars(args).items() if k != "out"}, "threads": torch.get_num_threads(),
              "transformers": __import__("transformers").__version__,
              "optimum_quanto": __import__("importlib.metadata").metadata.version("optimum-quanto")}
    out.json({"config": config, "rows": rows})
    lines = [f"transformers {config['transformers']} QuantizedCache (optimum-quanto {config['optimum_quanto']}, "
             f"groups of 64, newest {args.residual} tokens in fp32) on {args.model}, {args.tasks} @ {args.length} "
             f"tokens, {args.samples} samples per task, {config['threads']} thread(s). Bytes: what the cache holds "
             "after the context, as a share of the fp32 DynamicCache's. ms/token: decode after the same context.",
             "", "| cache | score | KL | top-1 | bytes share | decode ms/token | vs DynamicCache |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['score']:.2f} | {r['kl_mean']:.3f} | {r['top1']:.2f} | {r['bytes_share']:.3f} "
              f"| {r['decode_ms']:.1f} | {r['speed_vs_dynamic']:.2f}x |" for r in rows]
    out.markdown("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
