"""The behaviour a refactor must keep: for every named recipe and a set of compositions (wrappers, every page
format), on a fixed tiny model and seed, what the cache keeps, what it holds and what the model then predicts.

Each case applies its recipe through the public API, reads a left-padded two-row context, compresses it, reads a
question and generates a few tokens, then records per (layer, row, KV head) the positions the cache holds, its
``bytes_held`` (total and per row), ``budget_bytes``, the generated tokens and the logits of one more decode step.
A case that is refused records the refusal's message. ``tests/test_golden.py`` replays every case and compares
(logits within ``ROUNDING`` of fp32 summation order, or the wider ``TOLERANCE`` a case names with its reason).

Record anew only for a change meant to change behaviour, never for a refactor:
``python tests/golden.py --record tests/golden/behaviour.json.gz``. Recorded and replayed with the native CPU
kernels wherever they read the pages (``NATIVE``), never chosen by timing, which may differ from run to run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, spelled, tiny_model  # noqa: E402

import kvcompile  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "behaviour.json.gz"
SEED = 20261207
CONTEXT = (180, 131)  # the two rows' context lengths (left padded)
QUESTION = 5
NEW_TOKENS = 5
BUDGET = 0.3
# compositions beside the named recipes: kvpress's wrappers and every page format
COMPOSITIONS = (
    "chunkkv+snapkv", "adakv+knorm", "merging+snapkv", "decoding+knorm", "block+snapkv", "chunk+snapkv",
    "per-layer+snapkv", "key-rerotation+snapkv", "entropy-gated-chunkkv+snapkv", "compression-ratio-decoding+knorm",
    "ta-fast+snapkv", "ta+snapkv",
    "full+fp16", "full+bf16", "full+fp8", "full+int8", "snapkv+int4", "snapkv+int3", "full+int2", "snapkv+k8v4",
    "full+kivi4", "snapkv+kivi2", "snapkv+think", "full+tq3", "full+anchor2",
)
# the other budget forms and model families: ``[family:]recipe[@budget]``
VARIANTS = ("snapkv@24", "snapkv@20KiB", "adakv-snapkv@24", "gemma3:snapkv", "gemma3:snapkv+int4", "qwen3:snapkv",
            "gemma3:full+int8", "qwen3:adakv-snapkv+int4",
            # the formats that evict nothing, at budgets that fit them
            "kivi2@1.0", "kivi4@1.0", "minima-kv@1.0", "anchorkv@0.5", "think@1.0", "snapkv+kivi2@0.5")
# learned recipes run on the model they were trained for, not on a tiny random one
UNTRAINED = "trained for another model"
NATIVE = {"KVCOMPILE_DECODE_BACKEND": "native"}  # the environment of every case
# cases whose comparison may not be bitwise, with the reason. Their page format's pool is read by the multi-token
# attention (the question, the decode steps of a sliding layer), which became one fused flash-attention call on the
# CPU (issue 53): the same kept positions, bytes and tokens, logits within fp32 rounding of another summation order
# (largest difference seen 3.2e-5, on Qwen3's one KV head; 1.2e-6 on the others).
# Every other case reads its question over held entries as two flash-attention calls merged by log-sum-exp (the
# held part without a mask, the question's own keys causal: ``kernels.reference.after_held``, issue 53), where one
# masked call read it before: the same kept positions, bytes and tokens, logits within ``ROUNDING`` (largest
# difference seen 1.2e-7).
ROUNDING = 1e-6
TOLERANCE: dict[str, float] = dict.fromkeys((
    "anchorkv@0.5", "full+anchor2", "full+bf16", "full+fp16", "full+fp8", "full+int2", "full+int8", "full+kivi4",
    "full+tq3", "gemma3:full+int8", "gemma3:snapkv+int4", "kivi2@1.0", "kivi4@1.0", "minima-kv@1.0",
    "qwen3:adakv-snapkv+int4", "saki", "snapkv+int3", "snapkv+int4", "snapkv+k8v4", "snapkv+kivi2",
    "snapkv+kivi2@0.5", "snapkv+think", "spectra", "think@1.0"), 1e-4)


def cases() -> list[str]:
    names = sorted(kvcompile.recipes())
    return names + [c for c in COMPOSITIONS if c not in names] + list(VARIANTS)


def _parse(case: str) -> tuple[str, str, float | int | str]:
    """``[family:]recipe[@budget]`` -> (family, recipe, budget); a recipe that keeps every token ("full", "full+X")
    runs at budget 1.0, the rest at ``BUDGET``."""
    family, _, rest = case.rpartition(":")
    name, _, budget = rest.partition("@")
    if not budget:
        return family or "llama", name, 1.0 if name.split("+")[0] == "full" else BUDGET
    if budget.isdigit():
        return family or "llama", name, int(budget)
    return family or "llama", name, float(budget) if budget.replace(".", "", 1).isdigit() else budget


def _inputs():
    g = torch.Generator().manual_seed(SEED)
    T = max(CONTEXT)
    ctx = torch.randint(2, VOCAB - 1, (len(CONTEXT), T), generator=g)
    ctx_mask = torch.stack([torch.arange(T) >= T - n for n in CONTEXT]).long()
    question = torch.randint(2, VOCAB - 1, (len(CONTEXT), QUESTION), generator=g)
    return ctx, ctx_mask, question


def _held_positions(cm) -> list:
    """[layer][row][KV head] -> the sorted positions that head holds (format entries included)."""
    out = []
    for layer in range(cm.cache.lengths.shape[0]):
        _, _, pos, valid = cm.cache.dense(layer)
        out.append([[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(pos.shape[1])]
                    for b in range(pos.shape[0])])
    return out


def run_case(case: str, models: dict) -> dict:
    family, name, budget = _parse(case)
    recipe = kvcompile.recipes().get(name)
    if recipe is not None and recipe.trained_for:
        return {"skipped": UNTRAINED}
    torch.manual_seed(SEED)
    ctx, ctx_mask, question = _inputs()
    try:
        cm = kvcompile.apply(golden_model(family, models), budget=budget, recipe=_spelled(name), page_size=4)
        tokens = cm.generate(question, context_ids=ctx, context_mask=ctx_mask, max_new_tokens=NEW_TOKENS,
                             eos_token_id=[])
        logits = cm.decode(tokens[:, -1:])[:, -1].float()
    except ValueError as e:
        return {"refused": str(e)}
    stats = cm.cache_stats()
    return {
        "held": _held_positions(cm),
        "bytes_held": int(stats["bytes_held"]),
        "bytes_held_rows": [int(x) for x in cm.cache.bytes_held().tolist()],
        "budget_bytes": None if stats["budget_bytes"] is None else int(stats["budget_bytes"]),
        "tokens": tokens.tolist(),
        "logits": [[float(x).hex() for x in row] for row in logits.tolist()],
    }


def _spelled(name: str):
    """The recipe resolved for the tiny vocabulary; one that needs a real tokenizer's text (delimiters) as named."""
    try:
        return spelled(name)
    except AttributeError:
        return name


def golden_model(family: str, models: dict):
    """The tiny model of ``family`` (2 layers, fixed seed), made once per run into ``models``."""
    if family not in models:
        models[family] = tiny_model(family, seed=3)
    return models[family]


def record(path: Path, only: list[str] | None = None) -> dict:
    models, out = {}, {}
    for name in only or cases():
        start = time.perf_counter()
        out[name] = run_case(name, models)
        print(f"{name:40s} {time.perf_counter() - start:5.1f} s  {next(iter(out[name]))}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"seed": SEED, "torch": torch.__version__, "cases": out}, f, sort_keys=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True, help="where to write the golden file")
    parser.add_argument("--only", nargs="*", help="these cases only")
    args = parser.parse_args()
    os.environ.update(NATIVE)
    record(args.record, args.only)
