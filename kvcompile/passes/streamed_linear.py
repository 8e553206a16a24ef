"""Decode's projections in the forms that read a weight at the memory's speed on the CPU: weight-times-activations
products for a few rows, the native one-row projection (``kernels.cpu_native``) for one."""

from __future__ import annotations

import torch
from torch import Tensor, fx

from ..kernels import cpu_native, ragged
from .base import GraphPass

aten = torch.ops.aten


def streamed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x^T)^T``: the same products, summed in another order.

    A decode step projects a handful of rows (one per sequence) through every weight, so it is bound by reading
    the weights. On CPU, MKL runs ``x @ weight^T`` with few rows at well under the memory bandwidth (measured on
    the project's 2-core machine with cold weights, batch 4: all of SmolLM2's layer projections 135 ms as
    ``linear``, 52 ms in this form; its 49152-row vocabulary projection 47 ms against 12 ms); with one row both
    forms cost the same. ``x^T`` must stay a transposed view: made contiguous, it loses the gain.

    One row (a batch-1 decode) both forms read at about a third of the bandwidth on some CPUs, so it goes to the
    native projection (``cpu_native.linear``) where it serves and is the faster here (``cpu_native.runs_linear``);
    traced, through the opaque ``ops.native_linear``, which chooses when it runs.
    """
    rows = x.reshape(-1, x.shape[-1])
    concrete = ragged.concrete(rows)
    if not concrete and cpu_native.serves_linear(rows, weight):
        out = torch.ops.kvcompile.native_linear(rows, weight)
    elif concrete and cpu_native.runs_linear(rows, weight):
        out = cpu_native.linear(rows, weight)
    else:
        out = torch.mm(weight, rows.t()).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class StreamWeightsLinear(GraphPass):
    """Route every ``aten.linear`` through ``streamed_linear``. For the decode programs on CPU (``passes.rewrite``)
    only: the gain was measured for decode's few rows, not for prefill's thousands, nor for CUDA's GEMMs."""

    def __call__(self, gm: fx.GraphModule) -> None:
        self.matched = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target == aten.linear.default:
                node.target = streamed_linear
                self.matched += 1
