"""Byte accounting of the paged cache: every tensor it owns, what each holds, and the peaks since ``setup``.

``bytes_held`` is the K/V payload of the pages that hold tokens, in both pools (page rounding, a page format's
scales and zero points, an anchored format's anchors and residuals, and a weighted cache's log-weights included:
what budgets bound);
``bytes_allocated`` is every byte of every tensor the cache owns, broken down into payload, free pages (the rest of
the pool: the scratch page, reserved room), positions, tables (page tables, lengths, counters) and the observation
ring. A test walks the cache object and checks the breakdown sums to what it really allocated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.formats import get_format

# what each format-pool tensor holds, for ``breakdown``
FORMAT_KINDS = {"fmt_k": "pages", "fmt_k_meta": "pages", "fmt_v": "pages", "fmt_v_meta": "pages",
                "fmt_pos": "positions", "fmt_table": "tables", "fmt_lengths": "tables", "fmt_basis": "tables",
                "fmt_anchors": "pages", "fmt_residuals": "pages", "fmt_channels": "tables"}


class ByteAccounting:
    """What ``PagedKVCache`` reports about its own memory (mixed into it)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V in one page, and of its log-weights in a ``weighted`` cache (``cache.weights``)."""
        weights = self.page_size * self.page_lw.element_size() if self.weighted else 0
        return 2 * self.page_size * self.head_dim * self.k_pages.element_size() + weights

    @property
    def token_bytes(self) -> int:
        """Bytes of K plus V of one token of one KV head in the model's dtype (what budgets are measured in)."""
        return 2 * self.head_dim * self.k_pages.element_size()

    @property
    def stored_page_bytes(self) -> int:
        """Bytes of one page of one KV head as compression stores it: in the page format (codes, scales and zero
        points), else the model's dtype."""
        if self.page_format is None:
            return self.page_bytes
        return get_format(self.page_format).page_bytes(self.head_dim, self.page_size)

    @property
    def stored_token_bytes(self) -> int:
        """``stored_page_bytes`` per token, rounded up (a page's metadata shared by its tokens)."""
        return -(-self.stored_page_bytes // self.page_size)

    def pages_held(self, lengths: Tensor | None = None) -> Tensor:
        """[L, B, Hkv] model-dtype pages that hold at least one token (of ``lengths``: format pages)."""
        return ((self.lengths if lengths is None else lengths).long() + self.page_size - 1) // self.page_size

    def bytes_held(self) -> Tensor:
        """[B] bytes of K/V pages holding tokens, per sequence, both pools (page rounding included), and of the
        tables their rows decode against (``cache.anchored``, ``table_bytes``)."""
        held = self.pages_held().sum(dim=(0, 2)) * self.page_bytes + self.table_bytes()
        return held + self.pages_held(self.fmt_lengths).sum(dim=(0, 2)) * self.stored_page_bytes

    def budget_bytes(self, budget, tokens: Tensor) -> Tensor:
        """[B] bytes a ``budget.Budget`` lets each row hold once it has read ``tokens`` [B]."""
        L, Hkv, tb = self.num_layers, self.num_kv_heads, self.token_bytes
        return torch.tensor([budget.bytes_per_sequence(int(n), L, Hkv, tb) for n in tokens.tolist()],
                            dtype=torch.long, device=tokens.device)

    def budget_tokens(self, budget, tokens: Tensor) -> Tensor:
        """[B] tokens per (layer, KV head) a budget spread evenly allows each row (a decode-time cap)."""
        return self.budget_bytes(budget, tokens) // (self.num_layers * self.num_kv_heads * self.token_bytes)

    def tensors(self) -> dict[str, tuple[Tensor, str]]:
        """Every tensor the cache owns, by name, with its kind: "pages" (K/V payload and free pages), "positions",
        "tables" (page tables, lengths, counters) or "ring" (the observation ring)."""
        return {
            "k_pages": (self.k_pages, "pages"), "v_pages": (self.v_pages, "pages"),
            "page_pos": (self.page_pos, "positions"), "page_lw": (self.page_lw, "pages"),
            "page_table": (self.page_table, "tables"), "lengths": (self.lengths, "tables"),
            "n_pages": (self.n_pages, "tables"), "seen": (self.seen, "tables"),
            "token_ids": (self.token_ids, "tables"), "segment_starts": (self.segment_starts, "tables"),
            "ring.queries": (self.ring.queries, "ring"), "ring.lse": (self.ring.lse, "ring"),
            "ring.positions": (self.ring.positions, "ring"),
            **{name: (getattr(self, name), kind) for name, kind in FORMAT_KINDS.items()},
        }

    def breakdown(self, held: int | None = None) -> dict[str, int]:
        """Bytes allocated, by what they hold: payload (pages holding tokens = ``bytes_held``), free_pages (the
        rest of the pool: scratch, reserved room, rounding), positions, tables, ring. They sum to every byte."""
        kinds = {"pages": 0, "positions": 0, "tables": 0, "ring": 0}
        for tensor, kind in self.tensors().values():
            kinds[kind] += tensor.nbytes
        held = int(self.bytes_held().sum()) if held is None else held
        return {"payload": held, "free_pages": kinds["pages"] - held, "positions": kinds["positions"],
                "tables": kinds["tables"], "ring": kinds["ring"]}

    def _note(self, held: bool = False) -> None:
        """Raise the peaks to the current bytes (``held``: payload too, which costs a host sync)."""
        parts = self.breakdown(int(self.bytes_held().sum()) if held else self.peaks.get("payload", 0))
        parts["allocated"] = sum(parts.values())
        for name, value in parts.items():
            self.peaks[name] = max(self.peaks.get(name, 0), value)

    def stats(self) -> dict:
        """Bytes held and allocated (with a breakdown and the peak of each since ``setup``), per-head lengths."""
        self._note(held=True)
        parts = self.breakdown()
        return {
            "bytes_held": parts["payload"],
            "bytes_held_per_sequence": self.bytes_held().tolist(),
            "bytes_allocated": sum(parts.values()),
            "bytes": parts,
            "peak_bytes": dict(self.peaks),
            "page_size": self.page_size,
            "pages_held": int(self.pages_held().sum()),
            "ring_queries": self.ring.capacity,
            "lengths": self.held().tolist(),  # [L][B][Hkv]
            "formats": self.format_stats(),
        }

    def format_stats(self) -> dict[str, dict]:
        """Per pool (the model's dtype, the page format): entries held, and the bytes of their pages as codes,
        scales and zero points ("meta"), log-weights ("weights", a weighted cache's), positions, and of the tables
        they decode against ("tables": ``cache.anchored``'s anchors and residuals)."""
        held = {str(self.dtype).removeprefix("torch."): (self.lengths, self.k_pages, self.v_pages, None, None,
                                                         self.page_lw if self.weighted else None, self.page_pos)}
        if self.page_format is not None:
            held[self.page_format] = (self.fmt_lengths, self.fmt_k, self.fmt_v, self.fmt_k_meta, self.fmt_v_meta,
                                      None, self.fmt_pos)
        out = {}
        for name, (lengths, k, v, k_meta, v_meta, weights, pos) in held.items():
            pages = int(self.pages_held(lengths).sum())
            page = lambda t: 0 if t is None else t[0].nbytes  # noqa: E731  (bytes of one page of t)
            out[name] = {"tokens": int(lengths.long().sum()), "codes": pages * (page(k) + page(v)),
                         "meta": pages * (page(k_meta) + page(v_meta)), "weights": pages * page(weights),
                         "positions": pages * page(pos), "tables": 0}
        if self.page_format is not None:
            out[self.page_format]["tables"] = int(self.table_bytes().sum())
        return out
