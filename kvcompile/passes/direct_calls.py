"""Eager programs call the attention ops' Python bodies directly instead of through the dispatcher."""

from __future__ import annotations

from torch import fx

from .. import ops
from .base import GraphPass


class CallBodiesDirectly(GraphPass):
    """Point every kvcompile attention op of a graph at the Python function the op runs (``ops.EAGER_BODIES``).

    Why: through the dispatcher, an op that mutates its inputs pays torch's version-counter bookkeeping, which
    re-reads the op's 24-argument schema on every call: ~0.6 ms on this project's CPU, 18 ms of a 30-layer decode
    step. The body does the same work (its in-place writes bump the version counters themselves). Only for graphs
    that run eagerly: ``torch.compile`` and ``torch.export`` must see the ops, so the programs a ``Programs`` keeps,
    saves and compiles are never rewritten by this pass (``Programs.run`` runs a rewritten copy)."""

    def __call__(self, gm: fx.GraphModule) -> None:
        self.matched = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in ops.EAGER_BODIES:
                node.target = ops.EAGER_BODIES[node.target]
                self.matched += 1
