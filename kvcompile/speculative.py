"""Lossless speculative decoding with a compressed draft: inferred ("memory-augmented drafting", whose
paper was not found: built as its one-line description says, with the standard speculative sampling rule of
Leviathan et al. 2023 and Chen et al. 2023).

A draft ``CompressedModel`` (the same model over a small budget, ``kvcompile.apply(target, budget=0.1)``, which
shares the target's programs; or another model over the same vocabulary) proposes ``k`` tokens, one decode step
each, over its compressed cache. The target reads the last emitted token and the ``k`` proposals in one program call
over its own cache (the prefill program on a non-empty cache, as ``decode_many``), which gives p_1 .. p_{k+1}. It
keeps proposal x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection it draws a replacement from
norm(max(0, p_i - q_i)); after k acceptances it draws a bonus token from p_{k+1}. Each emitted token is then
distributed exactly as the target's own next token (greedy: the target's argmax). p and q are the distributions
``generate`` samples from (``generation.nucleus``: one temperature and top-p for both). Both caches take the rejected
tokens back through ``CompressedModel.rewind``; a recipe that changes its cache while decoding is refused, as the
tokens it would take back may already have been compressed. Everything here is a function over the models' public
calls (``read_prompt``, ``decode``, ``decode_many``, ``rewind``): ``CompressedModel.generate`` calls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from . import checks
from .generation import nucleus, sample


@dataclass
class SpeculationStats:
    """Counts of the last speculative ``generate``: target calls (``rounds``), tokens drafted and accepted, and the
    wall seconds of the rounds (both prompts' prefills excluded: what a benchmark compares with plain decoding)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens the target kept (NaN when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")


def acceptance(p: Tensor, q: Tensor) -> Tensor:
    """[..., V] the probability that the target keeps each token the draft may propose: min(1, p / q) (0 where q is
    0: never proposed). ``p``, ``q`` [..., V]: the target's and the draft's distributions."""
    return torch.where(q > 0, p / q, 0.0).clamp(max=1.0)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """[..., V] what a rejected proposal is redrawn from: max(0, p - q), normalised (p where it is all zero: p = q
    rejects nothing)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def distribution(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """[..., V] the distribution ``generation.sample`` draws a token from, normalised."""
    w = nucleus(logits, temperature, top_p)
    return w / w.sum(-1, keepdim=True)


def check_draft(target, draft, k: int, input_ids: Tensor) -> None:
    """Refuse, before anything changes, a draft that cannot propose for ``target`` (no draft: nothing to do). A
    prompt the draft cannot read it refuses itself, in ``read_prompt``, which ``generate`` calls before the
    target's."""
    if draft is None:
        return
    if not isinstance(draft, type(target)) or draft is target:
        raise ValueError("draft must be another CompressedModel, with its own cache (kvcompile.apply(model, "
                         f"budget=0.1) shares this model's programs), got {type(draft).__name__}")
    checks.positive_int("draft_tokens", k)
    if draft.programs.vocab_size != target.programs.vocab_size:
        raise ValueError(f"the draft's vocabulary has {draft.programs.vocab_size} tokens and this model's "
                         f"{target.programs.vocab_size}: a draft must share the target's tokenizer")
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative generate reads one sequence at a time, got a batch of {input_ids.shape[0]}")
    for who, model in (("this model", target), ("the draft", draft)):
        checks.rewinds(who, model.recipe, model.schedule)


def speculate(target, draft, k: int, logits: Tensor, max_new_tokens: int, eos: Tensor, sampling: dict,
              stats: SpeculationStats) -> Tensor:
    """The new tokens [1, n] after the prompt both models have read (``read_prompt``; ``logits`` [1, 1, V]: the
    target's last), drafted ``k`` at a time by ``draft``, verified by ``target`` and rolled back (``rewind``) until
    ``max_new_tokens`` or an ``eos`` id; the last round drafts fewer than ``k`` where fewer tokens are left (none: a
    plain decode step). ``stats`` counts the rounds."""
    start, eos = time.perf_counter(), set(eos.tolist())
    tokens = [int(sample(logits[:, -1], **sampling))]
    emitted = unread = tokens[:]  # the last round's tokens; those the draft has not read yet (1 or 2)
    while len(tokens) < max_new_tokens and not eos.intersection(emitted):
        n = min(k, max_new_tokens - len(tokens) - 1)  # a round emits at most n + 1 tokens
        proposed, q = _propose(draft, unread, n, sampling)
        p_logits = _read(target, [tokens[-1], *proposed])[0]  # [n + 1, V]: p_1 .. p_{n+1}
        kept, token = _verify(p_logits, q, proposed, sampling)
        stats.rounds, stats.drafted, stats.accepted = stats.rounds + 1, stats.drafted + n, stats.accepted + kept
        if kept < n:  # take the rejected proposals back: the target read them all, the draft all but the last
            target.rewind(n - kept)
            draft.rewind(n - 1 - kept)
        emitted = [*proposed[:kept], token]
        tokens += emitted
        unread = [*(proposed[-1:] if kept == n else []), token]  # all kept: the draft never read the last
    stats.seconds = time.perf_counter() - start  # every round read its tokens back: nothing is in flight
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return torch.tensor([tokens[: ends[0] + 1] if ends else tokens], device=target.device)


def _read(model, tokens: list[int]) -> Tensor:
    """Append ``tokens`` to ``model``'s one sequence as that many decode steps, in one program call (``decode``, or
    ``decode_many``'s prefill program); their logits [1, n, V]."""
    ids = torch.tensor([tokens], device=model.device)
    return model.decode(ids) if len(tokens) == 1 else model.decode_many(ids)


def _propose(draft, unread: list[int], n: int, sampling: dict) -> tuple[list[int], list[Tensor]]:
    """``n`` tokens the draft proposes after reading ``unread``, and the logits [V] it proposed each from."""
    proposed, q = [], []
    if n:
        logits = _read(draft, unread)[0, -1]
        for i in range(n):
            q.append(logits)
            proposed.append(int(sample(logits[None], **sampling)))
            if i < n - 1:
                logits = _read(draft, proposed[-1:])[0, -1]
    return proposed, q


def _verify(p_logits: Tensor, q_logits: list[Tensor], proposed: list[int], sampling: dict) -> tuple[int, int]:
    """(proposals kept, the token after them): the first rejected proposal's replacement, or a bonus token from
    the target's last logits. Greedy keeps a proposal equal to the target's argmax."""
    greedy, generator = not sampling["do_sample"], sampling["generator"]
    for i, (x, q_logit) in enumerate(zip(proposed, q_logits)):
        if greedy:
            if x != int(p_logits[i].argmax()):
                return i, int(p_logits[i].argmax())
            continue
        p, q = (distribution(t.to(p_logits.device), sampling["temperature"], sampling["top_p"])
                for t in (p_logits[i], q_logit))
        if float(torch.rand((), generator=generator, device=p.device)) >= float(acceptance(p, q)[x]):
            return i, int(torch.multinomial(residual(p, q), 1, generator=generator))
    return len(proposed), int(sample(p_logits[-1:], **sampling))
