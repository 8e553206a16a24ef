"""RippleKV (https://arxiv.org/abs/2608.08684): layer budgets from the KL a perturbed value cache causes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import reference
from .base import Allocator, register_allocator, water_fill
from .calibration import cached_calibration, calibration_runner


@register_allocator("ripplekv")
@dataclass
class RippleKV(Allocator):
    """Layer l's share of the budget grows as ``ratio ** s_l`` with its min-max normalised sensitivity s_l (the
    most sensitive layer gets ``ratio`` times the least sensitive one's share); the layer's KV heads split it
    evenly, and what a head cannot hold goes to the others (total preserved).

    Inferred from the abstract alone (METHODS.md section 16): the noise form, the KL measure, the normalisation
    and the exponential map with its ratio. ``layer_sensitivity`` comes from ``calibrate`` (measured once per model
    and cached on disk); without it every layer weighs the same, which is the uniform allocation.
    """

    layer_sensitivity: tuple[float, ...] | None = None
    ratio: float = 4.0

    def __post_init__(self):
        if self.ratio < 1:
            raise ValueError(f"ratio must be >= 1, got {self.ratio}")
        if self.layer_sensitivity is not None:
            if any(not s >= 0 for s in self.layer_sensitivity):  # also rejects NaN
                raise ValueError(f"layer_sensitivity must be >= 0, got {self.layer_sensitivity}")
            self.layer_sensitivity = tuple(float(s) for s in self.layer_sensitivity)

    def layer_weights(self, num_layers: int) -> Tensor:
        """[L] budget weight per layer."""
        if self.layer_sensitivity is None:
            return torch.ones(num_layers, dtype=torch.float64)
        if len(self.layer_sensitivity) != num_layers:
            raise ValueError(f"layer_sensitivity has {len(self.layer_sensitivity)} layers, the model has {num_layers}")
        s = torch.tensor(self.layer_sensitivity, dtype=torch.float64)
        spread = s.max() - s.min()
        normalised = (s - s.min()) / spread if spread > 0 else torch.zeros_like(s)
        return self.ratio**normalised

    def allocate(self, scores, lengths, budget):
        L, B, Hkv, _ = scores.shape
        weights = self.layer_weights(L).to(scores.device)[None, :, None].expand(B, L, Hkv).reshape(B, L * Hkv)
        caps = lengths.long().permute(1, 0, 2).reshape(B, L * Hkv)
        return water_fill(weights, caps, budget).reshape(B, L, Hkv).permute(1, 0, 2)


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
    _, values, _, valid = cache.dense(layer)
    index = torch.arange(values.shape[2], device=values.device).expand(valid.shape)
    rows = reference.rows_of(cache.page_table[layer], index, cache.page_size)
    held = values[valid].float()
    rms = held.pow(2).mean().sqrt()
    jitter = torch.randn(held.shape, generator=generator, device=held.device) * noise * rms
    cache.v_pages.view(-1, cache.head_dim).index_add_(0, rows[valid], jitter.to(cache.dtype))
