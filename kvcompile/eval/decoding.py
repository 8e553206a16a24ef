"""The evaluation read-out: compress the context, read the question over the compressed cache, decode greedily.

Shared by the lm-eval model (``harness``) and the sweep (``sweep``), so both answer a prompt the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model import CompressedModel


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text``, no special tokens (a task prompt's parts, read one after another)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def ids_tensor(ids: list[int], device) -> Tensor:
    return torch.tensor([ids], dtype=torch.long, device=device)


@torch.no_grad()
def read_question(cm: CompressedModel, question: list[int]) -> Tensor:
    """Append ``question`` to an already compressed cache without compressing it; the last logits [V]."""
    return cm.prefill(ids_tensor(question, cm.device), compress=False, logits="last")[0, -1]


@torch.no_grad()
def greedy(cm: CompressedModel, logits: Tensor, max_new_tokens: int, eos_ids=(), stop=None) -> list[int]:
    """Up to ``max_new_tokens`` greedy tokens, the first from ``logits`` [V], the rest decoded over ``cm``'s cache.

    Stops after an ``eos_ids`` token, or when ``stop(tokens)`` (e.g. a stop-string check) returns True. Batch 1;
    the stop checks read each token on the host (an evaluation loop, not the library's decode path).
    """
    tokens: list[int] = []
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos_ids or (stop is not None and stop(tokens)) or step == max_new_tokens - 1:
            break
        logits = cm.decode(ids_tensor([token], cm.device))[0, -1]
    return tokens


def answer(cm, tokenizer, logits: Tensor, max_new_tokens: int) -> list[int]:
    """``greedy`` from ``logits`` [V], stopping at the tokenizer's or the model's end-of-sequence token. ``cm``: a
    ``CompressedModel``, or anything with its ``decode`` and ``device`` (``analysis.masked``)."""
    ids = (tokenizer.eos_token_id, getattr(getattr(cm, "generation_config", None), "eos_token_id", None))
    return greedy(cm, logits, max_new_tokens, eos_ids={t for t in ids if isinstance(t, int)})


@torch.no_grad()
def streamed_log_likelihood(cm: CompressedModel, tokens: Tensor, chunk: int) -> float:
    """Sum of log p(tokens[t+1] | tokens[:t+1]) over ``tokens`` [1, T], reading ``tokens[:, :-1]`` ``chunk`` tokens at
    a time from an empty cache, compressing between chunks (streaming with eviction)."""
    cm.reset()
    total = 0.0
    for start in range(0, tokens.shape[1] - 1, chunk):
        ids = tokens[:, start : min(start + chunk, tokens.shape[1] - 1)]
        logits = cm.prefill(ids, logits="all")[0].float()
        target = tokens[0, start + 1 : start + 1 + ids.shape[1]].to(logits.device)
        total += float(torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum())
    return total
