"""SGD-KV's calibration: per-head scores on a chunk-summarisation diagnostic (``methods.sgdkv``)."""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import Tensor

from ..observation import observe
from . import cached_calibration, calibration_runner


def diagnostic_task(tokenizer, documents: list[str], keywords: int = 3) -> tuple[Tensor, Tensor]:
    """One diagnostic sample: the documents as numbered chunks, an instruction to identify each chunk and list
    keywords summarising it, and the answer (teacher-forced). Returns input_ids [1, T] and keyword_mask [T] (the
    answer's keyword tokens). Inferred: keywords are each chunk's longest words found in no other chunk (the
    paper has the model generate them and keeps correctly answered samples)."""
    words = [re.findall(r"[A-Za-z]{5,}", d) for d in documents]
    seen = Counter(w.lower() for ws in words for w in set(ws))
    prompt = f"Below are {len(documents)} chunks of text. Identify each chunk and list keywords that summarise it.\n\n"
    prompt += "".join(f"Chunk {i + 1}:\n{d}\n\n" for i, d in enumerate(documents)) + "Keywords:\n"
    answer, spans = "", []
    for i, ws in enumerate(words):
        unique = [w for w in dict.fromkeys(ws) if seen[w.lower()] == 1]
        answer += f"Chunk {i + 1}: "
        for j, w in enumerate(sorted(unique, key=len, reverse=True)[:keywords]):
            answer += ", " * (j > 0)
            spans.append((len(prompt) + len(answer), len(prompt) + len(answer) + len(w)))
            answer += w
        answer += "\n"
    enc = tokenizer(prompt + answer, return_offsets_mapping=True)
    mask = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return torch.tensor([enc["input_ids"]]), torch.tensor(mask)


def calibrate(model, input_ids: Tensor, keyword_mask: Tensor) -> tuple[tuple[float, ...], ...]:
    """Head scores [L][Hkv] of a ``CompressedModel`` on one diagnostic sample (``diagnostic_task``): for each
    keyword token, the attention that the query producing it (the previous position) pays to the keyword's
    best-attended occurrence before the first keyword, averaged over keywords and over each GQA group.
    Inferred: token-level matching of occurrences. Cached on disk per model and sample.

    Example: ``kvcompile.Recipe("sgd-kv", "snapkv", "sgd-kv", allocator_args={"head_scores": calibrate(cm, *s)})``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or keyword_mask.shape != input_ids.shape[1:]:
        raise ValueError("input_ids must be [1, T] and keyword_mask [T]")
    if not keyword_mask[1:].any():
        raise ValueError("keyword_mask marks no keyword token after the first position")
    params = {"keywords": keyword_mask.tolist()}
    rows = cached_calibration("sgd-kv", model, input_ids, params, lambda: _measure(model, input_ids, keyword_mask))
    return tuple(tuple(r) for r in rows)


@torch.no_grad()
def _measure(model, input_ids: Tensor, keyword_mask: Tensor) -> list[list[float]]:
    ids, mask = input_ids[0], keyword_mask.bool().clone()
    mask[0] = False
    first = int(mask.nonzero()[0])
    targets = mask.nonzero()[:, 0]  # keyword positions t, produced by the query at t - 1
    occurs = ids[None, :first] == ids[targets][:, None]  # [K, first]
    targets, occurs = targets[occurs.any(-1)], occurs[occurs.any(-1)]
    if targets.numel() == 0:
        raise ValueError("no keyword token occurs before the first keyword: nothing to score")
    T = ids.shape[0]
    runner = calibration_runner(model, window=T - first + 1)
    runner.prefill(input_ids.to(runner.device), compress=False, logits="last")
    spec, out = runner.spec, []
    producer = (runner.cache.ring.positions[0, None, :] == (targets - 1).to(runner.device)[:, None]).int().argmax(-1)
    for layer in runner.programs.layers:
        obs = observe(runner.cache, layer)
        attn = obs.window_attention()[0, :, producer, :first].float()  # [Hq, K, first]
        best = attn.masked_fill(~occurs.to(attn.device), 0.0).amax(-1).mean(-1)  # [Hq]
        out.append(best.reshape(spec.num_kv_heads, -1).mean(-1).tolist())
    return out
