"""Graph passes that turn a captured model into one whose attention runs over the paged cache.

Order (``rewrite``): InsertPagedAttention (every SDPA node -> kvcompile op with its layer index), then
DropDeadMaskCode (the model's own mask code is now dead).
"""

from __future__ import annotations

from torch import fx, nn

from ..spec import ModelSpec
from .base import GraphPass, PassManager
from .paged_attention import DropDeadMaskCode, InsertPagedAttention
from .sdpa import UnsupportedGraph


def rewrite(captured: fx.GraphModule, spec: ModelSpec, cache: nn.Module, *, decode: bool) -> fx.GraphModule:
    """A copy of ``captured`` whose attention reads and writes ``cache`` (the prefill or the decode program)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(captured.graph, {}))
    gm = fx.GraphModule(captured, graph)
    gm.kvc_cache = cache
    return PassManager([InsertPagedAttention(spec, decode=decode), DropDeadMaskCode()])(gm)


__all__ = ["GraphPass", "PassManager", "InsertPagedAttention", "DropDeadMaskCode", "UnsupportedGraph", "rewrite"]
