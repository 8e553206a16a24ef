"""The calibration of latent page formats (``kernels.latent``): each (layer, KV head)'s uncentered second moments of its
keys and queries before RoPE and of its values, and its key mean, over a model's own prefill of calibration text.
SPECTRA (docs/methods_formats.md#spectra) factors the projection through its inputs' moments, and its basis depends on
them only through the keys' and values' (``methods.spectra``); SAKI reads the keys', queries' and the mean."""

from __future__ import annotations

import torch
from torch import Tensor

from ..methods.moments import Moments
from . import cached_calibration, prefill_heads, unrotated


def calibrate(model, samples: list[Tensor]) -> list[Moments]:
    """Per layer, the ``Moments`` (float64) of a ``CompressedModel``'s keys, values and queries over every token of
    the calibration ``samples`` (input_ids [1, T] each)."""
    if not samples or any(s.dim() != 2 or s.shape[0] != 1 for s in samples):
        raise ValueError("samples must be a non-empty list of input_ids of shape [1, T]")
    rotary = model.spec.rotary or [()] * model.spec.num_layers
    sums: list[list[Tensor]] = []
    count = [0, 0]  # tokens, queries (per KV head: its GQA group's)
    for ids in samples:
        for layer, ((q, q_pos, keys, values, pos), inv_freq) in enumerate(zip(prefill_heads(model, ids), rotary)):
            valid = (pos >= 0)[..., None]
            k = unrotated(keys, pos, inv_freq).double() * valid
            v, q = values.double() * valid, unrotated(q, q_pos, inv_freq).double()
            parts = [k.transpose(-1, -2) @ k, v.transpose(-1, -2) @ v, q.transpose(-1, -2) @ q, k.sum(1)]
            if len(sums) <= layer:
                sums.append([torch.zeros_like(m) for m in parts])
            sums[layer] = [a + b for a, b in zip(sums[layer], parts)]
        count = [count[0] + int((pos[0] >= 0).sum()), count[1] + q.shape[1]]
    return [Moments(k / count[0], v / count[0], q / count[1], mean / count[0]) for k, v, q, mean in sums]


SAMPLES, LENGTH, SEED = 4, 256, 0  # the calibration text apply samples (inferred: SPECTRA names no amount)


def sampled_moments(model) -> list[Moments]:
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
        return [[m.tolist() for m in layer] for layer in calibrate(model, [row[None] for row in text.cpu()])]

    params = {"samples": SAMPLES, "length": LENGTH, "seed": SEED, "moments": Moments._fields}
    result = cached_calibration("spectra", model, start[:1], params, compute)
    return [Moments(*(torch.tensor(m, dtype=torch.float64) for m in layer)) for layer in result]
