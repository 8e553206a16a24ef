"""Where kvpress's KVzip and kvcompile's ``kvzip`` differ: kvpress's own press, run again with one protocol choice
at a time changed toward kvcompile's, on the prompts of ``bench/compare_kvpress.py`` (same model, token ids and
next-token KL against the full cache as its kvpress step). Run in the kvpress environment, after that script's
``prompts`` step:

    <kvpress venv>/bin/python bench/kvzip_protocol.py --budget 0.1 --prompts 2
    python bench/kvzip_protocol.py --kvcompile --budget 0.1 --prompts 2     # kvcompile's side, its own environment
    python bench/kvzip_protocol.py --kvcompile --recipe kvcompose --dir D   # the same for another recipe

kvpress 0.5.5's ``KVzipPress`` reads the context through the chat template it finds on the tokenizer: the template's
prefix (SmolLM2: the system turn and the user header, 24 tokens) is neither reconstructed nor in the softmax over
which the reconstruction queries' attention is taken, and scores 0 (its first ``n_sink`` tokens are kept anyway), so
those tokens are evicted first; the reconstruction reads "Repeat the previous context exactly." and the template's
assistant header before the copy. kvcompile's ``kvzip`` reconstructs the whole context, alone. The variants:

- ``kvpress``: the press as shipped;
- ``whole context``: the template prefix reconstructed and scored like the rest (``prefix_length`` 0);
- ``context alone``: that, and no instruction or assistant header (kvcompile's protocol);
- ``prefix kept``: as shipped, but the prefix tokens scored highest instead of 0 (kept, never evicted).

``--kvcompile`` measures kvcompile's ``kvzip`` (or ``--recipe kvgrad`` / ``kvcompose``, whose allocators compete
for whole pages too) on the same prompts the same way: as it is (the competition between whole pages), with the
engine's old rounding of token counts down to pages (``whole_pages=False``), and with pages of one token (where
both agree with a token-level selection).

Writes ``bench/results/kvzip_protocol/kvzip_protocol.{json,md}`` (``kvzip_protocol_kvcompile[_<recipe>].*`` with
``--kvcompile``; ``--out`` for another stem).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from pathlib import Path

import torch
from record import Results


def variants():
    from kvpress import KVzipPress

    class WholeContext(KVzipPress):
        def prepare(self, model, tokenizer, prev_postfix_size=8):
            self.prefix_length = 0
            return super().prepare(model, tokenizer, prev_postfix_size)

    class ContextAlone(WholeContext):
        def prepare(self, model, tokenizer, prev_postfix_size=8):
            pairs = super().prepare(model, tokenizer, prev_postfix_size)
            return [(chunk, chunk) for chunk, _ in pairs]

    class PrefixKept(KVzipPress):
        def compress_post(self, model):
            self.score_val[..., : self.prefix_length] = self.score_val.amax() + 1.0
            super().compress_post(model)

    return {"kvpress": KVzipPress, "whole context": WholeContext, "context alone": ContextAlone,
            "prefix kept": PrefixKept}


def kl_and_score(model, tok, prompt, press, full_logits=None):
    """(next-token KL per reference token against ``full_logits``, answer score, logits)."""
    from transformers import DynamicCache

    ctx = torch.tensor([prompt["context"]])
    n = ctx.shape[1]
    for module in model.modules():
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None
    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=ctx, past_key_values=cache)
        ref_cache = copy.deepcopy(cache)
        ids = prompt["reference"]
        logits = model(torch.tensor([ids]), past_key_values=ref_cache,
                       position_ids=torch.arange(n, n + len(ids))[None]).logits[0, :-1]
        question = prompt["question"]
        out = model(torch.tensor([question]), past_key_values=cache,
                    position_ids=torch.arange(n, n + len(question))[None]).logits[0, -1]
        tokens, p = [int(out.argmax())], n + len(question)
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        while tokens[-1] not in eos and len(tokens) < prompt["max_new_tokens"]:
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[p]]))
            tokens.append(int(out.logits[0, -1].argmax()))
            p += 1
    text = tok.decode(tokens, skip_special_tokens=True).lower()
    score = sum(a.lower() in text for a in prompt["answers"]) / len(prompt["answers"])
    if full_logits is None:
        return None, score, logits
    return token_kl(full_logits, logits), score, logits


def token_kl(full_logits, logits) -> list[float]:
    """KL(full || compressed) of the next-token distribution at every position."""
    lp_full, lp = torch.log_softmax(full_logits.float(), -1), torch.log_softmax(logits.float(), -1)
    return (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0).tolist()


def kvcompile_rows(prompts, budget, name="kvzip"):
    """kvcompile's recipe ``name`` (one whose allocator has ``whole_pages``) on ``prompts``, three ways: as it is
    (the competition between whole pages), with the engine's old rounding of token counts down to pages
    (``whole_pages=False``), and with pages of one token; next-token KL over each reference, as ``kl_and_score``."""
    import dataclasses

    import kvcompile

    model, _ = kvcompile.load_model("smollm2-135m")
    full = kvcompile.apply(model, budget=1.0, recipe="full")
    recipe = kvcompile.get_recipe(name)
    counted = dataclasses.replace(recipe, name=f"{name}-rounded",
                                  allocator_args={**recipe.allocator_args, "whole_pages": False})
    variants = {f"{name} (whole pages)": (recipe, 16), "token counts rounded down to pages": (counted, 16),
                "pages of one token": (recipe, 1)}
    rows = []
    for variant, (r, page_size) in variants.items():
        cm, kls = kvcompile.apply(model, budget=budget, recipe=r, page_size=page_size), []
        for q in prompts:
            out = []
            for m in (full, cm):
                m.reset()
                with torch.no_grad():
                    m.prefill(torch.tensor([q["context"]]), logits="last")
                    out.append(m.prefill(torch.tensor([q["reference"]]), compress=False)[0, :-1])
            kls += token_kl(*out)
        rows.append({"variant": variant, "kl_mean": sum(kls) / len(kls)})
        print(f"{variant:<35} KL {rows[-1]['kl_mean']:.3f}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/kvc/kvpress"), help="compare_kvpress.py's --dir")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--prompts", type=int, default=2, help="the first N per task")
    p.add_argument("--kvcompile", action="store_true", help="kvcompile's side (run in kvcompile's environment)")
    p.add_argument("--recipe", default="kvzip", help="--kvcompile: the recipe (kvzip, kvgrad, kvcompose)")
    p.add_argument("--out", default=None, help="path stem of what is written (default: its file in "
                   "bench/results/kvzip_protocol/)")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = json.loads((args.dir / "prompts.json").read_text())
    prompts, per_task = [], {}
    for q in data["prompts"]:
        per_task[q["task"]] = per_task.get(q["task"], 0) + 1
        if per_task[q["task"]] <= args.prompts:
            prompts.append(q)
    suffix = "" if args.recipe == "kvzip" else f"_{args.recipe}"
    results = Results("kvzip_protocol", args.out,
                      name=f"kvzip_protocol_kvcompile{suffix}" if args.kvcompile else "kvzip_protocol")
    rows = (kvcompile_rows(prompts, args.budget, args.recipe) if args.kvcompile
            else kvpress_rows(args.dir, prompts, args.budget))
    meta = {"budget": args.budget, "prompts": len(prompts), "tasks": sorted(per_task), "threads": 1}
    results.json({**meta, "rows": rows})
    side = f"kvcompile's {args.recipe}" if args.kvcompile else "kvpress KVzip, one protocol choice at a time"
    lines = [f"# {side} (budget {args.budget}, {len(prompts)} prompts: the first {args.prompts} of "
             f"{', '.join(sorted(per_task))})", "",
             "| variant | KL mean |" + (" score |" if not args.kvcompile else ""),
             "|---|---|" + ("---|" if not args.kvcompile else "")]
    lines += [f"| {r['variant']} | {r['kl_mean']:.3f} |" + (f" {r['score']:.3f} |" if "score" in r else "")
              for r in rows]
    results.markdown("\n".join(lines))


def kvpress_rows(folder, prompts, budget):
    """kvpress's KVzip and the variants on ``prompts``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder / "model", attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(folder / "model")
    rows, t0 = [], time.perf_counter()
    full = [kl_and_score(model, tok, q, None)[2] for q in prompts]
    for name, press in variants().items():
        kls, scores = [], []
        for q, f in zip(prompts, full):
            kl, score, _ = kl_and_score(model, tok, q, press(compression_ratio=1 - budget, n_sink=4), f)
            kls += kl
            scores.append(score)
        rows.append({"variant": name, "kl_mean": sum(kls) / len(kls), "score": sum(scores) / len(scores),
                     "scores": scores})
        print(f"{name:<15} KL {rows[-1]['kl_mean']:.3f} score {rows[-1]['score']:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


if __name__ == "__main__":
    main()
