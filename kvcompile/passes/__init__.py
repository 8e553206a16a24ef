"""Graph passes that turn a captured model into one whose attention runs over the paged cache.

Order (``rewrite``): InsertPagedAttention (every SDPA node -> kvcompile op with its layer index), then
KeepLastLogits when only the last position's logits are wanted, then StreamWeightsLinear when asked (the CPU decode
program), then DropDeadMaskCode (the model's own mask code is now dead).
"""

from __future__ import annotations

from torch import fx

from ..spec import ModelSpec
from .base import GraphPass, PassManager
from .paged_attention import DropDeadMaskCode, InsertPagedAttention
from .last_logits import KeepLastLogits
from .sdpa import UnsupportedGraph
from .streamed_linear import StreamWeightsLinear


def rewrite(
    captured: fx.GraphModule, spec: ModelSpec, *, decode: bool, last_logits: bool = False, packed: bool = False,
    stream_weights: bool = False,
) -> tuple[fx.GraphModule, InsertPagedAttention]:
    """A copy of ``captured`` whose attention reads and writes the paged cache (a prefill or a decode program),
    and the attention pass, which recorded each layer's softmax scale and output projection.

    The program is ``forward(*signature.INPUTS) -> logits``; with ``last_logits`` the logits are [B, 1, V]; with ``packed``
    it may only run on a packed cache (``PagedKVCache.packed``), which it reads without gathering; with
    ``stream_weights`` its projections run as ``streamed_linear`` (few rows on CPU).
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(captured.graph, {}))
    gm = fx.GraphModule(captured, graph)
    paged = InsertPagedAttention(spec, decode=decode, packed=packed)
    order = [paged] + [KeepLastLogits()] * last_logits + [StreamWeightsLinear()] * stream_weights + [DropDeadMaskCode()]
    return PassManager(order)(gm), paged


__all__ = [
    "DropDeadMaskCode", "GraphPass", "InsertPagedAttention", "KeepLastLogits", "PassManager",
    "StreamWeightsLinear", "UnsupportedGraph", "rewrite",
]
