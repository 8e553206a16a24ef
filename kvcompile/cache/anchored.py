"""An anchored format's tables (``kernels.anchored``): per sequence, each head's anchors and each layer's coded
residuals, which the rows of an anchored format pool (``PageFormat.anchored``) decode against. Written only by
``keep``, from a plan that carries them (``Plan.anchored``, which ``kvcompile.anchoring`` makes); a row's tables count
in its ``bytes_held`` once it stores format entries.

    fmt_anchors    [L, 2, B, Hkv, 1 + A, D] fp32  (before any compression: A = 2, so a traced program sees no 1)
    fmt_residuals  [L, 2, B, R, D / 4 + 2] uint8  (R = 2 likewise; a plan may hold none)

For any other format both are empty ([L, 0, B, Hkv, 0, D] and [L, 0, B, 0, 0]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.anchored import residual_bytes
from ..kernels.formats import get_format
from ..plan import Plan

MIN_SLOTS = 2


class AnchorTables:
    """The anchored format's table state and its one writer (mixed into ``PagedKVCache`` through ``FormatPool``)."""

    @property
    def anchored(self) -> bool:
        """Whether the page format is anchored (its rows decode against these tables)."""
        return self.page_format is not None and get_format(self.page_format).anchored

    def _empty_anchor_tables(self, batch_size: int) -> None:
        L, Hkv, D, dev = self.num_layers, self.num_kv_heads, self.head_dim, self.device
        on = self.anchored
        n = MIN_SLOTS if on else 0
        self.fmt_anchors = torch.zeros(L, 2 * on, batch_size, Hkv, n + on, D, device=dev)
        self.fmt_residuals = torch.zeros(L, 2 * on, batch_size, n, residual_bytes(D) * on, dtype=torch.uint8,
                                         device=dev)

    def table_bytes(self) -> Tensor:
        """[B] bytes of the anchored tables each row holds: all of its tables once it stores format entries."""
        B = self.batch_size
        per_row = (self.fmt_anchors.nbytes + self.fmt_residuals.nbytes) // max(B, 1)
        return (self.fmt_lengths.sum(dim=(0, 2)) > 0).long() * per_row

    def _keep_anchored(self, plan: Plan) -> Plan:
        """Store every entry ``plan`` keeps as the anchored row it carries, with its tables; return the plan of the
        model-dtype pool, which then holds nothing."""
        L, B, Hkv = plan.counts.shape
        K = plan.keep.shape[-1]
        live = torch.arange(K, device=self.device) < plan.counts[..., None]
        heads = torch.arange(L * B * Hkv, device=self.device).view(L, B, Hkv, 1).expand(-1, -1, -1, K)
        index = torch.arange(K, device=self.device).expand_as(heads)
        positions = self.positions()
        pos = positions.gather(-1, plan.keep.clamp_max(positions.shape[-1] - 1))
        rows, none = plan.anchored.rows, torch.zeros(int(live.sum()), 0, device=self.device)
        self._lay_out([(heads[live], index[live], rows[..., 0, :][live], none, rows[..., 1, :][live], none,
                        pos[live].to(torch.int32))], plan.counts)
        self.fmt_anchors = plan.anchored.anchors.float()
        self.fmt_residuals = plan.anchored.residuals
        zero = torch.zeros_like(plan.counts)
        return Plan(zero[..., None], zero)
