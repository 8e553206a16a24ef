"""CateKV's calibration: which heads are adaptive, from score variation over samples (``methods.catekv``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..compress import score_all
from ..methods.catekv import CateKV, CateKVHeads, variation
from . import cached_calibration, calibration_runner


def calibrate(model, samples: list[Tensor], scorer: CateKV | None = None, adaptive_fraction: float = 0.4):
    """Adaptive heads [L][Hkv] of a ``CompressedModel``: the ``adaptive_fraction`` of heads with the lowest mean
    coefficient of variation of ``scorer``'s scores over the calibration ``samples`` (each input_ids [1, T]).
    Cached on disk per model and samples.

    Example: ``Recipe("catekv", "catekv", "catekv", allocator_args={"adaptive_heads": calibrate(cm, [ids])})``.
    """
    scorer = scorer or CateKV()
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    ids = torch.cat([s.flatten() for s in samples])
    params = {"scorer": repr(scorer), "adaptive_fraction": adaptive_fraction, "lengths": [s.shape[1] for s in samples]}
    rows = cached_calibration("catekv", model, ids, params, lambda: _measure(model, samples, scorer, adaptive_fraction))
    return tuple(tuple(r) for r in rows)


@torch.no_grad()
def _measure(model, samples, scorer: CateKV, adaptive_fraction: float) -> list[list[bool]]:
    runner = calibration_runner(model, window=scorer.observation_window)
    cv = 0.0
    for ids in samples:
        runner.reset()
        runner.prefill(ids.to(runner.device), compress=False, logits="last")
        scores, _ = score_all(runner.cache, scorer, runner.programs.layers)
        cv = cv + variation(scores)  # [L, 1, Hkv]
    return CateKVHeads(adaptive_fraction).classify(cv)[:, 0].tolist()
