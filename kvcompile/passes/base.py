"""What a kvcompile graph pass is, and the manager that owns their order."""

from __future__ import annotations

import hashlib
import inspect
import logging

from torch import fx

log = logging.getLogger("kvcompile.passes")


class GraphPass:
    """A rewrite of an ``fx.GraphModule`` in place. ``matched`` counts what it rewrote on its last run."""

    matched: int = 0

    def __call__(self, gm: fx.GraphModule) -> None:
        raise NotImplementedError

    def uuid(self) -> str:
        """Hash of the pass's source and config: a changed pass must invalidate any cached compiled graph."""
        text = inspect.getsource(type(self)) + repr(sorted(vars(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()


class PassManager:
    """Runs passes in the order given, then lints and recompiles once. The order is the caller's recipe."""

    def __init__(self, passes: list[GraphPass]):
        self.passes = passes

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for p in self.passes:
            p(gm)
            log.debug("%s matched %d", type(p).__name__, p.matched)
        gm.graph.lint()
        gm.recompile()
        return gm

    def uuid(self) -> str:
        return hashlib.sha256("".join(p.uuid() for p in self.passes).encode()).hexdigest()
