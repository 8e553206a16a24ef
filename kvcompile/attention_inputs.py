"""The ``HiddenStates`` source: each layer's attention input (the normed hidden state its key and value projections
read), for every token the cache read.

The paged programs do not output hidden states, so this is one dense forward pass of the model the ``CompressedModel``
was applied to (its ``source``, which shares its weights) over the tokens read, with a hook on each attention module's
input. A scorer reads these where kvpress does (docs/methods_learned.md); kvpress gets them from the forward
it is already running, here they cost one more prefill, so the context is read in one go (as for ``Gradients``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


@torch.no_grad()
def attention_inputs(model: nn.Module, input_ids: Tensor, real: Tensor, norms: bool = False) -> Tensor:
    """[L, B, P, hidden]: layer l's attention input at position p of row b (the p-th real token of ``input_ids``
    [B, T], ``real`` its non-pad mask), 0 beyond a row's length. A transformers causal LM (``get_decoder().layers``,
    each with ``self_attn`` called with ``hidden_states``). ``norms``: each input's norm alone ([L, B, P, 1]), taken
    as the pass runs, so no [L, B, T, hidden] copy is held."""
    layers = model.get_decoder().layers
    seen: list[Tensor] = []

    def keep(module, args, kwargs):
        h = (args[0] if args else kwargs["hidden_states"]).float()
        seen.append(h.norm(dim=-1, keepdim=True) if norms else h)

    hooks = [layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True) for layer in layers]
    try:
        mask = real.long()
        model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    h = torch.stack(seen)  # [L, B, T, hidden]
    positions = (real.long().cumsum(1) - 1).clamp_min(0)  # [B, T]
    table = h.new_zeros(h.shape[0], h.shape[1], int(real.sum(1).max()), h.shape[-1])
    rows = torch.arange(h.shape[1], device=h.device)[:, None].expand_as(positions)
    table[:, rows[real.bool()], positions[real.bool()]] = h[:, real.bool()]
    return table
