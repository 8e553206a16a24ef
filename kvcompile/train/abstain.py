"""Compression-aware abstention (docs/methods_learned.md#abstain-kvzip, issue 17's ``abstain``): a LoRA adapter
(``kvcompile.adapters``) that answers when the compressor kept the answer's evidence and says ``REFUSAL`` when it did
not.

Labels come from survival. Each offline needle sample's context is compressed query-agnostically by one of
``COMPRESSORS`` (recipe, budget; the card's mix of KVzip and SnapKV masks); a token of the answer span survives when at
least ``rule`` of the (layer, KV head) pairs keep it, and the span when all its tokens do (the rule, with ``RULE`` = 0.1
of the pairs rather than half, is inferred). Confident samples are trained to their gold answer, the others to
``REFUSAL``, by next-token loss on that target while the model reads the compressed context (``eval.analysis.masked``,
one pass: the card's "cc" variant). ``outcomes`` measures the served path (the recipe applied to the model, merged with
the adapter or not): answered correctly, hallucinated (answered, wrongly) or abstained, split by whether the evidence
survived there.
The paper was not read: the refusal string, the rule, the compressors and the loss details are inferred.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch import Tensor
from torch.nn import functional as F
from tqdm import tqdm

from ..adapters import Adapter
from ..eval.analysis.diagnose import evidence_positions
from ..eval.analysis.masked import kept, masking
from ..eval.decoding import answer, encode, ids_tensor, read_question
from ..eval.synthetic import make_sample
from .loop import Schedule
from .lora import train_lora

REFUSAL = "I cannot find it in the context."
COMPRESSORS = (("kvzip", 0.1), ("snapkv", 0.1), ("kvzip", 0.25), ("snapkv", 0.25))
RULE = 0.1  # not half the pairs: on SmolLM2 at these budgets KVzip keeps an answer token in 4-26% of the
# (layer, KV head) pairs and still answers, so 0.5 labels nearly every sample Abstain (docs/results.md)
TASKS = ("niah_single_1", "niah_multikey_1", "passkey", "niah_single_2")


def survived(keep: Tensor, evidence: list[int], rule: float = RULE) -> bool:
    """Whether every ``evidence`` position is kept by at least ``rule`` of the (layer, KV head) pairs of ``keep``
    [L, Hkv, n]."""
    if not evidence:
        raise ValueError("no evidence positions: the answer does not occur in the context")
    return bool((keep[..., evidence].float().mean((0, 1)) >= rule).all())


def examples(model, tokenizer, n: int, length: int, seed: int, rule: float = RULE, progress: bool = True,
             compressors=COMPRESSORS, control: bool = False) -> list[dict]:
    """``n`` samples, cycling through ``compressors`` and ``TASKS``: ``ids`` [1, context + question + target],
    ``keep`` [L, Hkv, context], ``start`` (where the target begins), ``survived``, the answer's ``evidence``
    positions, and the sample's pieces.
    ``control``: each (layer, KV head) keeps a uniformly random set of as many tokens as the compressor kept (the
    card's random-mask control), and the label follows that set."""
    import kvcompile

    cm, out = model, []
    for i in tqdm(range(n), desc="labels", unit="sample", disable=not progress, file=sys.stderr):
        recipe, budget = compressors[i % len(compressors)]
        sample = make_sample(TASKS[i // len(compressors) % len(TASKS)], tokenizer, length, seed=seed, index=i)
        context, question = sample.prompt(tokenizer)
        ctx, q = encode(tokenizer, context), encode(tokenizer, question)
        cm = kvcompile.apply(cm, budget=budget, recipe=recipe)  # re-targeted: one capture for all
        cm.prefill(ids_tensor(ctx, cm.device), logits="last")
        keep = kept(cm.held_positions(), len(ctx))
        if control:
            draw = torch.rand(keep.shape, generator=torch.Generator().manual_seed(seed * 1009 + i))
            keep = draw.argsort(-1).argsort(-1) < keep.sum(-1, keepdim=True)
        evidence = evidence_positions(tokenizer, context, sample.answers)
        ok = survived(keep, evidence, rule)
        target = encode(tokenizer, " " + (sample.answer if ok else REFUSAL)) + [tokenizer.eos_token_id]
        out.append({"ids": torch.tensor([ctx + q + target]), "keep": keep, "start": len(ctx) + len(q),
                    "survived": ok, "sample": sample, "context": ctx, "evidence": evidence, "question": q,
                    "recipe": recipe, "budget": budget})
    return out


def loss(model, data: list[dict]):
    """The minibatch loss for ``train.loop.fit``: next-token cross-entropy on the targets, reading the kept context."""
    def value(adapter: Adapter, indices) -> Tensor:
        total = 0.0
        for i in indices:
            example = data[int(i)]
            with adapter.installed(model), masking(model):
                logits = model(example["ids"], kvc_keep=example["keep"]).logits[0, example["start"] - 1 : -1]
            total = total + F.cross_entropy(logits.float(), example["ids"][0, example["start"]:])
        return total / len(indices)
    return value


@torch.no_grad()
def outcomes(model, tokenizer, data: list[dict], adapter: Adapter | None = None, rule: float = RULE) -> dict:
    """Rates over ``data`` on the served path: {"evidence kept" | "evidence lost": {"correct", "hallucinated",
    "abstained"}} and the same over all samples ("all"), with the counts ("n")."""
    import kvcompile

    cm = adapter.merged(model) if adapter is not None else model
    counts: dict[str, Counter] = {"all": Counter(), "evidence kept": Counter(), "evidence lost": Counter()}
    max_new = len(encode(tokenizer, " " + REFUSAL)) + 4
    for example in data:
        cm = kvcompile.apply(cm, budget=example["budget"], recipe=example["recipe"])
        cm.prefill(ids_tensor(example["context"], cm.device), logits="last")
        sample = example["sample"]
        kept_here = survived(kept(cm.held_positions(), len(example["context"])), example["evidence"], rule)
        text = tokenizer.decode(answer(cm, tokenizer, read_question(cm, example["question"]), max_new))
        outcome = ("abstained" if REFUSAL.lower()[:20] in text.lower()
                   else "correct" if sample.score(text) == 1.0 else "hallucinated")
        for group in ("all", "evidence kept" if kept_here else "evidence lost"):
            counts[group][outcome] += 1
    return {group: {"n": sum(c.values()), **{k: c[k] / max(1, sum(c.values()))
                                               for k in ("correct", "hallucinated", "abstained")}}
            for group, c in counts.items()}


def finetune(model, tokenizer, *, name: str, schedule: Schedule = Schedule(steps=100, batch=2, lr=2e-3),
             rank: int = 8, length: int = 512, n: int = 48, held_out: int = 24, rule: float = RULE,
             control: bool = False, out=None, run_dir=None, progress: bool = True) -> dict:
    """Train the abstention adapter for ``model`` on ``n`` labelled samples of ``length`` tokens and write it as
    ``abstain-<name>.safetensors`` + card; the card's ``held_out`` holds ``outcomes`` on ``held_out`` samples from
    another seed, with the adapter and without it (the model itself: B starts at zero). ``control``: train on
    random masks instead (``examples``), written as ``abstain-control-<name>``; held out on the real compressors."""
    data = examples(model, tokenizer, n, length, schedule.seed, rule, progress, control=control)
    held = examples(model, tokenizer, held_out, length, schedule.seed + 1000, rule, progress)
    card = {"compressors": [list(c) for c in COMPRESSORS], "tasks": list(TASKS), "refusal": REFUSAL,
            "rule": f"a token survives if kept in >= {rule} of the (layer, KV head) pairs; the span if all do",
            "data": {"length": length, "samples": n, "confident": sum(e["survived"] for e in data),
                     "held_out_samples": held_out, "held_out_confident": sum(e["survived"] for e in held)},
            "examples_seen": schedule.steps * min(schedule.batch, n),
            "mean_tokens_per_example": round(sum(e["ids"].shape[1] for e in data) / n)}

    def measure(adapter):
        return {"held_out": {"adapter": outcomes(model, tokenizer, held, adapter, rule),
                             "no_adapter": outcomes(model, tokenizer, held, None, rule)}}

    card["control"] = "random masks at the compressors' retention" if control else "none"
    return train_lora(model, "abstain-control" if control else "abstain", name, loss(model, data), n, measure, card,
                      schedule=schedule, rank=rank, out=out, run_dir=run_dir, progress=progress,
                      ylabel="cross-entropy on the target")
