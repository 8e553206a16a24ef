"""Q-Filters' calibration: each head's main query direction, from the model's own queries (``methods.qfilter``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..methods.qfilter import principal_direction, query_moments
from ..observation import observe
from . import cached_calibration, calibration_runner


def calibrate(model, samples: list[Tensor]) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """Q-filters [L][Hkv][D] of a ``CompressedModel``: per layer and KV head, the first right-singular vector of
    the post-RoPE queries of its GQA group over every token of the calibration ``samples`` (each input_ids
    [1, T]), signed along their mean. Deterministic; cached on disk per model weights and samples
    (``calibration.cached_calibration``), so each model is measured once. kvpress downloads published filters
    instead; none can be downloaded here, and these come from the same model's own queries.

    Example: ``samples = [torch.tensor([w]) for w in kvcompile.eval.fidelity.prose_windows(tok, 8, 512)]``, then
    ``kvcompile.Recipe("qfilter-smol", "qfilter", scorer_args={"filters": calibrate(cm, samples)})``.
    """
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 or s.shape[1] < 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    ids = torch.cat([s.flatten() for s in samples])
    params = {"lengths": [s.shape[1] for s in samples]}
    rows = cached_calibration("qfilter", model, ids, params, lambda: _measure(model, samples))
    return tuple(tuple(tuple(h) for h in layer) for layer in rows)


@torch.no_grad()
def _measure(model, samples: list[Tensor]) -> list[list[list[float]]]:
    runner = calibration_runner(model, window=max(s.shape[1] for s in samples))
    Hkv, layers = runner.spec.num_kv_heads, runner.programs.layers
    gram, total = [0.0] * len(layers), [0.0] * len(layers)
    for ids in samples:
        runner.reset()
        runner.prefill(ids.to(runner.device), compress=False, logits="last")
        for layer in layers:
            obs = observe(runner.cache, layer)
            g, t = query_moments(obs.queries, obs.query_positions, Hkv)
            gram[layer.index], total[layer.index] = gram[layer.index] + g[0], total[layer.index] + t[0]
    return principal_direction(torch.stack(gram), torch.stack(total)).tolist()
