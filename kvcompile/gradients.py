"""The ``Gradients`` source: how much each token's attention output moves the model's last hidden states.

A scorer that reads it (docs/methods_scorers.md) weighs the attention a probe token p pays a key by ||dPhi/da_p^l||, the
gradient of Phi = sum over probes of ||h_p^L||^2 (the last decoder layer's output, before the final norm) with respect
to layer l's attention output at p. The paged programs have no backward, so this is one dense forward and backward pass
of the model the ``CompressedModel`` was applied to (its ``source``, which shares its weights) over the context and the
probes; the weights are left as they were (no gradient is stored on them).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def attention_output_gradients(model: nn.Module, input_ids: Tensor, real: Tensor, probes: Tensor) -> Tensor:
    """[L, B, T] ||dPhi/da_t^l|| for every token t of ``input_ids`` [B, T] (``real``: its non-pad mask) and layer l,
    Phi = the sum of ||h_p^L||^2 over the ``probes`` [B, T] tokens. A transformers causal LM (``get_decoder().layers``,
    each with ``self_attn``)."""
    layers = model.get_decoder().layers
    deltas: list[Tensor] = []

    def add_delta(module, args, out):  # a zero leaf added to the attention output: its gradient is the output's
        attn = out[0] if isinstance(out, tuple) else out
        delta = torch.zeros_like(attn, requires_grad=True)
        deltas.append(delta)
        return (attn + delta, *out[1:]) if isinstance(out, tuple) else attn + delta

    last: list[Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(add_delta) for layer in layers]
    hooks.append(layers[-1].register_forward_hook(lambda m, a, out: last.append(out[0] if isinstance(out, tuple)
                                                                                 else out)))
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for p in params:
                p.requires_grad_(False)
            ids, mask = input_ids.clone(), real.clone().long()
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0), use_cache=False)
            phi = (last[0].pow(2).sum(-1) * probes.to(last[0].device)).sum()
            grads = torch.autograd.grad(phi, deltas)
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.requires_grad_(True)
    return torch.stack([g.float().norm(dim=-1) for g in grads]).masked_fill(~real.bool()[None], 0.0)
