"""Byte accounting of the paged cache: every tensor it owns, what each holds, and the peaks since ``setup``.

``bytes_held`` is the K/V payload of the pages that hold tokens (page rounding included: what budgets bound);
``bytes_allocated`` is every byte of every tensor the cache owns, broken down into payload, free pages (the rest of
the pool: the scratch page, reserved room), positions, tables (page tables, lengths, counters) and the observation
ring. A test walks the cache object and checks the breakdown sums to what it really allocated.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ByteAccounting:
    """What ``PagedKVCache`` reports about its own memory (mixed into it)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V in one page."""
        return 2 * self.page_size * self.head_dim * self.k_pages.element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of K plus V of one token of one KV head."""
        return 2 * self.head_dim * self.k_pages.element_size()

    def pages_held(self) -> Tensor:
        """[L, B, Hkv] pages that hold at least one token."""
        return (self.lengths.long() + self.page_size - 1) // self.page_size

    def bytes_held(self) -> Tensor:
        """[B] bytes of K/V pages holding tokens, per sequence (page rounding included)."""
        return self.pages_held().sum(dim=(0, 2)) * self.page_bytes

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
            "page_pos": (self.page_pos, "positions"),
            "page_table": (self.page_table, "tables"), "lengths": (self.lengths, "tables"),
            "n_pages": (self.n_pages, "tables"), "seen": (self.seen, "tables"),
            "token_ids": (self.token_ids, "tables"),
            "ring.queries": (self.ring.queries, "ring"), "ring.positions": (self.ring.positions, "ring"),
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
            "lengths": self.lengths.tolist(),  # [L][B][Hkv]
        }
