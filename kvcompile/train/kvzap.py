"""Training data and training for KVzap (``methods.kvzap``): per (layer, KV head), what the cache holds of a token
-> the log of the KVzip score the library's own KVzip scorer gives it.

Targets are read where KVzip reads them: the context is prefilled uncompressed under the ``kvzip`` recipe, its
reconstruction prompt is run by ``CompressedModel.observing`` (exactly as a ``kvzip`` compression would), and
each layer's KVzip scores and token features come from the same ``Observation``. The sinks KVzip pins carry no
score and are left out. Contexts are generated offline: the synthetic tasks' contexts at several lengths and
prose windows of Python's bundled documentation (``eval.synthetic``, ``eval.fidelity``).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor
from tqdm import tqdm

from ..attention_inputs import attention_inputs
from ..eval.fidelity import prose_windows
from ..eval.synthetic import make_sample
from ..methods.base import is_pinned
from ..methods.fastkvzip import Gate
from ..methods.kvzap import Surrogate, token_features
from ..observation import observe

TASKS = ("niah_single_1", "niah_multikey_2", "vt", "cwe", "passkey", "fwe")


def contexts(tokenizer, lengths: tuple[int, ...], per_length: int, seed: int) -> list[list[int]]:
    """``per_length`` contexts of about each length: task contexts (cycling through ``TASKS``) and, every third
    or where a task does not fit, a prose window; deterministic for ``seed`` (held-out sets use another seed)."""
    out = []
    for length in lengths:
        for i in range(per_length):
            task, text = TASKS[(i + seed) % len(TASKS)], None
            try:
                if i % 3 != 2:
                    text = make_sample(task, tokenizer, length, seed=seed, index=i).prompt(tokenizer)[0]
            except ValueError:  # the task does not fit this length (a short length, a byte-level tokenizer)
                pass
            out.append(prose_windows(tokenizer, 1, length, seed=seed * 1009 + i)[0] if text is None
                       else tokenizer(text, add_special_tokens=False)["input_ids"][:length])
    return out


@torch.no_grad()
def kvzip_examples(cm, texts: list[list[int]], per_context: int, seed: int, progress: bool = True,
                   inputs: str = "cache") -> tuple[Tensor, Tensor]:
    """(features [L, Hkv, N, F], log KVzip scores [L, Hkv, N]) of up to ``per_context`` random tokens of each
    context (every token when it has fewer), from ``cm`` (a ``CompressedModel`` of the model) under ``kvzip``;
    the features are ``KVzap.inputs``: ``token_features`` ("cache") or each layer's attention input ("hidden")."""
    import kvcompile

    runner = kvcompile.apply(cm, budget=0.5, recipe="kvzip")
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for ids in tqdm(texts, desc="KVzip targets", unit="context", disable=not progress, file=sys.stderr):
        runner.reset()
        runner.prefill(torch.tensor([ids], device=runner.device), compress=False, logits="last")
        feats, logs, positions = [], [], None
        if inputs == "hidden":
            real = torch.ones(1, len(ids), dtype=torch.bool, device=runner.device)
            hidden = attention_inputs(runner.source, torch.tensor([ids], device=runner.device), real)[:, 0]
        with runner.observing() as (cache, _):
            for layer in runner.programs.layers:
                obs = observe(cache, layer)
                scores = runner.scorer.score(obs)[0].float()  # [Hkv, S]
                if positions is None:
                    positions = obs.positions[0]
                    usable = (obs.valid[0] & ~is_pinned(scores) & (scores > 0)).all(0)  # the prompt's: -inf
                    chosen = usable.nonzero()[:, 0]
                    chosen = chosen[torch.randperm(len(chosen), generator=g)[:per_context].sort().values]
                if not torch.equal(obs.positions[0], positions):
                    raise RuntimeError("layers hold different tokens on a fresh prefill")
                x = (token_features(obs.keys[0], obs.values[0])[:, chosen] if inputs == "cache"
                     else hidden[layer.index][positions[:, chosen]])
                feats.append(x.cpu())
                logs.append(scores[:, chosen].log().cpu())
        xs.append(torch.stack(feats))
        ys.append(torch.stack(logs))
    return torch.cat(xs, 2), torch.cat(ys, 2)


def spearman(predicted: Tensor, target: Tensor) -> float:
    """Mean over (layer, KV head) of the Spearman rank correlation over tokens ([L, Hkv, N] each)."""
    def ranks(x):
        return x.argsort(-1).argsort(-1).double()

    a, b = ranks(predicted), ranks(target)
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)).mean())


def surrogate(x: Tensor, y: Tensor, hidden: int, seed: int, group: int = 1) -> Surrogate:
    """A fresh surrogate for features ``x`` [L, Hkv, N, F]: its normalisation set from them, its output bias at the
    mean target of ``y`` [L, Hkv, N] (the ranking within a head is what the weights learn)."""
    L, H, _, F = x.shape
    net = Surrogate(L, H, F, hidden, seed=seed)
    with torch.no_grad():
        net.mean.copy_(x.mean(2))
        net.std.copy_(x.std(2).clamp_min(1e-4))
        net.b.copy_(y.mean(2))
    return net


def gate(x: Tensor, y: Tensor, hidden: int, seed: int, group: int = 1) -> Gate:
    """A fresh FastKVzip gate (``methods.fastkvzip``; one form: ``hidden`` must be 0) for attention inputs ``x``
    [L, Hkv, N, F] and ``group`` query heads per KV head; its logit bias is set so that an untrained gate
    predicts about the mean target of ``y`` [L, Hkv, N] (log gate ~ own logit - log sinks while the gate is small).
    """
    if hidden:
        raise ValueError(f"the fastkvzip gate has one form (rank 16, 16 sinks); hidden must be 0, got {hidden}")
    L, H, _, F = x.shape
    net = Gate(L, H, group, F, seed=seed)
    with torch.no_grad():
        net.b.copy_((y.mean(2) + math.log(net.sinks.shape[2])).unsqueeze(-1).expand_as(net.b))
    return net


@torch.no_grad()
def fit_ridge(net: Surrogate, x: Tensor, y: Tensor, penalty: float) -> None:
    """Set ``net`` (linear, from ``surrogate``: its normalisation and bias already fitted) to the ridge regression of
    ``y`` [L, Hkv, N] on the normalised ``x`` [L, Hkv, N, F], per (layer, KV head), in closed form: kvpress fits
    KVzap's linear form as a ridge regression. ``penalty``: lambda on the normalised features."""
    xn = (x - net.mean[:, :, None]) / net.std[:, :, None]
    gram = xn.transpose(-1, -2) @ xn + penalty * torch.eye(x.shape[-1])
    net.w.copy_(torch.linalg.solve(gram, xn.transpose(-1, -2) @ (y - net.b[..., None])[..., None])[..., 0])


def mse(x: Tensor, y: Tensor):
    """The loss over the minibatch ``indices`` of the examples (x, y)."""
    def loss(net, indices):
        return (net(x[:, :, indices]) - y[:, :, indices]).square().mean()
    return loss
