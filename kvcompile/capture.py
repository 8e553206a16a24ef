"""Capture a model's forward as an FX graph: (tokens, positions) -> logits, no framework cache.

``torch.export`` (non-strict) traces the model once with a dynamic batch and length; the result is normalised to
a plain calling convention ``forward(input_ids, position_ids) -> logits`` so the passes can add their own inputs.
The model object is not modified (its train/eval mode is restored).
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn

from .spec import ModelSpec


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def capture(model: nn.Module, spec: ModelSpec) -> fx.GraphModule:
    """Export ``model`` and return ``forward(input_ids [B, T], position_ids [B, T]) -> logits [B, T, V]``."""
    device = next(model.parameters()).device
    ids = torch.zeros(2, 8, dtype=torch.long, device=device)
    pos = torch.arange(8, device=device).expand(2, 8)
    max_len = (spec.max_positions or 2**16) - 1
    dims = {0: torch.export.Dim("batch", min=1, max=4096), 1: torch.export.Dim("tokens", min=1, max=max_len)}
    with _eval_mode(model), torch.no_grad():
        if spec.hf_causal_lm:
            kwargs = {"input_ids": ids, "position_ids": pos, "use_cache": False}
            shapes = {"input_ids": dims, "position_ids": dims, "use_cache": None}
            ep = torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=shapes, strict=False)
        else:
            ep = torch.export.export(model, (ids, pos), dynamic_shapes=(dims, dims), strict=False)
    unlifted = ep.module()
    graph = unlifted.graph
    for guard in [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        graph.erase_node(guard)  # export's input-shape guards; the runtime validates inputs itself
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    for extra in inputs[2:]:
        if extra.users:
            raise ValueError(f"captured graph uses an unexpected input {extra.name!r}")
        graph.erase_node(extra)
    output = next(n for n in graph.nodes if n.op == "output")
    flat = output.args[0]
    logits = flat[0] if isinstance(flat, (tuple, list)) else flat
    output.args = (logits,)
    graph._codegen = fx.graph.CodeGen()
    gm = fx.GraphModule(unlifted, graph)
    gm.recompile()
    return gm
