"""Graph passes that turn a captured model into one whose attention runs over the paged cache.

Order (``rewrite``): InsertPagedAttention (every SDPA node -> kvcompile op with its layer index), then
KeepLastLogits when only the last position's logits are wanted, then StreamWeightsLinear when asked (the CPU decode
program), then DropDeadMaskCode (the model's own mask code is now dead). ``for_eager_run`` is a copy of a rewritten
program for eager runs only (``CallBodiesDirectly``).
"""

from __future__ import annotations

from torch import fx

from ..spec import ModelSpec
from .base import GraphPass, PassManager
from .direct_calls import CallBodiesDirectly
from .last_logits import KeepLastLogits
from .paged_attention import DropDeadMaskCode, InsertPagedAttention
from .sdpa import UnsupportedGraph
from .streamed_linear import StreamWeightsLinear


def rewrite(
    captured: fx.GraphModule, spec: ModelSpec, *, decode: bool, last_logits: bool = False, packed: bool = False,
    stream_weights: bool = False,
) -> tuple[fx.GraphModule, InsertPagedAttention]:
    """A copy of ``captured`` whose attention reads and writes the paged cache (a prefill or a decode program),
    and the attention pass, which recorded each layer's softmax scale and output projection.

    The program is ``forward(*signature.INPUTS) -> logits``; with ``last_logits`` the logits are [B, 1, V]; with
    ``packed`` it may only run on a packed cache (``PagedKVCache.packed``), which it reads without gathering; with
    ``stream_weights`` its projections run as ``streamed_linear`` (few rows on CPU).
    """
    gm = _copy(captured)
    paged = InsertPagedAttention(spec, decode=decode, packed=packed)
    order = [paged] + [KeepLastLogits()] * last_logits + [StreamWeightsLinear()] * stream_weights + [DropDeadMaskCode()]
    return PassManager(order)(gm), paged


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module over ``gm``'s graph copied (the same weights)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def for_eager_run(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of a rewritten ``program`` that calls the attention ops' bodies directly (``CallBodiesDirectly``)."""
    return PassManager([CallBodiesDirectly()])(_copy(program))


__all__ = [
    "CallBodiesDirectly", "DropDeadMaskCode", "GraphPass", "InsertPagedAttention", "KeepLastLogits", "PassManager",
    "StreamWeightsLinear", "UnsupportedGraph", "for_eager_run", "rewrite",
]
