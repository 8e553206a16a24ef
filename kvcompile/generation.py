"""The generation loop: sample a token, decode it, repeat; finished rows are padded on the device.

The loop never waits for the device at a step: whether every row has finished is read back once every
``CHECK_EVERY`` steps (a decode-time schedule's runs and page reservations sync on their own, less often), and
the steps taken after the last row finished are cut from the output at the end, so the result is what stopping at
once would give.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHECK_EVERY = 16  # steps between reads of "has every row finished?"


def sample(logits: Tensor, do_sample: bool, temperature: float, top_p: float, generator) -> Tensor:
    """The next token [B] from logits [B, V]: argmax, or a draw at ``temperature`` from the top-``top_p`` nucleus."""
    if not do_sample:
        return logits.argmax(-1)
    return torch.multinomial(nucleus(logits, temperature, top_p), 1, generator=generator).squeeze(-1)


def nucleus(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """[..., V] the weights ``sample`` draws from: softmax at ``temperature``, zero outside the smallest set of the
    likeliest tokens whose mass reaches ``top_p`` (not renormalised: ``multinomial`` normalises)."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    return probs


def generate_tokens(decode, logits: Tensor, max_new_tokens: int, eos: Tensor, pad: int, sampling: dict,
                    stop=None, heads: list[str] | None = None) -> Tensor:
    """Up to ``max_new_tokens`` tokens [B, n] after the prefill's last ``logits`` [B, 1, V]; ``decode(token [B, 1])``
    appends a token and returns its logits. Stops once every row has produced an ``eos`` id, or ``stop`` (an
    ``early_stop.EarlyStop``, read on the host at every step) has found its answer settled (``heads``: each row's
    prompt's open step)."""
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    rows = [[] for _ in range(logits.shape[0])]  # the tokens of each row, on the host (with ``stop`` only)
    new = []
    for step in range(max_new_tokens):
        token = sample(logits[:, -1], **sampling).masked_fill(done, pad)
        new.append(token)
        done |= torch.isin(token, eos)
        if stop is not None:
            done |= settled(stop, rows, heads, token, done)
        if step == max_new_tokens - 1 or ((stop is not None or (step + 1) % CHECK_EVERY == 0) and bool(done.all())):
            break
        logits = decode(token[:, None])
    out = torch.stack(new, 1)
    if eos.numel():  # cut the steps taken after the last row finished
        finished = torch.isin(out, eos).cummax(1).values.all(0)  # [n] every row has finished by this step
        if bool(finished.any()):
            out = out[:, : int(finished.int().argmax()) + 1]
    return out


def settled(stop, rows: list[list[int]], heads: list[str], token: Tensor, done: Tensor) -> Tensor:
    """[B] whether each row still generating has just settled its answer (``stop.settled``); ``rows`` grows."""
    out = []
    for row, head, t, finished in zip(rows, heads, token.tolist(), done.tolist()):
        if not finished:
            row.append(t)
        out.append(not finished and stop.settled(row, head))
    return torch.tensor(out, device=token.device)
