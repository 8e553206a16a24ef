"""DuoAttention's calibration: which heads can stream, from the model's own attention on offline text
(``methods.duoattention``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..methods.duoattention import streaming_error
from ..observation import observe
from . import cached_calibration, calibration_runner


def calibrate(model, samples: list[Tensor], sinks: int = 4, recent: int = 64) -> tuple[tuple[float, ...], ...]:
    """Head scores [L][Hkv] of a ``CompressedModel``: per layer and KV head, the output error of the streaming mask
    (the first ``sinks`` and each query's ``recent`` newest keys; ``methods.duoattention.streaming_error``) over
    every query of the calibration ``samples`` (each input_ids [1, T]), averaged over samples; higher = retrieval.
    Cached on disk per model weights, samples and window (``calibration.cached_calibration``).

    Inferred: DuoAttention trains a gate per head (hidden-state distillation on passkey haystacks) and reads its
    value; this measures directly what that gate trades off, with no training.

    Example: ``samples = [torch.tensor([w]) for w in kvcompile.eval.fidelity.prose_windows(tok, 8, 512)]``, then
    ``kvcompile.recipes.compose`` or ``Recipe("duo-smol", "duoattention", "fill-eligible",
    {"head_scores": calibrate(cm, samples)})``."""
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 or s.shape[1] < 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    if sinks < 0 or recent < 1:
        raise ValueError(f"need sinks >= 0 and recent >= 1, got {sinks}, {recent}")
    ids = torch.cat([s.flatten() for s in samples])
    params = {"lengths": [s.shape[1] for s in samples], "sinks": sinks, "recent": recent}
    rows = cached_calibration("duoattention", model, ids, params, lambda: _measure(model, samples, sinks, recent))
    return tuple(tuple(layer) for layer in rows)


@torch.no_grad()
def _measure(model, samples: list[Tensor], sinks: int, recent: int) -> list[list[float]]:
    runner = calibration_runner(model, window=max(s.shape[1] for s in samples))
    total = torch.zeros(runner.spec.num_layers, runner.spec.num_kv_heads, dtype=torch.float64)
    for ids in samples:
        runner.reset()
        runner.prefill(ids.to(runner.device), compress=False, logits="last")
        for layer in runner.programs.layers:
            total[layer.index] += streaming_error(observe(runner.cache, layer), sinks, recent)[0].double().cpu()
    return (total / len(samples)).tolist()
