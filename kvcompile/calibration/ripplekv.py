"""RippleKV's calibration: each layer's sensitivity to noise in its value cache (``methods.ripplekv``)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import cached_calibration, calibration_runner


def calibrate(model, input_ids: Tensor, *, noise: float = 0.5, tail: int = 32, seed: int = 0) -> tuple[float, ...]:
    """Per-layer sensitivity of a ``CompressedModel`` to its value cache: KL(clean || perturbed) of the next-token
    distributions over the last ``tail`` tokens of ``input_ids`` [B, T] after layer l's cached values of the rest
    got Gaussian noise of ``noise`` times their RMS (norm-adaptive). Cached on disk per model and input.

    Example: ``kvcompile.Recipe("ripplekv", "snapkv", "ripplekv", allocator_args={"layer_sensitivity":
    calibrate(cm, ids)})``.
    """
    if input_ids.dim() != 2 or not 0 < tail < input_ids.shape[1]:
        raise ValueError(f"input_ids must be [batch, tokens] with more than tail={tail} tokens")
    params = {"noise": noise, "tail": tail, "seed": seed}
    return tuple(cached_calibration("ripplekv", model, input_ids, params, lambda: _measure(model, input_ids, **params)))


@torch.no_grad()
def _measure(model, input_ids: Tensor, noise: float, tail: int, seed: int) -> list[float]:
    runner = calibration_runner(model)
    ids = input_ids.to(runner.device)
    prefix, suffix = ids[:, :-tail], ids[:, -tail:]

    runner.prefill(prefix, compress=False, logits="last")

    def run(layer: int | None) -> Tensor:  # the suffix's next-token log-probs, over a copy of the prefix's cache
        copy = runner.fork()
        if layer is not None:
            _perturb_values(copy.cache, layer, noise, torch.Generator(copy.device).manual_seed(seed + layer))
        return torch.log_softmax(copy.prefill(suffix, compress=False).float(), -1)

    clean = run(None)
    kl = [(clean.exp() * (clean - run(layer))).sum(-1).mean() for layer in range(runner.spec.num_layers)]
    return torch.stack(kl).clamp_min(0).tolist()


def _perturb_values(cache, layer: int, noise: float, generator: torch.Generator) -> None:
    """Add Gaussian noise of ``noise`` x RMS of the layer's held values to every value it holds, in place."""

    def perturb(held: Tensor) -> Tensor:
        rms = held.float().pow(2).mean().sqrt()
        return held + torch.randn(held.shape, generator=generator, device=held.device) * noise * rms

    _, values, _, valid = cache.dense(layer)
    values[valid] = perturb(values[valid])
    cache.rewrite(layer, values=values)
