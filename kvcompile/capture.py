"""Capture a model's forward as an FX graph: (tokens, positions) -> logits, no framework cache.

``torch.export`` (non-strict) traces the model once with a dynamic batch and length; the result is normalised to
a plain calling convention ``forward(input_ids, position_ids) -> logits`` so the passes can add their own inputs.
The model object is not modified (its train/eval mode is restored).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, fx, nn

from .spec import ModelSpec

_SYM_BUILTINS = {torch.sym_min: min, torch.sym_max: max}


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _export(model: nn.Module, ids: Tensor, pos: Tensor, spec: ModelSpec) -> torch.export.ExportedProgram:
    """``torch.export`` with a dynamic batch and length (export fails if the model specialises either). Where this
    torch cannot prove a guard of the model's shape arithmetic over the range (torch 2.11 on transformers' Llama:
    ``min(64*T, 192*T) == 64*T``), it exports again keeping such guards as runtime assertions instead."""
    max_len = (spec.max_positions or 2**16) - 1
    dims = {0: torch.export.Dim("batch", min=1, max=4096), 1: torch.export.Dim("tokens", min=1, max=max_len)}
    if spec.hf_causal_lm:
        args, kwargs = (), {"input_ids": ids, "position_ids": pos, "use_cache": False}
        shapes = {"input_ids": dims, "position_ids": dims, "use_cache": None}
    else:
        args, kwargs, shapes = (ids, pos), {}, (dims, dims)
    try:
        return torch.export.export(model, args, kwargs=kwargs, dynamic_shapes=shapes, strict=False)
    except torch._dynamo.exc.UserError as e:
        if e.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
            raise
    return torch.export.export(model, args, kwargs=kwargs, dynamic_shapes=shapes, strict=False,
                               prefer_deferred_runtime_asserts_over_guards=True)


def capture(model: nn.Module, spec: ModelSpec) -> fx.GraphModule:
    """Export ``model`` and return ``forward(input_ids [B, T], position_ids [B, T]) -> logits [B, T, V]``."""
    device = next(model.parameters()).device
    ids = torch.zeros(2, 8, dtype=torch.long, device=device)
    pos = torch.arange(8, device=device).expand(2, 8)
    with _eval_mode(model), torch.no_grad():
        ep = _export(model, ids, pos, spec)
    unlifted = ep.module()
    graph = unlifted.graph
    for guard in [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        graph.erase_node(guard)  # export's input-shape guards; the runtime validates inputs itself
    for node in graph.nodes:  # Dynamo (torch 2.11) refuses to compile a call of torch.sym_min/sym_max: the builtins
        if node.op == "call_function" and node.target in _SYM_BUILTINS:  # do the same on ints and SymInts
            node.target = _SYM_BUILTINS[node.target]
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
