"""LU-KV's calibration: a budget curve (``methods.lukv``) from how well each head's scores predict later attention.

Inferred: the paper's curve-generation code was not readable here. What it names (per-context statistics, then an
average; a global combinatorial optimisation of future utility) is filled in as follows. For each calibration text,
the context is all but its last ``future`` tokens. A head's utility curve U_h(k) is the attention the ``future``
queries pay to the k context tokens its scorer ranks highest (mean over its GQA group). The best global allocation
of K tokens maximises the sum of U_h(k_h): greedy on marginal gains, which is exact once each curve is replaced by
its least concave majorant (antitonic gains). The curve's row for ratio r holds 1 - k_h / n at K = (1 - r) * heads
* n, averaged over the texts."""

from __future__ import annotations

import torch
from torch import Tensor

from ..compress import score_all
from ..methods import SCORERS
from ..methods.lukv import RATIOS
from ..methods.observed_attention import ObservedAttention
from . import cached_calibration, calibration_runner


def calibrate(model, samples: list[Tensor], *, scorer: str = "expected-attention", scorer_args: dict | None = None,
              future: int = 128) -> tuple:
    """The LU-KV curve [99][L][Hkv] of a ``CompressedModel`` for ``scorer``, from calibration ``samples`` (each
    input_ids [1, T], T > ``future``; the same length keeps the curve's rows comparable). Cached on disk per model,
    samples and parameters.

    Example: ``Recipe("lukv-cal", "expected-attention", "lukv", allocator_args={"curve": calibrate(cm, texts)})``."""
    scorer_args = dict(scorer_args or {})
    if scorer not in SCORERS:
        raise ValueError(f"lukv calibration: unknown scorer {scorer!r}; known: {sorted(SCORERS)}")
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 or s.shape[1] <= future for s in samples):
        raise ValueError(f"samples must be a non-empty list of input_ids of shape [1, T] with T > future={future}")
    ids = torch.cat([s.flatten() for s in samples])
    params = {"scorer": scorer, "scorer_args": scorer_args, "future": future, "lengths": [s.shape[1] for s in samples]}
    curve = cached_calibration("lukv", model, ids, params,
                               lambda: _measure(model, samples, SCORERS[scorer](**scorer_args), future))
    return tuple(tuple(tuple(layer) for layer in row) for row in curve)


@torch.no_grad()
def _measure(model, samples, scorer, future: int) -> list:
    curve = 0.0
    for ids in samples:
        context = ids[:, :-future]
        ranking = _scores(model, context, scorer, scorer.observation_window)  # [L, Hkv, n]
        n = ranking.shape[-1]
        utility = _scores(model, ids, ObservedAttention(window=future), future)[..., :n]
        gains = utility.gather(-1, ranking.argsort(dim=-1, descending=True, stable=True))
        curve = curve + prune_curve(antitonic(gains.flatten(0, 1).double()).reshape(gains.shape))
    return (curve / len(samples)).tolist()


def _scores(model, ids: Tensor, scorer, window: int) -> Tensor:
    """[L, Hkv, T] ``scorer``'s scores of every token of ``ids`` [1, T], prefilled uncompressed."""
    runner = calibration_runner(model, window=window)
    runner.prefill(ids.to(runner.device), compress=False, logits="last")
    scores, _ = score_all(runner.cache, scorer, runner.programs.layers)
    return scores[:, 0].cpu()


def antitonic(gains: Tensor) -> Tensor:
    """Rows [N, n] of marginal gains made non-increasing by pooling adjacent violators: the gains of each row's
    least concave majorant of its cumulative sum, so greedy allocation over the rows is exact."""
    out = []
    for row in gains.tolist():
        blocks: list[list[float]] = []  # [sum, count] of pooled runs
        for g in row:
            blocks.append([g, 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
                s, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += c
        out.append([s / c for s, c in blocks for _ in range(c)])
    return torch.tensor(out, dtype=gains.dtype)


def prune_curve(gains: Tensor) -> Tensor:
    """[99, L, Hkv] prune ratios from non-increasing gains [L, Hkv, n]: for ratio r, the greedy keeps the
    (1 - r) * L * Hkv * n largest gains of all heads; a head prunes what it does not get."""
    L, Hkv, n = gains.shape
    order = gains.flatten().argsort(descending=True, stable=True)
    head = torch.arange(L * Hkv).repeat_interleave(n)[order]  # the head of each gain, best first
    rows = []
    for r in range(1, RATIOS + 1):
        keep = round((1 - r / 100) * L * Hkv * n)
        rows.append(1 - torch.bincount(head[:keep], minlength=L * Hkv).double() / n)
    return torch.stack(rows).reshape(RATIOS, L, Hkv)
