"""Project only the last position to the vocabulary: what generation needs from a prefill."""

from __future__ import annotations

import torch
from torch import fx

from .base import GraphPass
from .sdpa import UnsupportedGraph

aten = torch.ops.aten


class KeepLastLogits(GraphPass):
    """Slice the hidden states to the last position right before the output projection.

    The projection is the last ``aten.linear`` on the path from the output back through single-tensor ops
    (softcapping, casts, views), so the model's own post-processing still runs. Saves T x V x hidden work per
    prefill (the largest matmul of a small model's prefill).
    """

    def __call__(self, gm: fx.GraphModule) -> None:
        node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        while node.op == "call_function" and node.target != aten.linear.default:
            tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
            if len(tensor_args) != 1:
                raise UnsupportedGraph(f"cannot find the output projection behind {node.format_node()}")
            node = tensor_args[0]
        if node.op != "call_function":
            raise UnsupportedGraph("the graph's output is not computed by a linear projection")
        hidden = node.args[0]
        with gm.graph.inserting_before(node):
            last = gm.graph.call_function(aten.slice.Tensor, (hidden, 1, -1, 2**62))
        node.replace_input_with(hidden, last)
        self.matched = 1
