"""SPECTRA's calibration (``methods.spectra``; METHODS.md §12): each (layer, KV head)'s uncentered second moments of
its keys before RoPE and of its values, over a model's own prefill of calibration text. §12 factors the projection
through its inputs' moments; its basis depends on them only through these (``methods.spectra``)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import cached_calibration, prefill_heads, unrotated


def calibrate(model, samples: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """[L] (keys [Hkv, D, D], values [Hkv, D, D]): ``E[xᵀx]`` in float64 over every token of the calibration
    ``samples`` (input_ids [1, T] each) read by a ``CompressedModel``."""
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    rotary = model.spec.rotary or [()] * model.spec.num_layers
    sums: list[list[Tensor]] = []
    count = 0
    for ids in samples:
        for layer, ((_, _, keys, values, pos), inv_freq) in enumerate(zip(prefill_heads(model, ids), rotary)):
            valid = (pos >= 0)[..., None]
            k = unrotated(keys, pos, inv_freq).double() * valid
            v = values.double() * valid
            moments = [k.transpose(-1, -2) @ k, v.transpose(-1, -2) @ v]
            if len(sums) <= layer:
                sums.append([torch.zeros_like(m) for m in moments])
            sums[layer] = [a + b for a, b in zip(sums[layer], moments)]
        count += int((pos[0] >= 0).sum())
    return [(k / count, v / count) for k, v in sums]


SAMPLES, LENGTH, SEED = 4, 256, 0  # the calibration text apply samples (inferred: §12 names no amount)


def sampled_moments(model) -> list[tuple[Tensor, Tensor]]:
    """``calibrate`` over text the model samples itself (``SAMPLES`` rows of ``LENGTH`` tokens at temperature 1
    from its BOS token, seeded): what ``kvcompile.apply`` calibrates a SPECTRA format on, since it holds a model and
    no tokenizer. Measured once per model weights (``cached_calibration``). ``model``: a full-budget
    ``CompressedModel``."""
    config = getattr(model.source, "config", None)
    bos = getattr(config, "bos_token_id", None)
    start = torch.full((SAMPLES, 1), bos if isinstance(bos, int) else 0, dtype=torch.long)

    def compute():
        text = model.generate(start.to(model.device), max_new_tokens=LENGTH - 1, do_sample=True,
                              generator=torch.Generator(model.device).manual_seed(SEED), eos_token_id=[])
        return [[m.tolist() for m in pair] for pair in calibrate(model, [row[None] for row in text.cpu()])]

    params = {"samples": SAMPLES, "length": LENGTH, "seed": SEED}
    result = cached_calibration("spectra", model, start[:1], params, compute)
    return [tuple(torch.tensor(m, dtype=torch.float64) for m in pair) for pair in result]
