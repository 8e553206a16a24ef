"""The programs' calling convention, declared once: what a rewritten program takes, and which sizes vary.

Every program is ``forward(*INPUTS) -> logits``. The passes add the inputs after the captured graph's own two
(``passes.InsertPagedAttention``), the runtime fills them from a ``cache.Step`` and the cache
(``programs.Programs.run``), ``torch.compile`` marks the varying sizes dynamic, and ``artifact.export`` turns the
same names into ``torch.export`` dimensions. Dimension names: batch rows, tokens of the call, pages of the pool,
width of the page table, ring slots, the same two of the format pool (``cache.formatted``), the anchors a head
and the residual slots a layer of an anchored format's tables hold (``cache.anchored``), and the pages of the log-weight
channel (``cache.weights``: the pool's pages in a weighted cache, else 0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Input:
    name: str
    dims: tuple[tuple[int, str], ...]  # (dim, name) of every size that varies from call to call
    source: str  # "model": the captured graph's own input; "step": from a ``cache.Step``; "cache": a cache tensor
    per_layer: bool = False  # a format-pool tensor indexed by layer first (``FormatPages.of_layer``)

    @property
    def field(self) -> str:
        """The name of a format-pool tensor in the bundle attention reads (``kernels.format_pages.FormatPages``)."""
        return self.name.removeprefix("fmt_")


# The format pool (``cache.formatted``): entries stored in a page format and the tables they decode against. The
# attention ops take it as one argument, a list in this order, and read it by these names.
FORMAT_POOL = (
    *(Input(name, ((0, "fmt_pages"),), "cache") for name in ("fmt_k", "fmt_k_meta", "fmt_v", "fmt_v_meta", "fmt_pos")),
    Input("fmt_table", ((1, "batch"), (3, "fmt_width")), "cache", per_layer=True),
    Input("fmt_lengths", ((1, "batch"),), "cache", per_layer=True),
    Input("fmt_basis", (), "cache", per_layer=True),
    Input("fmt_anchors", ((2, "batch"), (4, "anchors")), "cache", per_layer=True),
    Input("fmt_residuals", ((2, "batch"), (3, "residuals")), "cache", per_layer=True),
)
INPUTS = (
    Input("input_ids", ((0, "batch"), (1, "tokens")), "model"),
    Input("position_ids", ((0, "batch"), (1, "tokens")), "step"),
    Input("q_pos", ((0, "batch"), (1, "tokens")), "step"),
    Input("slots", ((1, "batch"), (3, "tokens")), "step"),
    Input("ring_slots", ((0, "batch"), (1, "tokens")), "step"),
    Input("k_pages", ((0, "pages"),), "cache"),
    Input("v_pages", ((0, "pages"),), "cache"),
    Input("page_pos", ((0, "pages"),), "cache"),
    Input("page_lw", ((0, "lw_pages"),), "cache"),
    Input("page_table", ((1, "batch"), (3, "width")), "cache"),
    Input("lengths", ((1, "batch"),), "cache"),
    Input("obs_q", ((1, "batch"), (3, "ring")), "cache"),
    Input("obs_lse", ((1, "batch"), (3, "ring")), "cache"),
    *FORMAT_POOL,
)
ADDED = tuple(i.name for i in INPUTS[2:])  # what the passes add after (input_ids, position_ids)
CACHE_NAMES = tuple(i.name for i in INPUTS if i.source == "cache")  # what ``PagedKVCache.program_tensors`` gives
